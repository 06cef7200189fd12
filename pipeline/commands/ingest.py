"""`tbpipe ingest RUNS_DIR... [--db PATH] [--debug-dir DIR]... [--debuginfod URL]... [--offline] [--cache-dir DIR]
[--user-code PREFIX]...`

`tbpipe ingest RUNS_DIR... --engine spark --lake DIR [--master URL] [--conf K=V]...`: the same into a lake.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from tbpipe.pipeline.errors import UsageError

if TYPE_CHECKING:
    import typer

# Exit status when some runs were quarantined (2 is kept for errors that stop everything).
QUARANTINED_EXIT = 1


def ingest(
    runs_dirs: Annotated[
        list[Path] | None,
        typer.Argument(help="Folders searched recursively for run directories (each with a manifest.json)."),
    ] = None,
    db: Annotated[
        Path | None, typer.Option("--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb).")
    ] = None,
    debug_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--debug-dir", help="Folder searched (recursively, by build-ID) for debug files first; repeatable."
        ),
    ] = None,
    debuginfod: Annotated[
        list[str] | None,
        typer.Option(
            "--debuginfod",
            metavar="URL",
            help="debuginfod server asked (GET /buildid/ID/debuginfo) for the debug info of modules that no "
            "local place has, before the servers of $DEBUGINFOD_URLS (space-separated, tried in order); "
            "repeatable. Downloads go to the cache gdb and elfutils share ($DEBUGINFOD_CACHE_PATH, else "
            "~/.cache/debuginfod_client); a build-ID no server has is asked again after <cache>/cache_miss_s "
            "seconds (600); $DEBUGINFOD_TIMEOUT (90 s) bounds each wait.",
        ),
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Ask no debuginfod server (files already in its cache are still used).")
    ] = False,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Symbol store (default: $TBPIPE_CACHE_DIR or the user cache dir; with --engine spark, the "
            "executors' unless --conf spark.tbpipe.symbolStore=DIR names one).",
        ),
    ] = None,
    user_code: Annotated[
        list[str] | None,
        typer.Option(
            "--user-code",
            help="Path prefix of files that are user code (call sites), e.g. /srv/app/ or mylib/; "
            "!PREFIX for files that are not. Kept in the database; repeatable.",
        ),
    ] = None,
    wait: Annotated[
        float, typer.Option("--wait", help="Seconds to wait for another ingest into the same database.")
    ] = 600.0,
    recover_manifests: Annotated[
        bool,
        typer.Option(
            "--recover-manifests",
            help="Load run folders whose manifest.json is lost as incomplete runs (run id = folder name, no labels).",
        ),
    ] = False,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Progress bar (default: on a terminal).")
    ] = None,
    runs_per_transaction: Annotated[
        int | None,
        typer.Option(
            "--runs-per-transaction",
            min=1,
            help="Load N consecutive runs in each transaction; 1: a transaction per run, so that a kill loses "
            "no run already loaded. By default small runs share one up to 250k rows, events and GPU activity "
            "records together (a night of small runs goes in twice as fast), and a big run goes alone. "
            "Each run goes in whole or not at all either way; a kill loses the runs of the two transactions "
            "under way, which the next ingest loads.",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="duckdb (into --db) or spark (into a Parquet lake, --lake; pip install 'tbpipe[spark]').",
        ),
    ] = "duckdb",
    lake: Annotated[Path | None, typer.Option("--lake", help="Lake folder written by --engine spark.")] = None,
    master: Annotated[str | None, typer.Option("--master", help="Spark master URL (default: local[*]).")] = None,
    conf: Annotated[list[str] | None, typer.Option("--conf", help="Spark setting KEY=VALUE; repeatable.")] = None,
) -> None:
    """Load captured runs into the database: each run whole or not at all (small runs share a
    transaction), damaged runs quarantined."""
    from rich.console import Console

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
        sys.exit(QUARANTINED_EXIT)


def _import_typer() -> None:
    global typer
    import typer


def register(app: typer.Typer) -> None:
    _import_typer()
    app.command("ingest")(ingest)


def _ingest_spark(
    runs_dirs, lake, db, master, conf, debug_dir, cache_dir, user_code, recover_manifests, debuginfod
) -> None:
    """`--engine spark`: the same steps as a Spark job writing the lake (tbpipe.pipeline.lake.spark_ingest)."""
    from rich.console import Console

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
        sys.exit(QUARANTINED_EXIT)


# ---- the plain command line without typer: `tbpipe ingest runs/ --db X` starts without typer and
# pydantic (a third of an ingest with nothing new to load)

_FLAGS = {
    "--offline": ("offline", True),
    "--recover-manifests": ("recover_manifests", True),
    "--progress": ("progress", True),
    "--no-progress": ("progress", False),
}
_VALUES = {
    "--db": "db",
    "--cache-dir": "cache_dir",
    "--debug-dir": "debug_dir",
    "--user-code": "user_code",
    "--debuginfod": "debuginfod",
}
_PATHS = {"db", "cache_dir", "debug_dir"}
_LISTS = {"debug_dir", "user_code", "debuginfod"}


def parse_fast(argv: list[str]) -> dict | None:
    """The keyword arguments of `ingest` for a command line in the plain subset of what typer
    accepts (folders, the options above, values not empty and not starting with "-"); None for
    anything else (help, the other options, errors), which typer then parses and reports."""
    kwargs: dict = {}
    folders: list[Path] = []
    args = iter(argv)
    for arg in args:
        if not arg.startswith("-"):
            if not arg:
                return None
            folders.append(Path(arg))
            continue
        name, equals, value = arg.partition("=")
        if name in _FLAGS and not equals:
            key, flag = _FLAGS[name]
            kwargs[key] = flag
            continue
        if name not in _VALUES:
            return None
        if not equals:
            value = next(args, None)
        if not value or value.startswith("-"):
            return None
        key = _VALUES[name]
        item = Path(value) if key in _PATHS else value
        if key in _LISTS:
            kwargs.setdefault(key, []).append(item)
        else:
            kwargs[key] = item
    if folders:
        kwargs["runs_dirs"] = folders
    return kwargs


def run_fast(argv: list[str]) -> bool:
    """Runs `ingest` for `argv` without typer; False (nothing done) when typer must parse it. Its
    errors end the process as under typer: a TbpipeError reaches the CLI's handler, ^C "Aborted!"."""
    kwargs = parse_fast(argv)
    if kwargs is None:
        return False
    try:
        ingest(**kwargs)
    except (EOFError, KeyboardInterrupt):
        sys.stderr.write("\nAborted!\n")
        sys.exit(1)
    return True
