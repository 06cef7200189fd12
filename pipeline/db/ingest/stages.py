"""The ingest's three stages over the run folders, with the database's upkeep before them: what
`flow.ingest_runs` runs when there is work (it imports this module only then).

    run folders ──► read_ahead ──► lay_out ──► load ──► committed rows
                    PreparedRun    StackIds,   Transaction
                    (per run,      LaidOutBatch (per group of runs,
                    on threads)    (per batch)   two under way)

Each run goes in whole or not at all: a kill at any point leaves the database as it was before the
transactions under way; a run whose data fails to load is quarantined (`load`), and the runs after
it are laid out again without it.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.db.ingest.debug_info import IngestSymbolizer
from tbpipe.pipeline.db.ingest.lay_out import LaidOutBatch, RunUnreadable, assign_stack_ids, lay_out
from tbpipe.pipeline.db.ingest.load import Loader
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary, RunOutcome, UnsymbolizedGroup
from tbpipe.pipeline.db.ingest.pending import LoadedRuns
from tbpipe.pipeline.db.ingest.read_ahead import Batch, PreparedRun, ReadAhead, RunReader, batches
from tbpipe.pipeline.db.ingest.siting import backfill_site_identity, store_generated_code, store_user_code
from tbpipe.pipeline.db.ingest.symbols import SymbolLoader
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.progress import RunProgress
from tbpipe.pipeline.rawrun import code_first_lines


def load_runs(
    db: IngestDb,
    run_dirs: list[Path],
    rules: list[tuple[str, bool]],
    loaded: LoadedRuns,
    symbolizer: IngestSymbolizer,
    options: IngestOptions,
    summary: IngestSummary,
) -> None:
    """The database's upkeep, then every run of `run_dirs` through the stages, its outcome added to
    `summary`."""
    symbols = SymbolLoader(db, options, summary, symbolizer)
    loader = Loader(db, options, loaded)
    try:
        backfill_site_identity(db, code_first_lines)
        store_user_code(db, rules)
        summary.user_code = rules
        symbols.refresh_improved_modules()
        if not run_dirs:
            return
        stored = query_arrow(db.con, "SELECT stack_hash FROM stacks")["stack_hash"].to_numpy()
        reader = RunReader(options, loaded, stored, run_dirs)
        ahead = ReadAhead(reader.prepare, run_dirs, options.limits)
        # Closed at once when a load fails: the threads reading runs ahead stop with it.
        with RunProgress(options.progress, len(run_dirs)) as progress, closing(ahead):
            symbolizer.describe = progress.describe  # downloads of debug info show on the ingest's bar
            for batch in batches(ahead, loaded, options.limits, progress.start):
                for outcome in _load_batch(db, batch, symbols, loader, options, summary, progress):
                    summary.outcomes.append(outcome)
                    progress.finish(outcome.events)
    finally:
        loader.close()


def _load_batch(
    db: IngestDb,
    items: Batch,
    symbols: SymbolLoader,
    loader: Loader,
    options: IngestOptions,
    summary: IngestSummary,
    progress: RunProgress,
) -> list[RunOutcome]:
    """Outcomes of a batch's runs, in order: laid out together, then loaded in transactions. When
    a run fails, it is quarantined and the runs after it are laid out again without it."""
    runs = [item for item in items if isinstance(item, PreparedRun)]
    outcomes: dict[Path, RunOutcome] = {}
    while runs:
        progress.describe(f"hashing the stacks of {len(runs):,} runs")
        try:
            ids = assign_stack_ids(db, runs, lambda run_dir: options.hooks.run_read(run_dir, True))
        except RunUnreadable as unreadable:
            run = runs.pop(unreadable.index)
            outcomes[run.run_dir] = RunOutcome(run.run_dir, "quarantined", run_id=run.run_id, reason=unreadable.reason)
            continue
        options.hooks.laying_out([run.run_id for run in ids.runs])
        # The folders of generated code the runs name, before any stack is sited: never a site.
        store_generated_code(db, [run.manifest for run in ids.runs])
        loader.begin_batch(ids)
        try:
            batch = lay_out(db, ids, symbols, progress)
        except BaseException:
            loader.abandon()
            raise
        loaded, failed = loader.load(batch, progress)
        outcomes.update({batch.runs[i].run_dir: outcome for i, outcome in loaded.items()})
        runs = list(batch.runs[failed + 1 :]) if failed is not None else []  # laid out again
        _count_new_frames(db, batch, summary)
    return [outcomes[item.run_dir] if isinstance(item, PreparedRun) else item for item in items]


def _count_new_frames(db: IngestDb, batch: LaidOutBatch, summary: IngestSummary) -> None:
    """Adds the batch's new stacks' native frames to the summary: symbolized, or unsymbolized by reason."""
    frames = batch.new.frames
    if frames is None:
        return
    rows = frames.rows
    first_in_chain = rows["chain_depth"].to_numpy() == 0
    uses = np.bincount(rows["frame"].to_numpy()[first_in_chain], minlength=frames.frames.num_rows)
    db.register("ingest_new_frames", frames.frames.append_column("uses", pa.array(uses, pa.int64())))
    try:
        counted = query_rows(
            db.con,
            """
            SELECT symbolized, reason_category(coalesce(reason, 'not symbolized')) AS reason, module_key,
                   module, frames
            FROM (
                SELECT function IS NOT NULL AS symbolized, reason, module_key, any_value(module) AS module,
                       sum(uses)::BIGINT AS frames
                FROM ingest_new_frames
                WHERE kind = 'native' AND uses > 0
                GROUP BY ALL
            )
            """,
        )
    finally:
        db.unregister("ingest_new_frames")
    for symbolized, reason, module_key, module, count in counted:
        if symbolized:
            summary.frames_symbolized += count
            continue
        summary.frames_unsymbolized += count
        group = summary.unsymbolized.setdefault(reason, UnsymbolizedGroup(reason))
        group.frames += count
        group.modules[module_key or "?"] = module or "?"
