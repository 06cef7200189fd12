"""One module per output format or report."""
