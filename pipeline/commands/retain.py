"""`tbpipe retain --keep-runs N [--by LABEL]... | --keep-days D [--dry-run]`: old runs' events let go,
their counts kept; quarantined uploads and ingested run folders aged out."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from tbpipe.pipeline.errors import UsageError


def _mb(value: int) -> str:
    return f"{value / 1e6:,.1f} MB"


def register(app: typer.Typer) -> None:
    @app.command("retain")
    def retain(
        keep_runs: int | None = typer.Option(
            None, "--keep-runs", help="Keep the events of the newest N runs of each --by group; roll up the others."
        ),
        by: list[str] | None = typer.Option(
            None, "--by", help="Label whose values group the runs for --keep-runs (e.g. suite, rank); repeatable."
        ),
        keep_days: float | None = typer.Option(
            None,
            "--keep-days",
            help="Keep the events of the runs started in the last D days (with --keep-runs: both kept).",
        ),
        dry_run: bool = typer.Option(
            False, "--dry-run", help="Say what would go and the space it frees; change nothing."
        ),
        keep_quarantined_days: float | None = typer.Option(
            None, "--keep-quarantined-days", help="Delete quarantined uploads older than D days (off unless given)."
        ),
        uploads_dir: Path | None = typer.Option(
            None, "--uploads-dir", help="The service's uploads folder (default: <db>.uploads beside the database)."
        ),
        delete_ingested: float | None = typer.Option(
            None,
            "--delete-ingested-runs-after-days",
            help="Delete run folders under --runs-dir ingested more than D days ago and unchanged since (off unless given).",
        ),
        runs_dir: list[Path] | None = typer.Option(
            None,
            "--runs-dir",
            help="A folder (watched, or uploads) whose ingested run folders may be deleted; repeatable.",
        ),
        lake: Path | None = typer.Option(None, "--lake", help="Roll up the runs of this lake instead of a database."),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        wait: float = typer.Option(600.0, "--wait", help="Seconds to wait for an ingest into the same database."),
    ) -> None:
        """Roll up old runs: their events (and GPU activity records) go, their counts per stack and site,
        GPU time, labels and stacks stay; reports, histories and count exports read them as before."""
        from tbpipe.pipeline.db import open_database, resolve_db_path
        from tbpipe.pipeline.db.retain import FolderPolicy, RetainPolicy, age_out_folders
        from tbpipe.pipeline.db.retain import retain as retain_database

        policy = RetainPolicy(keep_runs, tuple(by or ()), keep_days)
        path = resolve_db_path(db)
        folders = FolderPolicy(
            uploads=uploads_dir or path.with_name(path.name + ".uploads"),
            keep_quarantined_days=keep_quarantined_days,
            run_roots=tuple(runs_dir or ()),
            delete_ingested_after_days=delete_ingested,
        )
        folders.check()
        rolling = keep_runs is not None or keep_days is not None or by
        if not rolling and not folders.active:
            raise UsageError(
                "say what to retain: --keep-runs N [--by LABEL] and/or --keep-days D (events of older runs go), "
                "--keep-quarantined-days D, --delete-ingested-runs-after-days D --runs-dir DIR"
            )
        console = Console(soft_wrap=True, highlight=False)
        if rolling and lake is not None:
            from tbpipe.pipeline.lake.retain import retain_lake

            result = retain_lake(lake, policy, dry_run=dry_run)
        elif rolling:
            result = retain_database(path, policy, dry_run=dry_run, wait_s=wait, on_wait=console.print)
        if rolling:
            what = f"{len(result.runs):,} run{'s' if len(result.runs) != 1 else ''}"
            if not result.runs:
                console.print(
                    f"nothing to roll up in {escape(str(lake or path))}: {result.kept:,} run{'s' if result.kept != 1 else ''} kept ({policy.describe()}), "
                    f"{result.already:,} rolled up before"
                )
            else:
                console.print(
                    f"{'would roll up' if dry_run else 'rolled up'} {what} of {escape(str(lake or path))} "
                    f"(kept: {result.kept:,}, {policy.describe()}; rolled up before: {result.already:,}): "
                    f"{result.events:,} events and {result.gpu_records:,} GPU activity records "
                    f"{'would go' if dry_run else 'let go'}; their counts stay"
                )
                for run in result.runs[:20]:
                    group = ", ".join(f"{k}={v}" for k, v in zip(policy.by, run.group) if v is not None)
                    started = run.started_at.strftime("%Y-%m-%d %H:%M") if run.started_at else "?"
                    console.print(f"  {escape(run.run_id)}  {started}  {run.events:>12,} events  {escape(group)}")
                if len(result.runs) > 20:
                    console.print(f"  ... and {len(result.runs) - 20:,} more")
                freed = result.bytes_freed
                if dry_run:
                    console.print(f"about {_mb(freed)} would be freed for later ingests (`tbpipe compact` returns it)")
                elif freed >= 0:
                    console.print(f"{_mb(freed)} freed for later ingests (`tbpipe compact` gives it back to the disk)")
                else:
                    console.print(f"the database uses {_mb(-freed)} more (the rolled-up counts' first blocks)")
            if result.orphans:
                console.print(
                    f"{result.orphans:,} rolled-up rows of runs ingested again since their roll-up "
                    f"{'would be' if dry_run else 'were'} deleted"
                )
        if folders.active:
            con = None
            if folders.delete_ingested_after_days is not None:
                con = open_database(path, read_only=True)
            try:
                aged = age_out_folders(con, folders, dry_run=dry_run)
            finally:
                if con is not None:
                    con.close()
            for entry in aged:
                console.print(
                    f"{'would delete' if dry_run else 'deleted'} {entry.what} {escape(str(entry.path))} ({_mb(entry.bytes)})"
                )
            if not aged:
                console.print("no quarantined upload or ingested run folder to age out")
