"""`ingest_runs`: run folders into the database, each run whole or not at all.

First what there is to do: the runs whose folders and manifests say the database holds them
already, whether the database's upkeep has work (`pending`), whether a module stored without DWARF
has better debug info now (`debug_info`). Only when something needs doing does it import the stages
(`stages.load_runs`: read ahead, lay out, load), with numpy and pyarrow: an ingest of nothing new
costs the database's opening and a look at each manifest. The ingest lock keeps two ingests apart.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tbpipe.pipeline.db.connection import ingest_lock, open_database, resolve_db_path
from tbpipe.pipeline.db.ingest.debug_info import IngestSymbolizer
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary, RunOutcome
from tbpipe.pipeline.db.ingest.pending import LoadedRuns, outcomes_unread, upkeep_due
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.db.ingest.tuning import checkpoint_at_close, without_huge_pages
from tbpipe.pipeline.db.ingest.user_code import parse_user_code
from tbpipe.pipeline.progress import RunProgress
from tbpipe.pipeline.runfolder import find_run_dirs


def ingest_runs(
    roots: Sequence[Path],
    options: IngestOptions | None = None,
    *,
    on_message: Callable[[str], None] | None = None,
) -> IngestSummary:
    """Ingests every run directory under `roots` into the database; see the module docstring."""
    options = options or IngestOptions()
    started = time.monotonic()
    db_path = resolve_db_path(options.db_path)
    rules = parse_user_code(options.user_code)
    run_dirs = find_run_dirs([Path(r) for r in roots])
    say = on_message or (lambda text: print(f"tbpipe: {text}", file=sys.stderr))
    summary = IngestSummary(db_path=db_path)
    with ingest_lock(db_path, options.wait_s, on_wait=say):
        con = open_database(db_path, wait_s=options.wait_s, on_wait=say)
        try:
            _ingest(IngestDb(con), run_dirs, rules, options, summary)
        finally:
            con.close()
    summary.seconds = time.monotonic() - started
    return summary


def _ingest(
    db: IngestDb, run_dirs: list[Path], rules: list[tuple[str, bool]], options: IngestOptions, summary: IngestSummary
) -> None:
    # Deleted rows are reclaimed by the vacuum this pauses: turned back on at the end when there are some.
    vacuum_paused = checkpoint_at_close(db.con)
    loaded = LoadedRuns.of(db.con)
    symbolizer = IngestSymbolizer(options)
    try:
        unread = outcomes_unread(run_dirs, loaded, options.recover_manifests)
        if unread is not None and not upkeep_due(db.con, rules) and not symbolizer.check_modules_without_dwarf(db.con):
            _add_unread(unread, options, summary)
            return
        # Imported here, with numpy and pyarrow: only an ingest with work to do needs them.
        from tbpipe.pipeline.db.ingest.stages import load_runs

        with without_huge_pages():
            load_runs(db, run_dirs, rules, loaded, symbolizer, options, summary)
    finally:
        symbolizer.close(summary)
        if vacuum_paused and db.rows_deleted:
            db.con.execute("RESET max_vacuum_tasks")


def _add_unread(outcomes: list[RunOutcome], options: IngestOptions, summary: IngestSummary) -> None:
    """The outcomes of runs that needed no reading, shown and added as the stages would."""
    if not outcomes:
        return
    with RunProgress(options.progress, len(outcomes)) as progress:
        for outcome in outcomes:
            progress.start(outcome.path)
            summary.outcomes.append(outcome)
            progress.finish(outcome.events)
