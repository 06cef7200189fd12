"""Offline side of tbpipe: symbolize raw runs, load them into DuckDB, query and report."""
