"""`tbpipe compact [--db PATH]`: the database rewritten without the space it has freed."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    @app.command("compact")
    def compact(
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        wait: float = typer.Option(600.0, "--wait", help="Seconds to wait for an ingest into the same database."),
    ) -> None:
        """Rewrite the database file without its free blocks (after a migration, or many ingests)."""
        from tbpipe.pipeline.db.compact import compact_database

        result = compact_database(db, wait)
        saved = result.bytes_before - result.bytes_after
        Console().print(
            f"compacted {result.path}: {result.bytes_before / 1e6:,.1f} MB -> {result.bytes_after / 1e6:,.1f} MB "
            f"({saved / 1e6:,.1f} MB given back); {result.tables} tables, {result.rows:,} rows, all copied",
            highlight=False,
            soft_wrap=True,
        )
