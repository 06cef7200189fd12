"""The ingest's second stage: a batch of prepared runs laid out against what the database holds,
into frozen hand-offs for the loading.

Two steps, so that loading can start between them:
- `assign_stack_ids`: every stack of the batch gets its database id, known by its hash or new
  (numbered in the order the runs bring them in) -> `StackIds`. That is all the runs' events need,
  so their first transaction begins loading them while the second step runs.
- `lay_out`: the new stacks' frames in combined order, their new symbols, frame ids, portable file
  names and sites, and the sites of every stack the runs use -> `LaidOutBatch`.

Both read the database (the ids it gave) and write nothing: the load inserts each transaction's
share of the batch (`LaidOutBatch.part_of`, `new_sites_of`). Ids are decided here for the whole
batch, in run order, so a batch stores what its runs loaded one by one would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_arrow, query_rows, query_value
from tbpipe.pipeline.db.ingest.frames import FrameIds, resolve_frames
from tbpipe.pipeline.db.ingest.read_ahead import PreparedRun, read_whole
from tbpipe.pipeline.db.ingest.site_counts import sites_for_counting
from tbpipe.pipeline.db.ingest.siting import import_roots, number_sites, portable_file, sites_of_laid_out
from tbpipe.pipeline.db.ingest.symbols import SymbolLoader
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.progress import RunProgress
from tbpipe.pipeline.rawrun import DamagedRunError
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.stacks.flatten import FlatRun, concat_flat_runs


class RunUnreadable(Exception):
    """A run of the batch, prepared without its frames, whose frames could not be read: it is
    quarantined and the batch laid out again without it."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index = index
        self.reason = reason


class ByRun:
    """Rows of a batch grouped by the run each belongs to: a transaction takes its runs' rows with a
    binary search rather than a scan of the whole batch."""

    def __init__(self, run_of_row: np.ndarray):
        self._rows = np.argsort(run_of_row, kind="stable")  # each run's rows in increasing order
        self._runs = run_of_row[self._rows]

    def rows_of(self, runs: range) -> np.ndarray:
        """The rows of the runs `runs` (consecutive run indices), increasing."""
        start, stop = np.searchsorted(self._runs, [runs.start, runs.stop])
        rows = self._rows[start:stop]
        return rows if len(runs) == 1 else np.sort(rows)

    def table_of(self, table: pa.Table, in_run_order: pa.Table, runs: range) -> pa.Table:
        """The rows of `table` (one per row grouped) of the runs `runs`, in order; `in_run_order`
        is `table` taken in run order (`in_run_order(table)`), of which one run's rows are a slice."""
        if len(runs) != 1:
            return table.take(self.rows_of(runs))
        start, stop = np.searchsorted(self._runs, [runs.start, runs.stop])
        return in_run_order.slice(start, stop - start)

    def in_run_order(self, table: pa.Table) -> pa.Table:
        return table.take(self._rows)


@dataclass(frozen=True)
class StackIds:
    """A batch's runs with the database id of every stack they use."""

    runs: tuple[PreparedRun, ...]
    flat: FlatRun  # the runs' flattened stacks, appended
    run_of_stack: np.ndarray  # index in `runs` of each flat stack's run
    stack_ids: np.ndarray  # database stack id per flat stack
    new_ids: np.ndarray  # database stack id where a run brings the stack in, else -1
    new_order: np.ndarray  # flat stack indices of the new stacks, by stack id

    def event_files_of(self, runs: range) -> list[tuple[int, Path, int]]:
        """(run index, part, rows) of the events parts of the runs `runs`, in order."""
        return [(i, path, rows) for i in runs for path, rows in self.runs[i].event_files]

    def runs_of_new_stacks(self, stack_ids: np.ndarray) -> np.ndarray:
        """The index of the run that brings in each of the given new stacks."""
        # New stacks are numbered one after another in `new_order`: a stack's place there is its
        # id less the first.
        first = self.new_ids[self.new_order[0]] if len(self.new_order) else 0
        return self.run_of_stack[self.new_order][stack_ids - first]

    def stored_stack_ids(self) -> np.ndarray:
        """Ids of the stacks its runs use that were stored before the batch (its new ones come after)."""
        if not len(self.new_order):
            return self.stack_ids
        return self.stack_ids[self.stack_ids < self.new_ids[self.new_order[0]]]

    @cached_property
    def new_stacks_per_run(self) -> np.ndarray:
        """How many stacks each run brings into the database."""
        return np.bincount(self.run_of_stack[self.new_order], minlength=len(self.runs))

    @cached_property
    def _flat_by_run(self) -> ByRun:
        return ByRun(self.run_of_stack)

    def stack_map(self, runs: range) -> pa.Table:
        """(run index, raw_id) -> stack_id for every distinct raw stack of the runs `runs`."""
        chosen = self._flat_by_run.rows_of(runs)
        return pa.table(
            {
                "run_index": pa.array(self.run_of_stack[chosen], pa.int32()),
                "raw_id": pa.array(self.flat.raw_ids[chosen], pa.uint64()),
                "stack_id": pa.array(self.stack_ids[chosen], pa.int64()),
            }
        )


@dataclass(frozen=True)
class RunPart:
    """The share of its batch's new rows that some of its runs (one transaction's) insert."""

    runs: range  # the runs' indices in the batch
    new_order: np.ndarray  # flat stack indices of the stacks they bring in, by stack id
    rows: np.ndarray | None  # rows of `LaidOutBatch.frames.rows` of those stacks
    frames: np.ndarray | None  # rows of `LaidOutBatch.frames.frames` to store: new frames these runs use first
    symbols: pa.Table | None  # new `symbols` rows they are the first to need


@dataclass(frozen=True)
class NewStacks:
    """What laying out a batch's new stacks gives (all None when it brings in none)."""

    frames: layout.Frames | None = None
    problems: pa.Array | None = None  # per new stack (order of `new_order`)
    symbols: pa.Table | None = None  # new `symbols` rows
    statuses: pa.Table | None = None  # `modules` rows of the modules just symbolized
    slot_keys: pa.Table | None = None  # stack_id, module_key, address, exact of each native symbol key's first slot
    frame_ids: FrameIds | None = None  # database ids of the layout's frames
    frame_first_run: np.ndarray | None = None  # per layout frame: the first run whose new stacks use it
    stack_sites: pa.Table | None = None  # the new stacks' `stack_sites` rows, by stack id, site ids decided
    new_sites: pa.Table | None = None  # `sites` rows of the keys the database lacks, with the first run (site_order)
    # Python files of the new frames that the database does not name yet: (portable, root, first run index)
    new_files: dict[str, tuple[str, str | None, int]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class LaidOutBatch(StackIds):
    """A batch ready to load: its stack ids, its new stacks laid out, and the sites to count by."""

    new: NewStacks = NewStacks()
    # `stack_sites` rows of every stack its runs use, by stack id: what their site counts read
    counted_sites: pa.Table | None = None

    def part_of(self, runs: range) -> RunPart:
        """What the runs `runs` (consecutive indices) insert of the batch's new things: the stacks
        they bring in, their frame rows and frames, and the new symbols they are the first to need."""
        order = self.new_order[self._new_stacks_by_run.rows_of(runs)]
        rows = frames = None
        if self.new.frames is not None and len(order):
            rows = self._frame_rows_by_run.rows_of(runs)
            frames = self._frames_by_run.rows_of(runs)
        symbols = None
        if self.new.symbols is not None and self.new.symbols.num_rows:
            by_run, in_order = self._symbols_by_run
            symbols = by_run.table_of(self.new.symbols, in_order, runs)
        return RunPart(runs, order, rows, frames, symbols)

    def new_sites_of(self, runs: range) -> tuple[pa.Table, pa.Table]:
        """What the runs `runs` insert of the batch's sites: the `sites` rows of the keys they are
        the first to bring in, and the `stack_sites` rows of the stacks they bring in."""
        (keys, keys_in_order), (stacks, stacks_in_order) = self._site_keys_by_run, self._stack_sites_by_run
        new_sites = keys.table_of(self.new.new_sites, keys_in_order, runs).drop_columns(["site_order"])
        return new_sites, stacks.table_of(self.new.stack_sites, stacks_in_order, runs)

    def statuses_of(self, runs: range, stored: set[str]) -> pa.Table | None:
        """`modules` rows of the modules the batch symbolized that the runs `runs` load and that are
        not in `stored` (module keys whose status an earlier transaction of the batch committed):
        each is written by the first transaction that loads the module, never by two (the one after
        it may not see its rows)."""
        statuses = self.new.statuses
        if statuses is None or not statuses.num_rows:
            return None
        keys = sorted(module_keys([self.runs[i] for i in runs]) - stored)
        return statuses.filter(pc.is_in(statuses["module_key"], pa.array(keys, pa.string())))

    # Each kind of the batch's rows grouped by run, at the first transaction that asks.
    @cached_property
    def _new_stacks_by_run(self) -> ByRun:
        return ByRun(self.run_of_stack[self.new_order])

    @cached_property
    def _frame_rows_by_run(self) -> ByRun:
        return ByRun(self.runs_of_new_stacks(self.new.frames.rows["stack_id"].to_numpy()))

    @cached_property
    def _frames_by_run(self) -> ByRun:
        # Frames the database lacks, by the first run whose new stacks use them (the others: none).
        return ByRun(np.where(self.new.frame_ids.new, self.new.frame_first_run, len(self.runs)))

    @cached_property
    def _symbols_by_run(self) -> tuple[ByRun, pa.Table]:
        return _with_run_order(ByRun(self._first_runs_of_symbols()), self.new.symbols)

    @cached_property
    def _site_keys_by_run(self) -> tuple[ByRun, pa.Table]:
        return _with_run_order(ByRun(self.new.new_sites["site_order"].to_numpy()), self.new.new_sites)

    @cached_property
    def _stack_sites_by_run(self) -> tuple[ByRun, pa.Table]:
        stacks = self.runs_of_new_stacks(self.new.stack_sites["stack_id"].to_numpy())
        return _with_run_order(ByRun(stacks), self.new.stack_sites)

    def _first_runs_of_symbols(self) -> np.ndarray:
        """Per new `symbols` row: the first run of the batch whose new stacks need its address (the
        run of its key's first slot: `slot_keys` holds each key once)."""
        slots, symbols = self.new.slot_keys, self.new.symbols
        used = pa.table(
            {
                "module_key": slots["module_key"],
                "address": slots["address"],
                "exact": slots["exact"],
                "run": pa.array(self.runs_of_new_stacks(slots["stack_id"].to_numpy()), pa.int64()),
            }
        )
        keyed = symbols.select(["module_key", "address", "exact"]).append_column(
            "row", pa.array(np.arange(symbols.num_rows), pa.int64())
        )
        joined = keyed.join(used, ["module_key", "address", "exact"], join_type="left outer")
        runs = np.zeros(symbols.num_rows, dtype=np.int64)
        runs[joined["row"].to_numpy()] = pc.fill_null(joined["run"], 0).to_numpy()
        return runs


def _with_run_order(by_run: ByRun, table: pa.Table) -> tuple[ByRun, pa.Table]:
    return by_run, by_run.in_run_order(table)


def module_keys(runs: list[PreparedRun]) -> set[str]:
    """The keys of the modules the runs loaded."""
    return {key for run in runs for key in run.flat.modules["module_key"].to_pylist()}


# ---------------------------------------------------------------------------------- the two steps


def assign_stack_ids(
    db: IngestDb, runs: list[PreparedRun], reading_whole: Callable[[Path], None] = lambda _run_dir: None
) -> StackIds:
    """The batch's stacks with their database ids (see the module docstring). A run prepared without
    its frames that brings in a stack after all (the run it was to come with was quarantined, or is
    not loaded) is read whole here (`reading_whole` is told its folder); RunUnreadable when that fails."""
    while True:
        flat, run_of_stack = concat_flat_runs([run.flat for run in runs])
        stack_ids, new_ids = _stack_ids(db, flat)
        new_order = np.flatnonzero(new_ids >= 0)
        new_order = new_order[np.argsort(new_ids[new_order], kind="stable")]
        lacking = [] if flat.has_frames else np.unique(run_of_stack[new_order]).tolist()
        lacking = [i for i in lacking if not runs[i].flat.has_frames]
        if not lacking:
            return StackIds(tuple(runs), flat, run_of_stack, stack_ids, new_ids, new_order)
        runs = list(runs)
        for i in lacking:
            reading_whole(runs[i].run_dir)
            try:
                runs[i] = read_whole(runs[i])
            except DamagedRunError as error:
                raise RunUnreadable(i, str(error)) from None


def _stack_ids(db: IngestDb, flat: FlatRun) -> tuple[np.ndarray, np.ndarray]:
    """Per flat stack: its database stack_id, and the id again where its run brings it in (else -1)."""
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


def lay_out(db: IngestDb, ids: StackIds, symbols: SymbolLoader, progress: RunProgress) -> LaidOutBatch:
    """The batch laid out (see the module docstring)."""
    new = _lay_out_new_stacks(db, ids, symbols, progress) if len(ids.new_order) else NewStacks()
    fields = {field.name: getattr(ids, field.name) for field in dataclasses.fields(StackIds)}
    counted = sites_for_counting(db, ids.stored_stack_ids(), new.stack_sites)
    return LaidOutBatch(**fields, new=new, counted_sites=counted)


def _lay_out_new_stacks(db: IngestDb, ids: StackIds, symbols: SymbolLoader, progress: RunProgress) -> NewStacks:
    slots, shapes = layout.combined_slots(
        stack_ids=ids.new_ids[ids.new_order],
        **ids.flat.frames(ids.new_order).slot_arguments(),
        modules=ids.flat.modules,
        code=ids.flat.code,
    )
    progress.describe(f"symbolizing the frames of {len(ids.new_order):,} new stacks")
    # Each symbol key's first slot: slots come by stack id, so that is the first run's use.
    first_uses = layout.distinct_native_slots(slots)
    known, new_symbols, statuses = symbols.symbols_for(slots, first_uses)
    slot_keys = pa.table(
        {
            "stack_id": pa.array(slots.stack_id[first_uses], pa.int64()),
            # Plain strings: joined with the plain keys of the new symbols.
            "module_key": slots.module_key.take(pa.array(first_uses)).cast(pa.string()),
            "address": pa.array(slots.address[first_uses], pa.uint64()),
            "exact": pa.array(slots.exact[first_uses], pa.bool_()),
        }
    )
    frames = layout.expand(slots, known)
    frame_first_run = np.full(frames.frames.num_rows, len(ids.runs), dtype=np.int64)
    np.minimum.at(
        frame_first_run, frames.rows["frame"].to_numpy(), ids.runs_of_new_stacks(frames.rows["stack_id"].to_numpy())
    )
    portable, new_files = _source_file_names(db, ids.runs, frames.frames, frame_first_run)
    sites = sites_of_laid_out(db, frames, ids.new_ids[ids.new_order], portable)
    # Site ids decided here for the batch, as stack and frame ids are: each transaction's site
    # counts can then be taken in memory.
    stack_sites, new_sites = number_sites(db, sites, ids.runs_of_new_stacks(sites["stack_id"].to_numpy()))
    return NewStacks(
        frames=frames,
        problems=shapes.problem,
        symbols=new_symbols,
        statuses=statuses,
        slot_keys=slot_keys,
        frame_ids=resolve_frames(db, frames.frames),
        frame_first_run=frame_first_run,
        stack_sites=stack_sites,
        new_sites=new_sites,
        new_files=new_files,
    )


def _source_file_names(
    db: IngestDb, runs: tuple[PreparedRun, ...], frames: pa.Table, frame_first_run: np.ndarray
) -> tuple[dict[str, str], dict[str, tuple[str, str | None, int]]]:
    """The portable name of every Python file of the new frames: the database's for files it knows,
    else relative to the import roots of the first run whose new stacks use the file; and those
    new names (portable, root, first run), for that run's transaction to insert."""
    python = pc.and_(pc.equal(frames["kind"], "python"), pc.is_valid(frames["file"]))
    # Each file once, with the first run whose new stacks use it (not a Python step per frame).
    first_run = (
        pa.table({"file": frames["file"].filter(python), "run": pa.array(frame_first_run).filter(python)})
        .group_by("file")
        .aggregate([("run", "min")])
    )
    wanted = first_run["file"].to_pylist()
    if not wanted:
        return {}, {}
    known = dict(
        query_rows(db.con, "SELECT file, portable_file FROM source_files WHERE list_contains(?, file)", [wanted])
    )
    roots_of: dict[int, list[str]] = {}
    new_files: dict[str, tuple[str, str | None, int]] = {}
    for file, run in zip(wanted, first_run["run_min"].to_pylist()):
        if file not in known:
            roots = roots_of.setdefault(run, import_roots(runs[run].manifest))
            new_files[file] = (*portable_file(file, roots), run)
    return {**known, **{f: named[0] for f, named in new_files.items()}}, new_files
