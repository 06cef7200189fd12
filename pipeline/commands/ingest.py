"""`tbpipe ingest RUNS_DIR... [--db PATH] [--debug-dir DIR]... [--cache-dir DIR] [--user-code PREFIX]...`"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tbpipe.pipeline.errors import UsageError

# Exit status when some runs were quarantined (2 is kept for errors that stop everything).
QUARANTINED_EXIT = 1


def register(app: typer.Typer) -> None:
    @app.command("ingest")
    def ingest(
        runs_dirs: list[Path] | None = typer.Argument(
            None, help="Folders searched recursively for run directories (each with a manifest.json)."
        ),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        debug_dir: list[Path] | None = typer.Option(
            None, "--debug-dir", help="Folder searched (recursively, by build-ID) for debug files first; repeatable."
        ),
        cache_dir: Path | None = typer.Option(
            None, "--cache-dir", help="Symbol store (default: $TBPIPE_CACHE_DIR or the user cache dir)."
        ),
        user_code: list[str] | None = typer.Option(
            None,
            "--user-code",
            help="Path prefix of files that are user code (call sites), e.g. /srv/app/ or mylib/; "
            "!PREFIX for files that are not. Kept in the database; repeatable.",
        ),
        wait: float = typer.Option(600.0, "--wait", help="Seconds to wait for another ingest into the same database."),
        recover_manifests: bool = typer.Option(
            False,
            "--recover-manifests",
            help="Load run folders whose manifest.json is lost as incomplete runs (run id = folder name, no labels).",
        ),
        progress: bool | None = typer.Option(
            None, "--progress/--no-progress", help="Progress bar (default: on a terminal)."
        ),
    ) -> None:
        """Load captured runs into the database: one transaction per run, damaged runs quarantined."""
        from tbpipe.pipeline.db import IngestOptions, ingest_runs
        from tbpipe.pipeline.reports.ingest_summary import render_ingest_summary

        if not runs_dirs and not user_code:
            raise UsageError("nothing to ingest: give one or more run folders, e.g. tbpipe ingest runs/")
        options = IngestOptions(
            db_path=db,
            debug_dirs=list(debug_dir or []),
            cache_dir=cache_dir,
            user_code=list(user_code or []),
            wait_s=wait,
            progress=progress,
            recover_manifests=recover_manifests,
        )
        summary = ingest_runs(list(runs_dirs or []), options)
        render_ingest_summary(summary, Console())
        if not summary.ok:
            raise typer.Exit(QUARANTINED_EXIT)
