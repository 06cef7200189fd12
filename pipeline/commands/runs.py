"""`tbpipe runs [--db PATH] [--label K=V]...`: the ingested runs, with their labels."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tbpipe.capture.launch import parse_labels
from tbpipe.pipeline.reports.terminal import print_rows


def _labels(labels: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))


def register(app: typer.Typer) -> None:
    @app.command("runs")
    def runs(
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        label: list[str] | None = typer.Option(
            None, "--label", "-l", help="Only runs with this KEY=VALUE label; repeatable."
        ),
    ) -> None:
        """List the ingested runs, oldest first, with their labels (and when `tbpipe retain` rolled them up)."""
        from tbpipe.pipeline.db import open_database, read

        con = open_database(db, read_only=True)
        try:
            rows = read.runs(con, parse_labels(label or []))
        finally:
            con.close()
        table = Table(title=f"{len(rows)} run{'s' if len(rows) != 1 else ''}", title_justify="left")
        table.add_column("run", no_wrap=True)
        table.add_column("started (UTC)", no_wrap=True)
        table.add_column("complete", no_wrap=True)
        table.add_column("rolled up", no_wrap=True)
        table.add_column("events", justify="right", no_wrap=True)
        table.add_column("stacks", justify="right", no_wrap=True)
        table.add_column("host:pid", overflow="fold")
        table.add_column("labels", overflow="fold")
        table.add_column("command", overflow="ellipsis", no_wrap=True, max_width=40)
        records = []
        for row in rows:
            record = {
                "run": row["run_id"],
                "started (UTC)": row["started_at"].strftime("%Y-%m-%d %H:%M:%S") if row["started_at"] else "",
                "complete": "yes" if row["complete"] else "no",
                "rolled up": row["rolled_up_at"].strftime("%Y-%m-%d") if row["rolled_up_at"] else "",
                "events": f"{row['events']:,}",
                "stacks": f"{row['stacks']:,}",
                "host:pid": f"{row['host']}:{row['pid']}",
                "labels": _labels(row["labels"]),
                "command": " ".join(row["argv"] or []),
            }
            records.append(record)
            cells = [escape(value) for value in {**record, "command": record["command"][:80]}.values()]
            if not row["complete"]:
                cells[2] = "[yellow]no[/]"
            table.add_row(*cells)
        print_rows(Console(), table, records)
