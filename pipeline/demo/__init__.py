"""A small workload for `make run`: Python calling C calling back into Python."""
