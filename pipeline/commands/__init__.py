"""One module per `tbpipe` subcommand; each stays a thin layer over the library API."""
