"""The ingest's flow: find run folders; read and validate each; load them in batches and transactions.

Per run: validate it (`rawrun`: manifest, every part's footer, schema and page checksums; a damaged
run is quarantined and the others go on), skip it when the database already has it (a run ingested
while incomplete is loaded again once its files changed), and flatten and hash its stacks
(`stacks.flatten`); a run whose stacks the database holds already, or a run before it brings in, is
read without their frames, by the hashes its capture wrote (raw schema 4). Runs are then laid out
in batches (a big run alone, small runs together, so a night of a thousand small runs does not pay
a thousand times for each step): find which stacks the database does not know yet, symbolize their
new addresses (`symbols`) and lay out their frames (`stacks.layout`) once for the batch.

Then its runs are loaded in transactions: consecutive runs share one up to `ROWS_PER_TRANSACTION`
events and GPU records, and a big run goes alone (or, with `runs_per_transaction`, that many runs
share one; 1 for a transaction per run). A transaction loads its runs' share of the new symbols,
stacks and frames (`rows`), their sites (`siting`), events and run rows, each step one statement for
all of them. Two transactions are under way at a time, on two connections: the next one's events and
their counts per stack load on a worker thread while the loading thread inserts the current one's
run rows, stacks and sites and commits it; they commit in order. A transaction's site counts are
taken by whichever of the two threads would otherwise wait. A batch's first transaction is begun
while the batch is still laid out, its events loading beside the layout.

Each run goes in whole or not at all: a kill at any point leaves the database as it was before the
transactions under way; a run whose data fails to load is quarantined (a shared transaction that
fails is tried again run by run to find it), the transaction begun beside it is rolled back, and
the runs after it are laid out again without it. The ingest lock keeps two ingests apart.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import (
    ingest_lock,
    open_database,
    query_arrow,
    query_rows,
    query_value,
    resolve_db_path,
)
from tbpipe.pipeline.db.ingest import gpu as run_gpu
from tbpipe.pipeline.db.ingest import rows as run_rows
from tbpipe.pipeline.db.ingest.frames import resolve_frames
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary, RunOutcome, UnsymbolizedGroup
from tbpipe.pipeline.db.ingest.rows import Batch, PreparedRun
from tbpipe.pipeline.db.ingest.siting import (
    backfill_site_identity,
    import_roots,
    insert_site_counts,
    insert_sites,
    number_sites,
    parse_user_code,
    portable_file,
    record_portable_files,
    sites_for_counting,
    sites_of_laid_out,
    store_generated_code,
    store_user_code,
)
from tbpipe.pipeline.db.ingest.symbols import SymbolLoader
from tbpipe.pipeline.db.ingest.tables import IngestDb, QuarantineRun, raise_for_data_error
from tbpipe.pipeline.progress import RunProgress
from tbpipe.pipeline.rawrun import (
    DamagedRunError,
    MissingManifestError,
    VerifiedParts,
    code_first_lines,
    events_part,
    find_run_dirs,
    part_files,
    parts_fingerprint,
    read_manifest,
    read_stack_keys,
    read_tables,
    recovered_manifest,
    reference_problems,
    verify_part,
)
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.stacks.flatten import (
    concat_flat_runs,
    differing_written_hashes,
    flatten_run,
    known_stacks_run,
)

# The tables a run's stacks are read from (the stacks with their frames).
STACK_TABLES = ("stacks", "modules", "code", "code_origins")
# A batch closes once it holds this many events or runs (a run past the first limit goes alone).
BATCH_EVENTS = 2_000_000
BATCH_RUNS = 64
# Threads reading runs ahead of the loading (a thread per core, up to 4).
PREPARE_THREADS = max(1, min(4, os.cpu_count() or 1))
# Their nice value above the loading thread's (Linux, where a thread has its own): the loading
# thread is the ingest's critical path, and a reading thread that competes with it for a core
# delays every run after, while one that waits a little only uses a core the loading left idle
# later. 100k new stacks in 40 runs: cores busy 81-83 % against 78-79 %, 0.3-0.5 s less wall time.
PREPARE_NICE = 10
# A transaction of fewer events runs DuckDB on one thread: a small run's statements move a few
# thousand rows each, and handing that work between threads costs more than it saves, while the
# other cores prepare the next runs. Bigger transactions keep DuckDB's threads (their events insert
# and counts scale with them).
ONE_THREAD_BELOW_EVENTS = 100_000
# By default consecutive runs share a transaction up to this many rows, events and GPU activity
# records together (`PreparedRun.rows`; a run past it goes alone).
# A transaction's fixed costs (its commit, a run row, each statement's planning and the opening of
# its Parquet parts) came to about 28 ms of CPU here, more than loading 10k events: 1,000 runs of
# 10k events took 31-37 s at one transaction each, 20 s at 8 a transaction and 14.5 s at 25. A
# kill loses the two transactions under way: at this size about a second of the ingest's work.
ROWS_PER_TRANSACTION = 250_000


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
    with ingest_lock(db_path, options.wait_s, on_wait=say), _without_huge_pages():
        con = open_database(db_path, wait_s=options.wait_s, on_wait=say)
        loader = RunLoader(IngestDb(con), options, summary)
        try:
            backfill_site_identity(loader.db, code_first_lines)
            store_user_code(loader.db, rules)
            summary.user_code = rules
            loader.symbols.refresh_improved_modules()
            # Closed at once when a load fails: the thread preparing runs ahead stops with it.
            with (
                RunProgress(options.progress, len(run_dirs)) as progress,
                closing(loader.batches(run_dirs, progress)) as batches,
            ):
                for batch in batches:
                    for outcome in loader.load(batch, progress):
                        summary.outcomes.append(outcome)
                        progress.finish(outcome.events)
        finally:
            loader.close()
            con.close()
    summary.seconds = time.monotonic() - started
    return summary


class RunLoader:
    def __init__(self, db: IngestDb, options: IngestOptions, summary: IngestSummary):
        self.db = db
        self.options = options
        self.summary = summary
        self.symbols = SymbolLoader(db, options, summary)
        # Deleted rows are reclaimed by the vacuum this pauses: `close` turns it back on when there are some.
        self._vacuum_paused = checkpoint_at_close(db.con)
        self._default_threads = self._threads = int(query_value(db.con, "SELECT current_setting('threads')"))
        # A second connection for the transaction loaded beside the one finishing (`_load_groups`),
        # and the thread that loads its events.
        self._dbs = [db, db.on(db.con.cursor())]
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tbpipe-events")
        self._open: list[_Underway] = []
        self._loaded = {
            run_id: (complete, parts)
            for run_id, complete, parts in query_rows(db.con, "SELECT run_id, complete, parts FROM runs")
        }
        # What the preparing threads tell stacks already stored by: the hashes of the database's
        # stacks, and those claimed by runs read whole, by the first run (in the order they load)
        # that holds each. A run all of whose stacks are stored before it (and whose capture wrote
        # their hashes) is read without its frames (`_read_known_stacks`).
        self._stored_hashes = np.sort(
            np.asarray(query_arrow(db.con, "SELECT stack_hash FROM stacks")["stack_hash"].to_numpy(), dtype=np.uint64)
        )
        self._claims = _StackClaims()
        self._positions: dict[Path, int] = {}

    def close(self) -> None:
        """Before the database closes (and checkpoints): the symbolizer stopped, DuckDB's threads as
        they were, and its vacuum back on when the ingest deleted rows, so that their space is
        reclaimed."""
        self._abandon()
        self._worker.shutdown()
        self._dbs[1].con.close()
        self.symbols.close()
        self._use_threads(self._default_threads)  # for the closing checkpoint
        if self._vacuum_paused and self.db.rows_deleted:
            self.db.con.execute("RESET max_vacuum_tasks")

    def _use_threads(self, threads: int) -> None:
        if threads != self._threads:
            self.db.con.execute(f"SET threads = {int(threads)}")
            self._threads = threads

    # ---------------------------------------------------------------- reading runs, making batches

    def batches(self, run_dirs: list[Path], progress: RunProgress) -> Iterator[list[PreparedRun | RunOutcome]]:
        """Runs in batches; a run that needs no loading (present, quarantined) comes as its outcome.

        Runs are read, checked and hashed (`prepare`) on threads of their own, up to a batch ahead
        of the ones being loaded (`_PreparedAhead`): that work is Python, Arrow and zstd, while a
        load mostly waits on DuckDB, so the two share the cores."""
        batch: list[PreparedRun | RunOutcome] = []
        events = runs = 0
        self._positions = {run_dir: position for position, run_dir in enumerate(run_dirs)}
        ahead = _PreparedAhead(self.prepare, run_dirs, PREPARE_THREADS)
        try:
            for run_dir, prepared in ahead:
                progress.start(run_dir)
                prepared = self._still_to_load(prepared)
                if isinstance(prepared, PreparedRun):
                    # A run id twice (one run copied to two folders): its twin is loaded first.
                    twin = any(isinstance(item, PreparedRun) and item.run_id == prepared.run_id for item in batch)
                    if runs and (twin or events + prepared.events > BATCH_EVENTS):
                        yield batch
                        batch, events, runs = [], 0, 0
                        prepared = self._still_to_load(prepared)
                if isinstance(prepared, PreparedRun):
                    events += prepared.events
                    runs += 1
                batch.append(prepared)
                if runs >= BATCH_RUNS or events >= BATCH_EVENTS:
                    yield batch
                    batch, events, runs = [], 0, 0
            if batch:
                yield batch
        finally:
            ahead.close()

    def _still_to_load(self, prepared: PreparedRun | RunOutcome) -> PreparedRun | RunOutcome:
        """A run prepared ahead, checked again against what was loaded since (the same run id may
        come twice)."""
        if not isinstance(prepared, PreparedRun):
            return prepared
        present = self._present(prepared.run_dir, prepared.run_id, prepared.fingerprint)
        if present is not None:
            return present
        prepared.replace = prepared.run_id in self._loaded
        return prepared

    def _present(self, run_dir: Path, run_id: str, fingerprint: str) -> RunOutcome | None:
        """The run's outcome when the database holds it complete, or as it is now; None when it
        must be loaded."""
        existing = self._loaded.get(run_id)
        if existing is not None and (existing[0] or existing[1] == fingerprint):
            return RunOutcome(run_dir, "present", run_id=run_id, complete=existing[0])
        return None

    def prepare(self, run_dir: Path) -> PreparedRun | RunOutcome:
        """A run read, validated and flattened; its outcome when it needs no loading or is damaged."""
        notes: list[str] = []
        try:
            try:
                manifest = read_manifest(run_dir)
            except MissingManifestError:
                if not self.options.recover_manifests:
                    raise
                manifest = recovered_manifest(run_dir)
                notes.append("manifest.json was missing: recovered from the run's parts (no labels, argv or versions)")
            files = part_files(run_dir, manifest)
            fingerprint = parts_fingerprint(run_dir, manifest, files)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", reason=str(error))
        run_id = manifest["run_id"]
        present = self._present(run_dir, run_id, fingerprint)
        if present is not None:
            return present
        try:
            # Every GPU part checked here (DuckDB reads them without their page checksums).
            gpu_rows = sum(verify_part(path, table) for table in run_gpu.GPU_TABLES for path in files[table])
            gpu_files = {table: list(files[table]) for table in run_gpu.GPU_TABLES}
            position = self._positions.get(run_dir, len(self._positions))
            verified: VerifiedParts = {}
            known = self._read_known_stacks(files, position, verified)
            tables = known or read_tables(files, STACK_TABLES, verified)
            notes += reference_problems(tables)
            if notes and manifest.get("complete") and not manifest.get("recovered"):
                raise DamagedRunError(f"{run_dir}: {'; '.join(notes)}")
            if known:
                flat = known_stacks_run(known["stacks"], known["modules"])
            else:
                flat = flatten_run(tables)
                differing = differing_written_hashes(tables, flat)
                if differing:
                    raise DamagedRunError(
                        f"{run_dir}: {differing} stacks' stack_hash differs from the hash of their frames"
                    )
            # Checked, their names read and their events without a stack counted here, in the
            # preparing thread (DuckDB reads them once more, to load them): a night of small runs
            # paid a batch-wide query for these.
            events = [events_part(path) for path in files["events"]]
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", run_id=run_id, reason=str(error))
        return PreparedRun(
            run_dir,
            manifest,
            fingerprint,
            [(path, part.rows) for path, part in zip(files["events"], events)],
            flat,
            notes,
            replace=run_id in self._loaded,
            gpu_files=gpu_files,
            gpu_rows=gpu_rows,
            event_names=sorted(set().union(*(part.names for part in events))),
            events_without_stack=sum(part.without_stack for part in events),
            parts_without_correlation={p for p, part in zip(files["events"], events) if not part.correlation_column},
            stack_files={table: files[table] for table in STACK_TABLES},
        )

    def _read_known_stacks(
        self, files: dict[str, list[Path]], position: int, verified: VerifiedParts
    ) -> dict[str, pa.Table] | None:
        """The run's stacks without their frames (`read_stack_keys`) when every one of them is stored
        already or comes with a run loaded before it (by the hashes the capture wrote); else None,
        and the run is read whole (its stacks parts from the bytes left in `verified`)."""

        def all_stored(hashes: np.ndarray) -> bool:
            # Sorted once: searched in order, first among the stored hashes, then among the claims.
            return self._claims.claimed_before(self._not_stored(np.sort(hashes)), position)

        return read_stack_keys(files, all_stored, verified)

    def _not_stored(self, hashes: np.ndarray) -> np.ndarray:
        """The hashes the database held no stack of when the ingest began (in the order given)."""
        _at, found = _find_sorted(self._stored_hashes, hashes)
        return hashes[~found]

    # ---------------------------------------------------------------- loading a batch

    def load(self, items: list[PreparedRun | RunOutcome], progress: RunProgress) -> list[RunOutcome]:
        """Outcomes of the batch's runs, in order. The batch is laid out together (stack ids, symbols,
        frames), then its runs are loaded in transactions (`_transaction_end`). When a transaction
        of several runs fails on its data, its runs are loaded again one by one; when one run
        fails, it is quarantined and the runs after it are laid out again without it."""
        runs = [item for item in items if isinstance(item, PreparedRun)]
        loaded: dict[int, RunOutcome] = {}
        while runs:
            try:
                batch = self._lay_out(runs, progress)
            except _FramesUnreadable as unreadable:
                self._abandon()  # the transaction begun during the layout
                run = runs.pop(unreadable.index)
                loaded[id(run)] = RunOutcome(run.run_dir, "quarantined", run_id=run.run_id, reason=unreadable.reason)
                continue
            failed = self._load_groups(batch, loaded, progress)
            runs = runs[failed + 1 :] if failed is not None else []  # stacks it would have brought in: laid out again
            if batch.frames is not None:
                self._count_frames(batch.frames)
        return [loaded[id(item)] if isinstance(item, PreparedRun) else item for item in items]

    def _load_groups(self, batch: Batch, loaded: dict[int, RunOutcome], progress: RunProgress) -> int | None:
        """Loads the batch's runs, a transaction for each group (`_transaction_end`); the index of
        the first run that failed on its data (quarantined; the runs after it are not loaded), else
        None.

        Two transactions are under way at a time, on two connections: while one inserts its
        stacks, sites and run rows and commits (one statement after another, mostly on one core),
        the next one's events are loaded on the other connection (`_begin`). They commit in order,
        and the next one is rolled back whenever the one before it fails."""
        start = alone_until = 0

        def runs_from(first: int) -> range:
            return range(first, first + 1 if first < alone_until else self._transaction_end(batch, first))

        try:
            while start < len(batch.runs):
                runs = runs_from(start)
                events = sum(batch.runs[i].events for i in runs)
                names = batch.runs[start].run_dir.name + (f" and {len(runs) - 1} more" if len(runs) > 1 else "")
                progress.describe(f"loading {events:,} events of {names}")
                try:
                    if not any(tx.runs == runs for tx in self._open):
                        self._begin(batch, runs)
                    if runs.stop < len(batch.runs):
                        self._begin(batch, runs_from(runs.stop), background=True)
                    loaded.update(self._load_runs(batch, runs))
                except (DamagedRunError, QuarantineRun) as error:
                    self._abandon()
                    if len(runs) > 1:
                        alone_until = runs.stop  # the runs of this group one by one: which of them fails
                        continue
                    run = batch.runs[start]
                    reason = str(error) if isinstance(error, DamagedRunError) else f"{run.run_dir}: {error}"
                    loaded[id(run)] = RunOutcome(run.run_dir, "quarantined", run_id=run.run_id, reason=reason)
                    return start
                start = runs.stop
        finally:
            self._abandon()
        return None

    def _begin_during_layout(self, batch: Batch) -> None:
        """Begins the batch's first transaction and loads its events in the worker thread while the
        layout goes on: its events and their counts per stack need only the stack ids (its site
        counts wait until the layout has sited the new stacks)."""
        # DuckDB's threads for the batch, set before anything runs beside the loading thread.
        self._use_threads(1 if self._small(batch) else self._default_threads)
        if any(run.events for run in batch.runs):
            self._begin(batch, range(0, self._transaction_end(batch, 0)), background=True)

    def _transaction_end(self, batch: Batch, first: int) -> int:
        """The end (exclusive) of the transaction that begins with the batch's run `first`."""
        return transaction_end([run.rows for run in batch.runs], first, self.options.runs_per_transaction)

    def _small(self, batch: Batch) -> bool:
        """Whether every transaction of the batch holds fewer than ONE_THREAD_BELOW_EVENTS events."""
        first = 0
        while first < len(batch.runs):
            end = self._transaction_end(batch, first)
            if sum(run.events for run in batch.runs[first:end]) >= ONE_THREAD_BELOW_EVENTS:
                return False
            first = end
        return True

    def _begin(self, batch: Batch, runs: range, *, background: bool = False) -> None:
        """Opens the transaction of the runs `runs` on a connection no other one uses, and loads their
        events there (`_events_phase`): in the worker thread with `background`, else at once.

        What must follow run order is decided here, before: their run numbers, event ids and new
        event names' ids. A transaction begun in the background reads nothing the one before it
        writes (its names and stack ids are in memory), so it may run before that one commits."""
        # The second connection first: a batch's first transaction is begun while the layout still
        # reads and writes on the first (`_begin_during_layout`).
        db = next(d for d in reversed(self._dbs) if all(tx.db is not d for tx in self._open))
        chosen = [batch.runs[i] for i in runs]
        # Numbers first, deletes after: a new run must not be given the number (or event ids) of a
        # run loaded again, whose rows the deletes take away.
        run_rows.next_event_ids(db, 0)
        replaced = []
        for run in chosen:
            numbers = (
                query_rows(db.con, "SELECT run_number FROM runs WHERE run_id = ?", [run.run_id]) if run.replace else []
            )
            if numbers:
                run.run_number = numbers[0][0]
                replaced.append(run)
            else:
                run.run_number = run_rows.next_run_numbers(db, 1)
        tx = _Underway(runs, db, replaced, run_rows.plan_events(db, batch, runs))
        self._open.append(tx)
        db.con.execute("BEGIN TRANSACTION")
        tx.open = True
        # DuckDB takes a transaction's snapshot at its first read of the database, not at BEGIN:
        # read now, it sees every transaction committed so far and none still under way (the one
        # begun before it), wherever the worker thread gets to it. What it needs of that one's
        # rows (the sites of the stacks it brought in, for the site counts) the batch holds.
        db.con.execute("SELECT 1 FROM runs WHERE false").fetchall()
        if background:
            tx.events_loaded = self._worker.submit(_events_phase, batch, tx)
        else:
            _events_phase(batch, tx)  # a failure leaves it in `_open`, for `_abandon`

    def _abandon(self) -> None:
        """Rolls back every transaction under way, failed ones included (`_load_groups` calls it
        whenever a load ends): the ids they were given are forgotten with the rest of what the
        ingest keeps."""
        if not self._open:
            return
        for tx in self._open:
            if tx.events_loaded is not None:
                tx.events_loaded.exception()  # waits; a failed one rolled itself back
            if tx.open:
                tx.open = False
                try:
                    tx.db.con.execute("ROLLBACK")
                except Exception:  # the connection's transaction already ended with its error
                    pass
        self._open.clear()
        self.db.kept.clear()

    def _load_runs(self, batch: Batch, runs: range) -> dict[int, RunOutcome]:
        """Runs of a laid-out batch (consecutive indices), in one transaction, begun by `_begin`
        (their events loaded): their site counts, run rows and the modules each loaded, their share
        of the batch's new symbols, stacks and frames, their sites and GPU activity, then the commit."""
        tx = next((tx for tx in self._open if tx.runs == runs), None)
        if tx is None:
            self._begin(batch, runs)
            tx = self._open[-1]
        tx.awaited = True  # its site counts left to this thread from now on (`_events_phase`)
        if tx.events_loaded is not None:
            _events_loaded(tx)  # a failure leaves it in `_open`, for `_abandon`
        db = tx.db
        if tx.counts is not None:
            insert_site_counts(db, tx.counts, batch.counted_sites)
            tx.counts = None
        chosen = [batch.runs[i] for i in runs]
        part = batch.part_of(runs)
        self._open.remove(tx)
        tx.open = False  # ended by the block below, committed or rolled back
        with db.transaction(begun=True):
            # Here rather than beside (`_events_phase`): the events' load is the longer of the two.
            run_rows.insert_runs(db, chosen)
            run_rows.insert_run_modules(db, chosen)
            run_rows.insert_event_names(db, tx.events)
            if part.symbols is not None and part.symbols.num_rows:
                db.insert("INSERT INTO symbols BY NAME SELECT * FROM {}", part.symbols)
            statuses = batch.statuses_of(runs)
            run_rows.insert_modules(db, chosen, statuses)
            if part.new_order is not None and len(part.new_order):
                run_rows.insert_stacks(db, batch, part)
                record_portable_files(
                    db, {f: (p, root) for f, (p, root, first) in batch.new_files.items() if first in runs}
                )
                insert_sites(db, *batch.new_sites_of(runs))
            for run in chosen:
                run_gpu.insert_gpu_activity(db, run.run_number, run.gpu_files)
            for run in chosen:
                _before_commit(run.run_id)
        if statuses is not None:
            batch.statuses_stored.update(statuses["module_key"].to_pylist())
        outcomes = {}
        for run in chosen:
            complete = bool(run.manifest.get("complete"))
            self._loaded[run.run_id] = (complete, run.fingerprint)
            outcomes[id(run)] = RunOutcome(
                run.run_dir,
                "updated" if run.replace else "ingested",
                run_id=run.run_id,
                complete=complete,
                events=run.events,
                new_stacks=run.new_stacks,
                notes=run.loaded_notes,
            )
        return outcomes

    def _lay_out(self, runs: list[PreparedRun], progress: RunProgress) -> Batch:
        flat, run_of_stack = concat_flat_runs([run.flat for run in runs])
        progress.describe(f"hashing {len(flat.raw_ids):,} stacks")
        stack_ids, new_ids = self._stack_ids(flat)
        new_order = np.flatnonzero(new_ids >= 0)
        new_order = new_order[np.argsort(new_ids[new_order], kind="stable")]
        if not flat.has_frames:
            # A run read without its frames brings in a stack after all (the run it was to come
            # with was quarantined, or is not loaded): its frames are read now.
            lacking = [i for i in np.unique(run_of_stack[new_order]).tolist() if not runs[i].flat.has_frames]
            if lacking:
                for i in lacking:
                    _read_frames(runs, i)
                return self._lay_out(runs, progress)
        batch = Batch(runs, flat, run_of_stack, stack_ids, new_ids, new_order)
        brought = np.bincount(run_of_stack[new_order], minlength=len(runs))
        for run, count in zip(runs, brought):
            run.new_stacks = int(count)
        # The folders of generated code the runs name, before any stack is sited: never a site.
        store_generated_code(self.db, [run.manifest for run in runs])
        self._begin_during_layout(batch)
        if len(new_order):
            slots, shapes = self._slots(flat, new_ids, new_order)
            progress.describe(f"symbolizing the frames of {len(new_order):,} new stacks")
            # Each symbol key's first slot: slots come by stack id, so that is the first run's use.
            first_uses = layout.distinct_native_slots(slots)
            known, batch.symbols, batch.statuses = self.symbols.symbols_for(slots, first_uses)
            batch.slot_keys = pa.table(
                {
                    "stack_id": pa.array(slots.stack_id[first_uses], pa.int64()),
                    # Plain strings: joined with the plain keys of the new symbols.
                    "module_key": slots.module_key.take(pa.array(first_uses)).cast(pa.string()),
                    "address": pa.array(slots.address[first_uses], pa.uint64()),
                    "exact": pa.array(slots.exact[first_uses], pa.bool_()),
                }
            )
            batch.frames = layout.expand(slots, known)
            batch.problems = shapes.problem
            batch.frame_ids = resolve_frames(self.db, batch.frames.frames)
            row_run = batch.runs_of_new_stacks(batch.frames.rows["stack_id"].to_numpy())
            batch.frame_first_run = np.full(batch.frames.frames.num_rows, len(runs), dtype=np.int64)
            np.minimum.at(batch.frame_first_run, batch.frames.rows["frame"].to_numpy(), row_run)
            portable = self._name_source_files(batch)
            sites = sites_of_laid_out(self.db, batch.frames, new_ids[new_order], portable)
            # Site ids decided here for the batch, as stack and frame ids are: each transaction's
            # site counts can then be taken in memory, beside the transaction before it.
            site_order = batch.runs_of_new_stacks(sites["stack_id"].to_numpy())
            batch.stack_sites, batch.new_sites = number_sites(self.db, sites, site_order)
        batch.counted_sites = sites_for_counting(self.db, batch.stored_stack_ids(), batch.stack_sites)
        return batch

    def _stack_ids(self, flat) -> tuple[np.ndarray, np.ndarray]:
        """Per flat stack: its database stack_id, and the id again where its run brings it in (else -1)."""
        db = self.db
        hashes, first, inverse = np.unique(flat.hashes, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
        db.register("ingest_hashes", pa.table({"stack_hash": pa.array(hashes, pa.uint64())}))
        try:
            known = query_arrow(
                db.con,
                "SELECT stack_hash, stack_id FROM stacks WHERE stack_hash IN (SELECT stack_hash FROM ingest_hashes)",
            )
        finally:
            db.unregister("ingest_hashes")
        ids = np.full(len(hashes), -1, dtype=np.int64)
        if known.num_rows:
            ids[np.searchsorted(hashes, known["stack_hash"].to_numpy())] = known["stack_id"].to_numpy()
        missing = np.flatnonzero(ids < 0)
        # New ids follow the order the raw stacks come in, so each run's frames are stored by stack id.
        missing = missing[np.argsort(first[missing], kind="stable")]
        base = query_value(db.con, "SELECT coalesce(max(stack_id), 0) + 1 FROM stacks")
        ids[missing] = base + np.arange(len(missing), dtype=np.int64)
        new = np.full(len(flat.hashes), -1, dtype=np.int64)
        # One raw stack stands for each new hash (the first run of the batch that has it brings it in).
        new[first[missing]] = ids[missing]
        return ids[inverse], new

    def _slots(self, flat, new_ids: np.ndarray, new_order: np.ndarray):
        """Slots of the new stacks (by stack id)."""
        return layout.combined_slots(
            stack_ids=new_ids[new_order],
            **flat.frames(new_order).slot_arguments(),
            modules=flat.modules,
            code=flat.code,
        )

    def _name_source_files(self, batch: Batch) -> dict[str, str]:
        """The portable name of every Python file of the batch's new frames: the database's for files
        it knows, else relative to the import roots of the first run whose new stacks use the file
        (kept in `batch.new_files` for that run's transaction to insert)."""
        table = batch.frames.frames
        python = pc.and_(pc.equal(table["kind"], "python"), pc.is_valid(table["file"]))
        # Each file once, with the first run whose new stacks use it (not a Python step per frame).
        first_run = (
            pa.table({"file": table["file"].filter(python), "run": pa.array(batch.frame_first_run).filter(python)})
            .group_by("file")
            .aggregate([("run", "min")])
        )
        wanted = first_run["file"].to_pylist()
        if not wanted:
            return {}
        known = dict(
            query_rows(
                self.db.con, "SELECT file, portable_file FROM source_files WHERE list_contains(?, file)", [wanted]
            )
        )
        roots_of: dict[int, list[str]] = {}
        for file, run in zip(wanted, first_run["run_min"].to_pylist()):
            if file not in known:
                roots = roots_of.setdefault(run, import_roots(batch.runs[run].manifest))
                batch.new_files[file] = (*portable_file(file, roots), run)
        return {**known, **{f: named[0] for f, named in batch.new_files.items()}}

    def _count_frames(self, frames: layout.Frames) -> None:
        """Adds the new stacks' native frames to the summary: symbolized, or unsymbolized by reason."""
        rows = frames.rows
        first_in_chain = rows["chain_depth"].to_numpy() == 0
        uses = np.bincount(rows["frame"].to_numpy()[first_in_chain], minlength=frames.frames.num_rows)
        self.db.register("ingest_new_frames", frames.frames.append_column("uses", pa.array(uses, pa.int64())))
        try:
            rows = query_rows(
                self.db.con,
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
            self.db.unregister("ingest_new_frames")
        summary = self.summary
        for symbolized, reason, module_key, module, count in rows:
            if symbolized:
                summary.frames_symbolized += count
                continue
            summary.frames_unsymbolized += count
            group = summary.unsymbolized.setdefault(reason, UnsymbolizedGroup(reason))
            group.frames += count
            group.modules[module_key or "?"] = module or "?"


class _FramesUnreadable(Exception):
    """The frames of a run prepared without them (`RunLoader._lay_out`) could not be read: it is quarantined."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index = index
        self.reason = reason


def _read_frames(runs: list[PreparedRun], index: int) -> None:
    """Reads the whole stacks of run `index` of `runs`, which was prepared without their frames;
    their hashes must be the ones it was prepared with."""
    run = runs[index]
    try:
        tables = read_tables(run.stack_files, STACK_TABLES)
        flat = flatten_run(tables)
        if not (np.array_equal(flat.raw_ids, run.flat.raw_ids) and np.array_equal(flat.hashes, run.flat.hashes)):
            raise DamagedRunError(f"{run.run_dir}: its stacks changed while it was loaded")
    except DamagedRunError as error:
        raise _FramesUnreadable(index, str(error)) from None
    run.flat = flat


@dataclass
class _Underway:
    """A transaction begun and not yet ended: its runs, its connection, what was decided for it."""

    runs: range
    db: IngestDb  # on the connection it holds
    replaced: list[PreparedRun]  # runs loaded again, whose old rows it deletes
    events: run_rows.EventsPlan
    open: bool = False  # its connection's transaction is open
    events_loaded: Future | None = None  # its events phase, when in the worker thread
    # Its events' counts per stack (`_events_phase`), until its site counts are taken from them.
    counts: pa.Table | None = None
    awaited: bool = False  # the loading thread has come to it (and takes its site counts)


def _events_phase(batch: Batch, tx: _Underway) -> None:
    """BEGIN, the old rows of runs loaded again deleted, then the rows that depend on no other run's:
    events, and their counts per stack (kept in `tx.counts` for the site counts). The transaction
    is left open (or rolled back on failure)."""
    db, con = tx.db, tx.db.con
    try:
        for run in tx.replaced:
            for table in ("event_counts", "event_rows", "site_counts"):
                db.delete(f"DELETE FROM {table} WHERE run_number = ?", [run.run_number])
            run_gpu.delete_run(db, run.run_number)
            for table in ("run_modules", "runs"):
                db.delete(f"DELETE FROM {table} WHERE run_id = ?", [run.run_id])
        if run_rows.load_events(con, batch, tx.runs, tx.events):
            tx.counts = run_rows.count_events(con, batch, tx.runs)
            # Its site counts too, while the loading thread is still busy with the transaction
            # before it; once that thread waits for this one, it takes them itself (`_load_runs`).
            # The worker is ahead on some runs (many new stacks a run) and behind on others (small
            # runs), and whichever thread would wait does them. Never before the layout has sited
            # the batch's new stacks (`counted_sites`).
            if not tx.awaited and batch.counted_sites is not None:
                insert_site_counts(db, tx.counts, batch.counted_sites)
                tx.counts = None
    except BaseException as error:
        tx.open = False
        con.execute("ROLLBACK")
        raise_for_data_error(error)
        raise


def _events_loaded(tx: _Underway) -> None:
    """Waits for the events phase of a transaction begun in the worker thread (raising its error)."""
    tx.events_loaded.result()


def _find_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `values` is in `keys` (sorted, distinct), and whether it is there at all (where
    it is not, its place is an index inside `keys`, never past its end)."""
    if not len(keys):
        return np.zeros(len(values), dtype=np.intp), np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return at, keys[at] == values


class _StackClaims:
    """The stack hashes that runs read whole bring in, each with the position (in load order) of the
    first such run that holds it: the threads preparing runs ask it whether a run's stacks all come
    before it. Sorted arrays looked up a run at a time: a dictionary looked up a hash at a time held
    the GIL for a tenth of a night of small runs, while the threads beside it waited. New hashes go
    to a small array, merged into the big one now and then (`MERGE_AT`), so that a run costs about
    its own hashes, not the ingest's."""

    # The small array is merged into the big one once it holds a quarter of the big one's hashes,
    # or this many.
    MERGE_AT = 1 << 14

    def __init__(self) -> None:
        self._lock = threading.Lock()
        empty = (np.empty(0, np.uint64), np.empty(0, np.int64))
        self._big, self._recent = empty, empty  # each (hashes sorted and distinct, positions)

    def claimed_before(self, hashes: np.ndarray, position: int) -> bool:
        """Whether runs before `position` claim every one of `hashes`; else the run at `position`
        claims those that no run before it does (it is read whole, and the runs after it need not
        read these stacks' frames). Any order answers the same; sorted `hashes` are searched in
        0.12 ms for a small run's 2.4k against 0.2 (each search starts where the one before ended,
        and its branches go the same way more often)."""
        with self._lock:
            claims = np.full(len(hashes), position + 1, dtype=np.int64)  # unclaimed: as if after it
            claimed = np.zeros(len(hashes), dtype=bool)
            found_in = []
            for keys, positions in (self._big, self._recent):
                at, found = _find_sorted(keys, hashes)
                claims[found] = positions[at[found]]
                claimed |= found
                found_in.append((positions, at, found))
            if (claims < position).all():
                return True
            for positions, at, found in found_in:  # claimed by runs after it: now by this one
                positions[at[found & (claims > position)]] = position
            unclaimed = np.unique(hashes[~claimed])
            keys, positions = self._recent
            at = np.searchsorted(keys, unclaimed)
            keys, positions = np.insert(keys, at, unclaimed), np.insert(positions, at, position)
            if len(keys) > max(len(self._big[0]) // 4, self.MERGE_AT):
                merged = np.concatenate([self._big[0], keys])
                order = np.argsort(merged, kind="stable")
                self._big = (merged[order], np.concatenate([self._big[1], positions])[order])
                keys, positions = keys[:0], positions[:0]
            self._recent = (keys, positions)
            return False


class _PreparedAhead:
    """`prepare` over the run folders on worker threads, handed over in order, at most a batch
    ahead (BATCH_RUNS runs, BATCH_EVENTS events) of the runs taken: a prepared run holds its stacks
    in memory until then. Reading a run's parts is mostly waiting on Parquet decoding and checksums,
    which release the GIL: with several workers, a night of small runs is read as fast as it loads."""

    def __init__(self, prepare: Callable[[Path], PreparedRun | RunOutcome], run_dirs: list[Path], workers: int):
        self._prepare = prepare
        self._run_dirs = list(run_dirs)
        self._ready: dict[int, PreparedRun | RunOutcome | BaseException] = {}
        self._ready_events = 0
        self._claimed = 0  # runs handed to a worker
        self._taken = 0  # runs handed over
        self._stopped = False
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name="tbpipe-prepare", daemon=True) for _ in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _events(result: object) -> int:
        return result.events if isinstance(result, PreparedRun) else 0

    def _may_claim(self) -> bool:
        return self._claimed - self._taken < BATCH_RUNS and self._ready_events < BATCH_EVENTS

    def _work(self) -> None:
        _lower_priority(PREPARE_NICE)
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._stopped or self._claimed >= len(self._run_dirs) or self._may_claim()
                )
                if self._stopped or self._claimed >= len(self._run_dirs):
                    return
                index = self._claimed
                self._claimed += 1
            try:
                result: PreparedRun | RunOutcome | BaseException = self._prepare(self._run_dirs[index])
            except BaseException as error:  # raised in the loading thread, at this run
                result = error
            with self._changed:
                self._ready[index] = result
                self._ready_events += self._events(result)
                self._changed.notify_all()

    def __iter__(self) -> Iterator[tuple[Path, PreparedRun | RunOutcome]]:
        for index, run_dir in enumerate(self._run_dirs):
            with self._changed:
                self._changed.wait_for(lambda index=index: index in self._ready)
                result = self._ready.pop(index)
                self._ready_events -= self._events(result)
                self._taken = index + 1
                self._changed.notify_all()
            if isinstance(result, BaseException):
                raise result
            yield run_dir, result

    def close(self) -> None:
        """Stops after the runs being prepared (if any)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()


def _lower_priority(by: int) -> None:
    """Raises the calling thread's nice value by `by` (Linux only: elsewhere the call would set a
    whole process's, or fail)."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError:  # a sandbox that forbids it: the ingest runs as before
        pass


@contextmanager
def _without_huge_pages() -> Iterator[None]:
    """The process without transparent huge pages while the ingest runs (as before after it). The
    ingest makes and drops buffers of megabytes one after another (numpy's arrays, Arrow's pool,
    DuckDB's copies); where they are backed by huge pages the kernel zeroes each fresh 2 MB page on
    first touch. On the 10M-event bench that zeroing took 9 % of the CPU and the ingest took about
    1 s of CPU more (user and system) than without. Linux's prctl covers the whole process; numpy's
    own switch is turned off too, for systems without the prctl."""
    restore = [_thp_disabled(True)]
    try:
        setting = np._core.multiarray._set_madvise_hugepage
    except AttributeError:  # a numpy without the switch (before 2.0 it lived elsewhere)
        setting = None
    if setting is not None:
        before = setting(False)
        restore.append(lambda: setting(before))
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _thp_disabled(disabled: bool) -> Callable[[], None]:
    """Sets Linux's PR_SET_THP_DISABLE for the process; returns what sets it back as it was (a
    no-op where there is no such prctl)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    get_thp_disable, set_thp_disable = 42, 41  # <linux/prctl.h>
    before = prctl(get_thp_disable, 0, 0, 0, 0)
    if before < 0 or prctl(set_thp_disable, int(disabled), 0, 0, 0) < 0:
        return lambda: None
    return lambda: prctl(set_thp_disable, before, 0, 0, 0)


def transaction_end(rows: Sequence[int], first: int, runs_per_transaction: int | None = None) -> int:
    """The end (exclusive) of the transaction that begins with run `first` of runs that load `rows`
    rows each: `runs_per_transaction` runs when given, else as many consecutive runs as load at most
    ROWS_PER_TRANSACTION rows together (at least the first)."""
    if runs_per_transaction is not None:
        return min(first + max(1, runs_per_transaction), len(rows))
    end, total = first + 1, rows[first]
    while end < len(rows) and total + rows[end] <= ROWS_PER_TRANSACTION:
        total += rows[end]
        end += 1
    return end


def checkpoint_at_close(con: Any) -> bool:
    """The ingest's checkpoint settings, for this connection's database: one checkpoint, when the
    database closes, without merging row groups. Returns False where the DuckDB version cannot turn
    the merging off.

    Checkpointing after every commit would rewrite the growing tables once per batch; the WAL holds
    the committed batches until the close. That checkpoint would also merge row groups: each run's
    events end in a partial row group, and DuckDB rewrites runs of such groups into fewer full ones
    (its vacuum), freeing the blocks they were in. Those blocks stay in the file (a quarter of it
    after the 10M-event bench, and 2 s of the close); without the merge the partial groups stay as
    they are (a few per run)."""
    import duckdb

    con.execute("SET checkpoint_threshold = '4GB'")
    try:
        con.execute("SET max_vacuum_tasks = 0")
    except duckdb.Error:
        return False
    return True


def _before_commit(run_id: str) -> None:
    """Test seam: the last moment of a run's transaction (tests kill the ingest here)."""
