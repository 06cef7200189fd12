"""The ingest's first stage: run folders read, validated and hashed ahead of the loading, into
frozen `PreparedRun`s, handed over in order and cut into batches.

Per run (`RunReader.prepare`, on a reading thread): the manifest and every part checked (`rawrun`;
a damaged run becomes a quarantined `RunOutcome` and the others go on), skipped when the database
holds it already, its stacks flattened and hashed (`stacks.flatten`). A run all of whose stacks the
database holds, or that a run before it brings in (`StackClaims`), is read without their frames,
by the hashes its capture wrote (raw schema 4): most runs of a night.

Reading is Python, Arrow and zstd (which release the GIL) while loading mostly waits on DuckDB, so
`ReadAhead` runs several readers at a lower priority, at most a batch ahead of the loading.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tbpipe.pipeline.db.ingest.gpu import GPU_TABLES
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, RunOutcome
from tbpipe.pipeline.db.ingest.pending import LoadedRuns
from tbpipe.pipeline.db.ingest.tuning import IngestLimits, lower_thread_priority
from tbpipe.pipeline.rawrun import (
    DamagedRunError,
    VerifiedParts,
    dangling_events_note,
    events_part,
    manifest_or_recovered,
    part_files,
    parts_fingerprint,
    read_stack_keys,
    read_tables,
    reference_problems,
    verify_part,
)
from tbpipe.pipeline.stacks.flatten import FlatRun, differing_written_hashes, flatten_run, known_stacks_run

# The tables a run's stacks are read from (the stacks with their frames).
STACK_TABLES = ("stacks", "modules", "code", "code_origins")


@dataclass(frozen=True)
class PreparedRun:
    """One run read, validated and flattened: what a batch is made of."""

    run_dir: Path
    manifest: dict[str, Any]
    fingerprint: str  # of its parts, to tell an incomplete run that grew since it was loaded
    event_files: tuple[tuple[Path, int], ...]  # events parts and their row counts, in order
    flat: FlatRun
    notes: tuple[str, ...]
    replace: bool  # the database holds an earlier, incomplete load of this run
    gpu_files: dict[str, list[Path]]  # GPU activity parts, by table (ingest/gpu.py)
    gpu_rows: int  # the rows of those parts
    event_names: tuple[tuple[str, str], ...]  # distinct (kind, name) of its events, sorted
    events_without_stack: int  # events whose part says they took no stack
    # Events parts of raw schema 1 or 2, whose CUDA calls have their correlation id in `attrs` only.
    parts_without_correlation: frozenset[Path]
    # Events parts of raw schema 4 and older, without the op_* columns (ops' attributes in `attrs`).
    parts_without_op_columns: frozenset[Path]
    # Its stacks, modules, code and code_origins parts: read again when it was prepared without its
    # frames (`flat.has_frames` false) and must bring in a stack after all (`read_whole`).
    stack_files: dict[str, list[Path]]

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def events(self) -> int:
        return sum(rows for _path, rows in self.event_files)

    @property
    def rows(self) -> int:
        """The rows its transaction loads, by the tables that grow with the run: events and GPU activity."""
        return self.events + self.gpu_rows

    def notes_with(self, dangling_events: int) -> list[str]:
        """Its notes, with what loading its events found."""
        return [*self.notes, *([dangling_events_note(dangling_events)] if dangling_events else [])]


def read_whole(run: PreparedRun) -> PreparedRun:
    """The run, prepared without its stacks' frames, read again with them; its hashes must be the
    ones it was prepared with (DamagedRunError otherwise)."""
    flat = flatten_run(read_tables(run.stack_files, STACK_TABLES))
    if not (np.array_equal(flat.raw_ids, run.flat.raw_ids) and np.array_equal(flat.hashes, run.flat.hashes)):
        raise DamagedRunError(f"{run.run_dir}: its stacks changed while it was loaded")
    return dataclasses.replace(run, flat=flat)


class RunReader:
    """Prepares runs (`prepare`), telling the runs whose stacks are all stored by the hashes of the
    database's stacks and those claimed by runs read whole before them (in load order)."""

    def __init__(self, options: IngestOptions, loaded: LoadedRuns, stored_hashes: np.ndarray, run_dirs: list[Path]):
        self._options = options
        self._loaded = loaded
        self._stored_hashes = np.sort(np.asarray(stored_hashes, dtype=np.uint64))
        self._claims = StackClaims()
        self._positions = {run_dir: position for position, run_dir in enumerate(run_dirs)}

    def prepare(self, run_dir: Path) -> PreparedRun | RunOutcome:
        """A run read, validated and flattened; its outcome when it needs no loading or is damaged."""
        try:
            manifest, notes = manifest_or_recovered(run_dir, self._options.recover_manifests)
            files = part_files(run_dir, manifest)
            fingerprint = parts_fingerprint(run_dir, manifest, files)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", reason=str(error))
        run_id = manifest["run_id"]
        present = self._loaded.present(run_dir, run_id, fingerprint)
        if present is not None:
            return present
        try:
            return self._read(run_dir, manifest, fingerprint, files, notes)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", run_id=run_id, reason=str(error))

    def _read(
        self, run_dir: Path, manifest: dict[str, Any], fingerprint: str, files: dict[str, list[Path]], notes: list[str]
    ) -> PreparedRun:
        # Every GPU part checked here (DuckDB reads them without their page checksums).
        gpu_rows = sum(verify_part(path, table) for table in GPU_TABLES for path in files[table])
        verified: VerifiedParts = {}
        known = self._read_known_stacks(files, self._positions.get(run_dir, len(self._positions)), verified)
        self._options.hooks.run_read(run_dir, known is None)
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
        # Checked, their names read and their stackless events counted here, on the reading thread
        # (DuckDB reads them once more, to load them).
        events = [events_part(path) for path in files["events"]]
        return PreparedRun(
            run_dir=run_dir,
            manifest=manifest,
            fingerprint=fingerprint,
            event_files=tuple((path, part.rows) for path, part in zip(files["events"], events)),
            flat=flat,
            notes=tuple(notes),
            replace=manifest["run_id"] in self._loaded,
            gpu_files={table: list(files[table]) for table in GPU_TABLES},
            gpu_rows=gpu_rows,
            event_names=tuple(sorted(set().union(*(part.names for part in events)))),
            events_without_stack=sum(part.without_stack for part in events),
            parts_without_correlation=frozenset(
                p for p, part in zip(files["events"], events) if not part.correlation_column
            ),
            parts_without_op_columns=frozenset(p for p, part in zip(files["events"], events) if not part.op_columns),
            stack_files={table: files[table] for table in STACK_TABLES},
        )

    def _read_known_stacks(self, files: dict[str, list[Path]], position: int, verified: VerifiedParts):
        """The run's stacks without their frames (`read_stack_keys`) when every one of them is stored
        already or comes with a run loaded before it; else None, and the run is read whole (its
        stacks parts from the bytes left in `verified`)."""

        def all_stored(hashes: np.ndarray) -> bool:
            hashes = np.sort(hashes)  # searched in order: among the stored hashes, then the claims
            _at, stored = find_sorted(self._stored_hashes, hashes)
            return self._claims.claimed_before(hashes[~stored], position)

        return read_stack_keys(files, all_stored, verified)


def find_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `values` is in `keys` (sorted, distinct), and whether it is there at all (where
    it is not, its place is an index inside `keys`, never past its end)."""
    if not len(keys):
        return np.zeros(len(values), dtype=np.intp), np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return at, keys[at] == values


class StackClaims:
    """The stack hashes that runs read whole bring in, each with the position (in load order) of the
    first such run that holds it: the reading threads ask whether a run's stacks all come before it.
    Sorted arrays, searched a run at a time (a dictionary searched a hash at a time held the GIL
    while the other threads waited); new hashes go to a small array, merged into the big one now and
    then, so that a run costs about its own hashes, not the ingest's."""

    def __init__(self, merge_at: int = 1 << 14) -> None:
        # The small array is merged into the big one once it holds a quarter of the big one's
        # hashes, or `merge_at`.
        self._merge_at = merge_at
        self._lock = threading.Lock()
        empty = (np.empty(0, np.uint64), np.empty(0, np.int64))
        self._big, self._recent = empty, empty  # each (hashes sorted and distinct, positions)

    def claims(self) -> dict[int, int]:
        """Every hash claimed, with the position of the run that claims it."""
        with self._lock:
            pairs = (self._big, self._recent)
            return dict(
                zip(np.concatenate([k for k, _ in pairs]).tolist(), np.concatenate([p for _, p in pairs]).tolist())
            )

    def claimed_before(self, hashes: np.ndarray, position: int) -> bool:
        """Whether runs before `position` claim every one of `hashes`; else the run at `position`
        claims those that no run before it does (it is read whole, and the runs after it need not
        read these stacks' frames). Sorted `hashes` search fastest."""
        with self._lock:
            claims = np.full(len(hashes), position + 1, dtype=np.int64)  # unclaimed: as if after it
            claimed = np.zeros(len(hashes), dtype=bool)
            found_in = []
            for keys, positions in (self._big, self._recent):
                at, found = find_sorted(keys, hashes)
                claims[found] = positions[at[found]]
                claimed |= found
                found_in.append((positions, at, found))
            if (claims < position).all():
                return True
            for positions, at, found in found_in:  # claimed by runs after it: now by this one
                positions[at[found & (claims > position)]] = position
            self._add(np.unique(hashes[~claimed]), position)
            return False

    def _add(self, unclaimed: np.ndarray, position: int) -> None:
        keys, positions = self._recent
        at = np.searchsorted(keys, unclaimed)
        keys, positions = np.insert(keys, at, unclaimed), np.insert(positions, at, position)
        if len(keys) > max(len(self._big[0]) // 4, self._merge_at):
            merged = np.concatenate([self._big[0], keys])
            order = np.argsort(merged, kind="stable")
            self._big = (merged[order], np.concatenate([self._big[1], positions])[order])
            keys, positions = keys[:0], positions[:0]
        self._recent = (keys, positions)


class ReadAhead:
    """`prepare` over the run folders on reading threads, handed over in order, at most a batch
    ahead (`batch_runs` runs, `batch_events` events) of the runs taken: a prepared run holds its
    stacks in memory until then. Iterating yields (folder, prepared run or outcome); an error raised
    while preparing a run is raised at that run."""

    def __init__(self, prepare: Callable[[Path], PreparedRun | RunOutcome], run_dirs: list[Path], limits: IngestLimits):
        self._prepare = prepare
        self._run_dirs = list(run_dirs)
        self._limits = limits
        self._ready: dict[int, PreparedRun | RunOutcome | BaseException] = {}
        self._ready_events = 0
        self._claimed = 0  # runs handed to a reading thread
        self._taken = 0  # runs handed over
        self._stopped = False
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name="tbpipe-prepare", daemon=True)
            for _ in range(max(1, limits.read_threads))
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _events(result: object) -> int:
        return result.events if isinstance(result, PreparedRun) else 0

    def _may_claim(self) -> bool:
        return self._claimed - self._taken < self._limits.batch_runs and self._ready_events < self._limits.batch_events

    def _work(self) -> None:
        lower_thread_priority()
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


Batch = list[PreparedRun | RunOutcome]


def batches(
    ahead: ReadAhead, loaded: LoadedRuns, limits: IngestLimits, started: Callable[[Path], None]
) -> Iterator[Batch]:
    """The runs read ahead, in batches of at most `batch_runs` runs and `batch_events` events (a run
    past the second limit goes alone); a run that needs no loading (present, quarantined) comes as
    its outcome. `started` is told of each folder as it is taken."""
    batch: Batch = []
    events = runs = 0
    for run_dir, prepared in ahead:
        started(run_dir)
        prepared = still_to_load(prepared, loaded)
        if isinstance(prepared, PreparedRun):
            # A run id twice (one run copied to two folders): its twin is loaded first.
            twin = any(isinstance(item, PreparedRun) and item.run_id == prepared.run_id for item in batch)
            if runs and (twin or events + prepared.events > limits.batch_events):
                yield batch
                batch, events, runs = [], 0, 0
                prepared = still_to_load(prepared, loaded)
        if isinstance(prepared, PreparedRun):
            events += prepared.events
            runs += 1
        batch.append(prepared)
        if runs >= limits.batch_runs or events >= limits.batch_events:
            yield batch
            batch, events, runs = [], 0, 0
    if batch:
        yield batch


def still_to_load(prepared: PreparedRun | RunOutcome, loaded: LoadedRuns) -> PreparedRun | RunOutcome:
    """A run prepared ahead, checked again against what was loaded since (the same run id may
    come twice)."""
    if not isinstance(prepared, PreparedRun):
        return prepared
    present = loaded.present(prepared.run_dir, prepared.run_id, prepared.fingerprint)
    if present is not None:
        return present
    return dataclasses.replace(prepared, replace=prepared.run_id in loaded)
