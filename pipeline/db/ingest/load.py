"""The ingest's last stage: a laid-out batch loaded in transactions, each run whole or not at all.

Consecutive runs share a transaction up to `limits.rows_per_transaction` rows (a big run goes
alone; `runs_per_transaction` fixes the count). Each transaction has two phases:

1. events (on the events thread, `_load_events`): BEGIN, the old rows of runs loaded again
   deleted, the runs' events straight from their Parquet parts, their counts per stack. Its run
   numbers, event ids and new names' ids are decided before, in run order, so it reads nothing
   another transaction under way writes;
2. finish (on the loading thread, `_finish`): the site counts, run rows, modules, the runs' share
   of the batch's new symbols, stacks, frames and sites, GPU activity, then COMMIT.

Two transactions are under way at a time, on two connections: the next one's events load while
the loading thread finishes the one before, and a batch's first transaction's events load while
the batch is laid out (`begin_batch`). They commit in order. `Loader` owns the connections and the
events thread; each `Transaction` has one state, changed by the loading thread alone.

A transaction that fails on its data is rolled back with the one begun beside it; a failed group of
runs is loaded again run by run to find the run at fault, which is quarantined.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.ingest import gpu as run_gpu
from tbpipe.pipeline.db.ingest import rows as run_rows
from tbpipe.pipeline.db.ingest.lay_out import LaidOutBatch, StackIds
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, RunOutcome
from tbpipe.pipeline.db.ingest.pending import LoadedRuns
from tbpipe.pipeline.db.ingest.site_counts import insert_site_counts
from tbpipe.pipeline.db.ingest.siting import insert_sites, record_portable_files
from tbpipe.pipeline.db.ingest.tables import IngestDb, QuarantineRun, raise_for_data_error
from tbpipe.pipeline.db.ingest.tuning import DuckdbThreads
from tbpipe.pipeline.db.retain import ROLLED_UP_TABLES
from tbpipe.pipeline.progress import RunProgress
from tbpipe.pipeline.rawrun import DamagedRunError


def transaction_end(
    rows: Sequence[int], first: int, rows_per_transaction: int, runs_per_transaction: int | None = None
) -> int:
    """The end (exclusive) of the transaction that begins with run `first` of runs that load `rows`
    rows each: `runs_per_transaction` runs when given, else as many consecutive runs as load at most
    `rows_per_transaction` rows together (at least the first)."""
    if runs_per_transaction is not None:
        return min(first + max(1, runs_per_transaction), len(rows))
    end, total = first + 1, rows[first]
    while end < len(rows) and total + rows[end] <= rows_per_transaction:
        total += rows[end]
        end += 1
    return end


class TxState(enum.Enum):
    BEGUN = "begun"  # BEGIN ran on its connection; its events load (or loaded) on the events thread
    COMMITTED = "committed"
    ROLLED_BACK = "rolled back"


@dataclass(frozen=True)
class EventsLoaded:
    """What a transaction's events phase found, per run index of the batch."""

    counts: pa.Table | None  # its `event_counts` rows (None: no events parts)
    stacks_used: dict[int, int]
    dangling: dict[int, int]  # events whose stack the run does not hold


class Transaction:
    """One transaction under way: its runs (batch indices), connection, run numbers and state."""

    def __init__(self, runs: range, db: IngestDb, numbers: dict[int, int], plan: run_rows.EventsPlan):
        self.runs = runs
        self.db = db
        self.numbers = numbers
        self.plan = plan
        self.state = TxState.BEGUN
        self.events: Future[EventsLoaded] | None = None

    def roll_back(self) -> None:
        """Waits for its events phase, then rolls it back (a no-op once it ended)."""
        if self.events is not None:
            self.events.exception()
        if self.state is TxState.BEGUN:
            self.state = TxState.ROLLED_BACK
            try:
                self.db.con.execute("ROLLBACK")
            except Exception:  # the connection's transaction already ended with its error
                pass


class Loader:
    """Loads laid-out batches (`begin_batch`, then `load`); owns the second connection and the
    events thread. `close` before the database closes."""

    def __init__(self, db: IngestDb, options: IngestOptions, loaded: LoadedRuns):
        self._db = db
        self._options = options
        self._limits = options.limits
        self._loaded = loaded
        self._threads = DuckdbThreads(db.con)
        self._dbs = [db, db.on(db.con.cursor())]
        self._events_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tbpipe-events")
        self._under_way: list[Transaction] = []
        self._statuses_stored: set[str] = set()  # module keys whose status a committed transaction of the batch stored

    def close(self) -> None:
        self.abandon()
        self._events_thread.shutdown()
        self._dbs[1].con.close()
        self._threads.reset()  # for the closing checkpoint

    def abandon(self) -> None:
        """Rolls back every transaction under way (a load ends with none): the ids they were given
        are forgotten with the rest of what the ingest keeps."""
        if not self._under_way:
            return
        for tx in self._under_way:
            tx.roll_back()
        self._under_way.clear()
        self._db.kept.clear()

    # ------------------------------------------------------------------------------ a batch

    def begin_batch(self, ids: StackIds) -> None:
        """Sets DuckDB's threads for the batch and begins its first transaction (its events need
        only the stack ids), so they load while the batch is laid out."""
        self._statuses_stored = set()
        self._threads.use(1 if self._small(ids) else self._threads.default)
        if any(run.events for run in ids.runs):
            self._begin(ids, range(0, self._transaction_end(ids, 0)))

    def load(self, batch: LaidOutBatch, progress: RunProgress) -> tuple[dict[int, RunOutcome], int | None]:
        """The outcomes of the batch's runs (by index) that loaded, and the index of the first run
        that failed on its data (quarantined among the outcomes; the runs after it are not loaded),
        else None."""
        outcomes: dict[int, RunOutcome] = {}
        start = alone_until = 0

        def runs_from(first: int) -> range:
            return range(first, first + 1 if first < alone_until else self._transaction_end(batch, first))

        try:
            while start < len(batch.runs):
                runs = runs_from(start)
                progress.describe(_describe(batch, runs))
                try:
                    tx = next((tx for tx in self._under_way if tx.runs == runs), None) or self._begin(batch, runs)
                    if runs.stop < len(batch.runs):
                        self._begin(batch, runs_from(runs.stop))  # loads beside this one's finish
                    outcomes.update(self._finish(batch, tx))
                except (DamagedRunError, QuarantineRun) as error:
                    self.abandon()
                    if len(runs) > 1:
                        alone_until = runs.stop  # the runs of this group one by one: which of them fails
                        continue
                    run = batch.runs[start]
                    reason = str(error) if isinstance(error, DamagedRunError) else f"{run.run_dir}: {error}"
                    outcomes[start] = RunOutcome(run.run_dir, "quarantined", run_id=run.run_id, reason=reason)
                    return outcomes, start
                start = runs.stop
        finally:
            self.abandon()
        return outcomes, None

    def _transaction_end(self, ids: StackIds, first: int) -> int:
        rows = [run.rows for run in ids.runs]
        return transaction_end(rows, first, self._limits.rows_per_transaction, self._options.runs_per_transaction)

    def _small(self, ids: StackIds) -> bool:
        """Whether every transaction of the batch holds fewer than `one_thread_below_events` events."""
        first = 0
        while first < len(ids.runs):
            end = self._transaction_end(ids, first)
            if sum(run.events for run in ids.runs[first:end]) >= self._limits.one_thread_below_events:
                return False
            first = end
        return True

    # ------------------------------------------------------------------------------ a transaction

    def _begin(self, ids: StackIds, runs: range) -> Transaction:
        """Opens the transaction of the runs `runs` on a connection no other one uses (the second
        first: the layout reads on the first) and starts its events phase on the events thread."""
        db = next(d for d in reversed(self._dbs) if all(tx.db is not d for tx in self._under_way))
        # Numbers first, deletes after: a new run must not be given the number (or event ids) of a
        # run loaded again, whose rows the deletes take away.
        run_rows.next_event_ids(db, 0)
        numbers, replaced = {}, []
        for i in runs:
            run = ids.runs[i]
            old = (
                query_rows(db.con, "SELECT run_number FROM runs WHERE run_id = ?", [run.run_id]) if run.replace else []
            )
            numbers[i] = old[0][0] if old else run_rows.next_run_numbers(db, 1)
            if old:
                replaced.append(i)
        tx = Transaction(runs, db, numbers, run_rows.plan_events(db, ids, runs))
        self._under_way.append(tx)
        db.con.execute("BEGIN TRANSACTION")
        # DuckDB takes a transaction's snapshot at its first read, not at BEGIN: read now, it sees
        # every transaction committed so far and none still under way (the one begun before it).
        # What it needs of that one's rows (the sites of the stacks it brings in) the batch holds.
        db.con.execute("SELECT 1 FROM runs WHERE false").fetchall()
        tx.events = self._events_thread.submit(self._load_events, ids, tx, replaced)
        return tx

    def _load_events(self, ids: StackIds, tx: Transaction, replaced: list[int]) -> EventsLoaded:
        """The events phase (on the events thread); the transaction stays open."""
        self._options.hooks.loading_events([ids.runs[i].run_id for i in tx.runs])
        db, con = tx.db, tx.db.con
        try:
            for i in replaced:
                number, run_id = tx.numbers[i], ids.runs[i].run_id
                # A run loaded again after `tbpipe retain` rolled it up leaves its roll-up too.
                for table in ("event_counts", "event_rows", "site_counts", *ROLLED_UP_TABLES):
                    db.delete(f"DELETE FROM {table} WHERE run_number = ?", [number])
                run_gpu.delete_run(db, number)
                for table in ("run_modules", "runs"):
                    db.delete(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
            if not run_rows.load_events(con, ids, tx.runs, tx.numbers, tx.plan):
                return EventsLoaded(None, {i: 0 for i in tx.runs}, {i: 0 for i in tx.runs})
            counts, stacks_used, dangling = run_rows.count_events(con, ids, tx.runs, tx.numbers)
            return EventsLoaded(counts, stacks_used, dangling)
        except BaseException as error:
            raise_for_data_error(error)
            raise

    def _finish(self, batch: LaidOutBatch, tx: Transaction) -> dict[int, RunOutcome]:
        """The transaction's other rows and its commit (see the module docstring)."""
        chosen = [batch.runs[i] for i in tx.runs]
        self._options.hooks.finishing([run.run_id for run in chosen])
        events = tx.events.result()  # its failure leaves it under way, for `abandon`
        db = tx.db
        if events.counts is not None:
            insert_site_counts(db, events.counts, batch.counted_sites)
        statuses = batch.statuses_of(tx.runs, self._statuses_stored)
        self._under_way.remove(tx)  # ended below, committed or rolled back
        try:
            with db.transaction(begun=True):
                self._insert_rows(batch, tx, events, statuses)
                for run in chosen:
                    self._options.hooks.before_commit(run.run_id)
        except BaseException:
            tx.state = TxState.ROLLED_BACK
            raise
        tx.state = TxState.COMMITTED
        if statuses is not None:
            self._statuses_stored.update(statuses["module_key"].to_pylist())
        outcomes = {}
        for i, run in zip(tx.runs, chosen):
            self._loaded.loaded(run.run_id, run.complete, run.fingerprint)
            outcomes[i] = RunOutcome(
                run.run_dir,
                "updated" if run.replace else "ingested",
                run_id=run.run_id,
                complete=run.complete,
                events=run.events,
                new_stacks=int(batch.new_stacks_per_run[i]),
                notes=run.notes_with(events.dangling[i]),
            )
        return outcomes

    @staticmethod
    def _insert_rows(batch: LaidOutBatch, tx: Transaction, events: EventsLoaded, statuses: pa.Table | None) -> None:
        db, runs = tx.db, tx.runs
        chosen = [batch.runs[i] for i in runs]
        run_rows.insert_runs(
            db,
            [
                run_rows.LoadedRun(
                    run, tx.numbers[i], events.stacks_used[i], int(batch.new_stacks_per_run[i]), events.dangling[i]
                )
                for i, run in zip(runs, chosen)
            ],
        )
        run_rows.insert_run_modules(db, chosen)
        run_rows.insert_event_names(db, tx.plan)
        part = batch.part_of(runs)
        if part.symbols is not None and part.symbols.num_rows:
            db.insert("INSERT INTO symbols BY NAME SELECT * FROM {}", part.symbols)
        run_rows.insert_modules(db, chosen, statuses)
        if len(part.new_order):
            run_rows.insert_stacks(db, batch, part)
            record_portable_files(
                db, {f: (p, root) for f, (p, root, first) in batch.new.new_files.items() if first in runs}
            )
            insert_sites(db, *batch.new_sites_of(runs))
        for i in runs:
            run_gpu.insert_gpu_activity(db, tx.numbers[i], batch.runs[i].gpu_files)


def _describe(ids: StackIds, runs: range) -> str:
    events = sum(ids.runs[i].events for i in runs)
    name = ids.runs[runs.start].run_dir.name + (f" and {len(runs) - 1} more" if len(runs) > 1 else "")
    return f"loading {events:,} events of {name}"
