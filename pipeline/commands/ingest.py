"""`tbpipe ingest RUNS_DIR... [--db PATH] [--debug-dir DIR]... [--debuginfod URL]... [--offline] [--cache-dir DIR]
[--user-code PREFIX]...`

`tbpipe ingest RUNS_DIR... --engine spark --lake DIR [--master URL] [--conf K=V]...`: the same into a lake.
"""

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
        debuginfod: list[str] | None = typer.Option(
            None,
            "--debuginfod",
            metavar="URL",
            help="debuginfod server asked (GET /buildid/ID/debuginfo) for the debug info of modules that no "
            "local place has, before the servers of $DEBUGINFOD_URLS (space-separated, tried in order); "
            "repeatable. Downloads go to the cache gdb and elfutils share ($DEBUGINFOD_CACHE_PATH, else "
            "~/.cache/debuginfod_client); a build-ID no server has is asked again after <cache>/cache_miss_s "
            "seconds (600); $DEBUGINFOD_TIMEOUT (90 s) bounds each wait.",
        ),
        offline: bool = typer.Option(
            False, "--offline", help="Ask no debuginfod server (files already in its cache are still used)."
        ),
        cache_dir: Path | None = typer.Option(
            None,
            "--cache-dir",
            help="Symbol store (default: $TBPIPE_CACHE_DIR or the user cache dir; with --engine spark, the "
            "executors' unless --conf spark.tbpipe.symbolStore=DIR names one).",
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
        runs_per_transaction: int | None = typer.Option(
            None,
            "--runs-per-transaction",
            min=1,
            help="Load N consecutive runs in each transaction; 1: a transaction per run, so that a kill loses "
            "no run already loaded. By default small runs share one up to 250k rows, events and GPU activity "
            "records together (a night of small runs goes in twice as fast), and a big run goes alone. "
            "Each run goes in whole or not at all either way; a kill loses the runs of the two transactions "
            "under way, which the next ingest loads.",
        ),
        engine: str = typer.Option(
            "duckdb",
            "--engine",
            help="duckdb (into --db) or spark (into a Parquet lake, --lake; pip install 'tbpipe[spark]').",
        ),
        lake: Path | None = typer.Option(None, "--lake", help="Lake folder written by --engine spark."),
        master: str | None = typer.Option(None, "--master", help="Spark master URL (default: local[*])."),
        conf: list[str] | None = typer.Option(None, "--conf", help="Spark setting KEY=VALUE; repeatable."),
    ) -> None:
        """Load captured runs into the database: each run whole or not at all (small runs share a
        transaction), damaged runs quarantined."""
        from tbpipe.pipeline.db import IngestOptions, ingest_runs
        from tbpipe.pipeline.reports.ingest_summary import render_ingest_summary
        from tbpipe.pipeline.symbols.debuginfod import DebuginfodSettings

        if not runs_dirs and not user_code:
            raise UsageError("nothing to ingest: give one or more run folders, e.g. tbpipe ingest runs/")
        servers = DebuginfodSettings(urls=tuple(debuginfod or ()), offline=offline)
        if engine == "spark":
            _ingest_spark(
                runs_dirs or [],
                lake,
                db,
                master,
                conf or [],
                debug_dir,
                cache_dir,
                user_code,
                recover_manifests,
                servers,
            )
            return
        if engine != "duckdb":
            raise UsageError(f"--engine {engine!r}: choose duckdb or spark")
        if lake is not None or master is not None or conf:
            raise UsageError("--lake, --master and --conf go with --engine spark")
        options = IngestOptions(
            db_path=db,
            debug_dirs=list(debug_dir or []),
            cache_dir=cache_dir,
            user_code=list(user_code or []),
            wait_s=wait,
            progress=progress,
            recover_manifests=recover_manifests,
            runs_per_transaction=runs_per_transaction,
            debuginfod=servers,
        )
        summary = ingest_runs(list(runs_dirs or []), options)
        render_ingest_summary(summary, Console())
        if not summary.ok:
            raise typer.Exit(QUARANTINED_EXIT)


def _ingest_spark(
    runs_dirs, lake, db, master, conf, debug_dir, cache_dir, user_code, recover_manifests, debuginfod
) -> None:
    """`--engine spark`: the same steps as a Spark job writing the lake (tbpipe.pipeline.lake.spark_ingest)."""
    from tbpipe.pipeline.reports.ingest_summary import render_ingest_summary

    if lake is None:
        raise UsageError("--engine spark writes a lake: give --lake DIR")
    if db is not None:
        raise UsageError("--db is the DuckDB engine's; --engine spark writes --lake DIR")
    settings = {}
    for pair in conf:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--conf {pair!r}: expected KEY=VALUE, e.g. --conf spark.executor.memory=4g")
        settings[key.strip()] = value
    try:
        from tbpipe.pipeline.lake.spark_ingest import SparkIngestOptions, ingest_runs_spark
    except ImportError as error:
        raise UsageError(f"--engine spark needs PySpark: pip install 'tbpipe[spark]' ({error})") from None
    options = SparkIngestOptions(
        lake=lake,
        master=master,
        conf=settings,
        debug_dirs=list(debug_dir or []),
        cache_dir=cache_dir,
        user_code=list(user_code or []),
        recover_manifests=recover_manifests,
        debuginfod=debuginfod,
    )
    summary = ingest_runs_spark(list(runs_dirs), options)
    render_ingest_summary(summary, Console())
    for line in summary.executors:  # which tbpipe the executors ran, from where
        print(f"executors {line}")
    if not summary.ok:
        raise typer.Exit(QUARANTINED_EXIT)
