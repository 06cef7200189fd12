"""`tbpipe query [--db PATH] [--format table|csv|json|parquet] [--output FILE] SQL`"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from tbpipe.pipeline.errors import TbpipeError, UsageError


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


class QueryError(TbpipeError):
    """DuckDB rejected the query (syntax, unknown table, a write on the read-only database...)."""


def run_query(con: Any, sql: str):
    """The query's result as an Arrow table; DuckDB's error as one line."""
    import duckdb

    from tbpipe.pipeline.db.connection import query_arrow

    try:
        return query_arrow(con, sql)
    except duckdb.Error as error:
        text = str(error).strip().splitlines()
        raise QueryError(f"query failed: {text[0] if text else type(error).__name__}") from None


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return str(value)


def write_table(result, console: Console, max_rows: int) -> None:
    """A table, laid out for the terminal or the pipe it goes to (reports/terminal.py)."""
    from rich.markup import escape
    from rich.table import Table

    from tbpipe.pipeline.reports.terminal import print_rows

    table = Table(show_lines=False)
    for name in result.column_names:
        table.add_column(escape(name), overflow="fold")
    records = _records(result.slice(0, max_rows))
    for row in records:
        table.add_row(*(escape(_cell(v)) for v in row.values()), end_section=False)
    print_rows(console, table, records, _cell)
    if result.num_rows > max_rows:
        console.print(f"({result.num_rows - max_rows:,} more rows: use --max-rows, or --format csv)", style="dim")


def _sink(output: Path | None, binary_ok_on_tty: bool):
    if output is not None:
        return open(output, "wb")
    if not binary_ok_on_tty and sys.stdout.isatty():
        raise UsageError("--format parquet writes binary data: give --output FILE or redirect stdout")
    return sys.stdout.buffer


def write_result(result, fmt: OutputFormat, output: Path | None, max_rows: int) -> None:
    if fmt is OutputFormat.table:
        console = Console(file=open(output, "w")) if output else Console()
        write_table(result, console, max_rows)
        return
    sink = _sink(output, fmt is not OutputFormat.parquet)
    try:
        if fmt is OutputFormat.csv:
            import pyarrow.csv as pacsv

            pacsv.write_csv(_plain(result), sink)
        elif fmt is OutputFormat.json:
            text = json.dumps(_records(result), default=str, ensure_ascii=False, indent=1)
            sink.write(text.encode() + b"\n")
        else:
            import pyarrow.parquet as pq

            pq.write_table(result, sink, compression="zstd")
        sink.flush()
    finally:
        if output is not None:
            sink.close()


def _python_values(column) -> list:
    """A column's values as Python objects, maps as dicts (Arrow gives them as lists of pairs)."""
    import pyarrow as pa

    values = column.to_pylist()
    if pa.types.is_map(column.type):
        return [None if v is None else dict(v) for v in values]
    return values


def _records(result) -> list[dict]:
    columns = {name: _python_values(result.column(name)) for name in result.column_names}
    return [dict(zip(columns, row)) for row in zip(*columns.values())]


def _plain(result):
    """CSV has no nested types: lists, structs and maps become JSON text."""
    import pyarrow as pa

    columns = []
    for column in result.columns:
        if pa.types.is_nested(column.type):
            column = pa.array(
                [None if v is None else json.dumps(v, default=str) for v in _python_values(column)], pa.string()
            )
        columns.append(column)
    return pa.table(columns, names=result.column_names)


def register(app: typer.Typer) -> None:
    @app.command("query")
    def query(
        sql: str = typer.Argument(..., help="The SQL to run, or - to read it from stdin."),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help="Output format."),
        output: Path | None = typer.Option(
            None, "--output", "-o", help="Write to this file; - or nothing: standard output."
        ),
        max_rows: int = typer.Option(1000, "--max-rows", help="Rows shown by --format table."),
        wait: float = typer.Option(30.0, "--wait", help="Seconds to wait while an ingest is writing the database."),
        lake: Path | None = typer.Option(
            None, "--lake", help="Query a Parquet lake folder instead of a database file."
        ),
    ) -> None:
        """Run SQL on the database, opened read-only (views: call_sites, kernel_launch_sites, ...)."""
        from tbpipe.pipeline.db import open_database

        text = sys.stdin.read() if sql == "-" else sql
        if output is not None and str(output) == "-":
            output = None
        if not text.strip():
            raise UsageError("no SQL given")
        say = Console(stderr=True, soft_wrap=True)
        if lake is not None:
            from tbpipe.pipeline.lake.store import connect

            con = connect(lake)
        else:
            con = open_database(
                db, read_only=True, wait_s=wait, on_wait=lambda m: say.print(f"tbpipe: {m}", highlight=False)
            )
        try:
            result = run_query(con, text)
        finally:
            con.close()
        write_result(result, fmt, output, max_rows)
