"""`tbpipe export --run RUN [--kind K] [--name N] [--site KEY] --format pprof|collapsed|chrome-trace [--out FILE|-]
[--frames program|python|native|all]`"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tbpipe.pipeline.export.formats import ExportFormat


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export(
        run: list[str] = typer.Option(
            ...,
            "--run",
            "-r",
            help="A run id, 'latest', or 'latest:KEY=VALUE,...' (newest run with those labels); repeatable.",
        ),
        fmt: ExportFormat = typer.Option(..., "--format", "-f", help="Output format."),
        out: Path | None = typer.Option(None, "--out", "-o", help="Write to this file; - or nothing: standard output."),
        frames: str = typer.Option(
            "all",
            "--frames",
            help="Which frames of each stack: all, program (start-up and CPython's own frames folded, tbpipe's "
            "hidden), python or native.",
        ),
        kind: str | None = typer.Option(
            None, "--kind", help="Only events of this kind (kernel_launch, op, user, ...)."
        ),
        name: str | None = typer.Option(None, "--name", help="Only events of this name (a kernel, an op, ...)."),
        site: str | None = typer.Option(None, "--site", help="Only events of this call site (`call_sites.site_key`)."),
        traceback_args: bool = typer.Option(
            False,
            "--traceback-args",
            help="chrome-trace: also copy each event's whole traceback into its args (for viewers that ignore "
            "stack frames; large).",
        ),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        wait: float = typer.Option(30.0, "--wait", help="Seconds to wait while an ingest is writing the database."),
        progress: bool | None = typer.Option(
            None, "--progress/--no-progress", help="Progress bar on stderr (default: on a terminal, not under CI)."
        ),
    ) -> None:
        """Export events and their combined stacks as pprof, collapsed stacks (flame graphs) or a Chrome trace."""
        from tbpipe.pipeline.db import open_database
        from tbpipe.pipeline.export import ExportFilter
        from tbpipe.pipeline.export import export as export_events

        say = Console(stderr=True, soft_wrap=True)
        con = open_database(
            db, read_only=True, wait_s=wait, on_wait=lambda m: say.print(f"tbpipe: {m}", highlight=False)
        )
        try:
            summary = export_events(
                con,
                ExportFilter(runs=tuple(run), kind=kind, name=name, site=site),
                fmt,
                out,
                traceback_args=traceback_args,
                frames=frames,
                progress=progress,
            )
        finally:
            con.close()
        if summary.path is not None:
            runs = len(summary.run_ids)
            say.print(
                f"tbpipe: {summary.events:,} events of {runs} run{'s' if runs != 1 else ''} written to "
                f"{summary.path} ({fmt.value})",
                highlight=False,
                markup=False,
            )
