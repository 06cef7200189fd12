"""A run's rows, inserted by column name inside its transaction: modules, stacks, frames, events, the run.

Runs are laid out in batches (`Batch`: their new stacks, symbols and frames computed once), and each
run inserts its share (`RunPart`). Events go straight from the run's Parquet parts into `event_rows`
(DuckDB reads them faster than a detour through Arrow), their raw stack ids re-keyed to database
stack ids with a join.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_rows, query_value
from tbpipe.pipeline.db.ingest.frames import FrameIds, insert_frame_rows
from tbpipe.pipeline.db.ingest.symbols import upsert_module_statuses
from tbpipe.pipeline.db.ingest.tables import IngestDb, sql_text
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.stacks.flatten import FlatRun


@dataclass
class PreparedRun:
    """One run read, validated and flattened: what a batch is made of."""

    run_dir: Path
    manifest: dict[str, Any]
    fingerprint: str
    event_files: list[tuple[Path, int]]  # events parts and their row counts, in order
    flat: FlatRun
    notes: list[str]
    replace: bool  # the database holds an earlier, incomplete load of this run
    gpu_files: dict[str, list[Path]] = field(default_factory=dict)  # GPU activity parts, by table (ingest/gpu.py)
    run_number: int = 0  # set when the batch is loaded
    new_stacks: int = 0  # stacks this run brings into the database
    stacks_used: int = 0
    event_names: list[tuple[str, str]] = field(default_factory=list)  # distinct (kind, name), set with the batch

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def events(self) -> int:
        return sum(rows for _path, rows in self.event_files)


@dataclass
class Batch:
    """Runs laid out together, ready for one transaction."""

    runs: list[PreparedRun]
    flat: FlatRun  # the runs' flattened stacks, appended
    run_of_stack: np.ndarray  # index in `runs` of each flat stack's run
    stack_ids: np.ndarray  # database stack id per flat stack
    new_ids: np.ndarray  # database stack id where a run brings the stack in, else -1
    new_order: np.ndarray  # flat stack indices of the new stacks, by stack id
    frames: layout.Frames | None = None
    problems: pa.Array | None = None  # per new stack (order of `new_order`)
    symbols: pa.Table | None = None  # new `symbols` rows
    statuses: pa.Table | None = None  # `modules` rows of the modules just symbolized
    slot_keys: pa.Table | None = None  # stack_id, module_key, address, exact of the new stacks' native slots
    sites: pa.Table | None = None  # the new stacks' sites, shaped like `stack_sites_from`
    frame_ids: FrameIds | None = None  # database ids of the layout's frames
    frame_first_run: np.ndarray | None = None  # per layout frame: the first run whose new stacks use it
    # Python files of the new frames that the database does not name yet: (portable, root, first run index)
    new_files: dict[str, tuple[str, str | None, int]] = field(default_factory=dict)

    _symbol_runs: np.ndarray | None = None
    _row_runs: np.ndarray | None = None  # per layout row: the run that brings its stack in

    @property
    def event_files(self) -> list[tuple[int, Path, int]]:
        """(run index, part, rows) of every events part, runs and parts in order."""
        return [(i, path, rows) for i, run in enumerate(self.runs) for path, rows in run.event_files]

    def runs_of_new_stacks(self, stack_ids: np.ndarray) -> np.ndarray:
        """The index of the run that brings in each of the given new stacks."""
        new_sorted = self.new_ids[self.new_order]  # increasing
        return self.run_of_stack[self.new_order][np.searchsorted(new_sorted, stack_ids)]

    def part_of(self, index: int) -> RunPart:
        """What run `index` inserts of the batch's new things: the stacks it brings in, their frame
        rows and frames, and the new symbols (and module statuses) it is the first to need."""
        order = self.new_order[self.run_of_stack[self.new_order] == index]
        rows = frames = None
        if self.frames is not None and len(order):
            if self._row_runs is None:
                self._row_runs = self.runs_of_new_stacks(self.frames.rows["stack_id"].to_numpy())
            rows = np.flatnonzero(self._row_runs == index)
            frames = np.flatnonzero(self.frame_ids.new & (self.frame_first_run == index))
        symbols = statuses = None
        if self.symbols is not None and self.symbols.num_rows:
            mine = pa.array(self._first_runs_of_symbols() == index)
            symbols = self.symbols.filter(mine)
            if self.statuses is not None:
                keys = pa.array(sorted(set(symbols["module_key"].to_pylist())), pa.string())
                statuses = self.statuses.filter(pc.is_in(self.statuses["module_key"], value_set=keys))
        return RunPart(index, order, rows, frames, symbols, statuses)

    def _first_runs_of_symbols(self) -> np.ndarray:
        """Per new `symbols` row: the first run of the batch whose new stacks need its address."""
        if self._symbol_runs is None:
            slots = self.slot_keys
            used = pa.table(
                {
                    "module_key": slots["module_key"],
                    "address": slots["address"],
                    "exact": slots["exact"],
                    "run": pa.array(self.runs_of_new_stacks(slots["stack_id"].to_numpy()), pa.int64()),
                }
            )
            first = used.group_by(["module_key", "address", "exact"]).aggregate([("run", "min")])
            keyed = self.symbols.select(["module_key", "address", "exact"]).append_column(
                "row", pa.array(np.arange(self.symbols.num_rows), pa.int64())
            )
            joined = keyed.join(first, ["module_key", "address", "exact"], join_type="left outer")
            runs = np.zeros(self.symbols.num_rows, dtype=np.int64)
            runs[joined["row"].to_numpy()] = pc.fill_null(joined["run_min"], 0).to_numpy()
            self._symbol_runs = runs
        return self._symbol_runs


@dataclass
class RunPart:
    """One run's share of its batch's new rows."""

    index: int  # the run's index in the batch
    new_order: np.ndarray  # flat stack indices of the stacks it brings in, by stack id
    rows: np.ndarray | None  # rows of `Batch.frames.rows` of those stacks
    frames: np.ndarray | None  # rows of `Batch.frames.frames` to store: new frames this run uses first
    symbols: pa.Table | None  # new `symbols` rows it is the first to need
    statuses: pa.Table | None  # `modules` rows of the modules of those symbols


def stack_map(batch: Batch) -> pa.Table:
    """(run index, raw_id) -> stack_id for every distinct raw stack of the batch's runs."""
    return pa.table(
        {
            "run_index": pa.array(batch.run_of_stack, pa.int32()),
            "raw_id": pa.array(batch.flat.raw_ids, pa.uint64()),
            "stack_id": pa.array(batch.stack_ids, pa.int64()),
        }
    )


def event_files_table(batch: Batch, index: int | None = None, first_event_id: int = 0) -> pa.Table:
    """Each events part (of run `index`, else of every run) with its run index, run number and the
    event id of its first row (the parts numbered on from `first_event_id`)."""
    parts = [part for part in batch.event_files if index is None or part[0] == index]
    sizes = np.array([rows for _i, _path, rows in parts], dtype=np.int64)
    starts = first_event_id + np.cumsum(sizes) - sizes
    numbers = [run.run_number for run in batch.runs]
    return pa.table(
        {
            "filename": pa.array([str(path) for _i, path, _rows in parts], pa.string()),
            "run_index": pa.array([i for i, _path, _rows in parts], pa.int32()),
            "run_number": pa.array([numbers[i] for i, _path, _rows in parts], pa.int32()),
            "first_event_id": pa.array(starts, pa.int64()),
        }
    )


def file_list(files: list[tuple[int, Path, int]]) -> str:
    return "[" + ", ".join(sql_text(str(path)) for _i, path, _rows in files) + "]"


def insert_modules(db: IngestDb, run: PreparedRun, statuses: pa.Table | None) -> None:
    """`run_modules` rows of the run, and a `modules` row for every module the database lacks."""
    if statuses is not None and statuses.num_rows:
        upsert_module_statuses(db, statuses)
    db.insert(
        """
        INSERT INTO run_modules BY NAME
        SELECT ? AS run_id, module_index, module_key, path, load_bias, exec_ranges FROM {}
        """,
        run.flat.modules,
        [run.run_id],
    )
    # Every module a run loaded has a row, even one none of whose addresses needed symbols yet.
    known = db.keep("module_keys", lambda: {key for (key,) in query_rows(db.con, "SELECT module_key FROM modules")})
    keys = set(run.flat.modules["module_key"].to_pylist())
    if not keys <= known:
        db.insert(
            """
            INSERT INTO modules BY NAME
            SELECT module_key, any_value(path) AS path,
                   CASE WHEN NOT starts_with(module_key, 'path:') AND NOT starts_with(module_key, 'invalid:')
                        THEN module_key END AS build_id
            FROM {} ANTI JOIN modules USING (module_key)
            GROUP BY module_key
            """,
            run.flat.modules,
        )
        known.update(keys)


def insert_stacks(db: IngestDb, batch: Batch, part: RunPart) -> None:
    """`stacks` rows of the stacks a run brings in, and their frames."""
    flat, order, frames = batch.flat, part.new_order, batch.frames
    ids = batch.new_ids[order]
    counts = np.zeros(len(order), dtype=np.int64)
    symbolized_depth = np.full(len(order), -1, dtype=np.int32)
    # Stacks without frames (an empty stack) have no entry in the layout's per-stack arrays.
    position = np.minimum(np.searchsorted(frames.stack_order, ids), max(len(frames.stack_order) - 1, 0))
    laid_out = frames.stack_order[position] == ids if len(frames.stack_order) else np.zeros(len(ids), bool)
    counts[laid_out] = frames.per_stack_frames[position[laid_out]]
    symbolized_depth[laid_out] = frames.symbolized_depth[position[laid_out]]
    problems = batch.problems.take(pa.array(np.searchsorted(batch.new_ids[batch.new_order], ids)))
    stacks = pa.table(
        {
            "stack_id": pa.array(ids, pa.int64()),
            "stack_hash": pa.array(flat.hashes[order], pa.uint64()),
            "status": pa.array(flat.status[order], pa.uint32()),
            "native_frames": pa.array(flat.native_lengths[order], pa.int32()),
            "python_frames": pa.array(flat.python_lengths[order], pa.int32()),
            "frames": pa.array(counts, pa.int32()),
            "problem": problems,
            "symbolized_depth": pa.array(symbolized_depth, pa.int32(), mask=symbolized_depth < 0),
        }
    )
    run_id = batch.runs[part.index].run_id
    db.insert("INSERT INTO stacks BY NAME SELECT *, ? AS first_run_id FROM {}", stacks, [run_id])
    insert_frame_rows(db, frames, batch.frame_ids, part.rows, part.frames)


def insert_events(db: IngestDb, batch: Batch, index: int) -> None:
    """A run's `event_names` the database lacks (of those the batch's scan found), its `event_rows`
    straight from its Parquet parts (one statement), and its `event_counts`."""
    con = db.con
    run = batch.runs[index]
    parts = [(i, path, rows) for i, path, rows in batch.event_files if i == index]
    if not parts:
        return
    files = file_list(parts)
    # Names the database lacks get the next ids, in (kind, name) order.
    known = db.keep("event_names", lambda: set(query_rows(con, "SELECT kind, name FROM event_names")))
    fresh = [pair for pair in run.event_names if pair not in known]
    if fresh:
        db.insert(
            """
            INSERT INTO event_names BY NAME
            SELECT (SELECT coalesce(max(name_id), 0) FROM event_names) + row_number() OVER (ORDER BY kind, name)
                       AS name_id,
                   kind, name
            FROM {}
            """,
            pa.table({"kind": pa.array([k for k, _n in fresh], pa.string()), "name": [n for _k, n in fresh]}),
        )
        known.update(fresh)
    # Event ids follow the parts' order and their rows' order.
    first = db.next_ids(
        "event_id",
        sum(rows for _i, _path, rows in parts),
        lambda: int(query_value(con, "SELECT coalesce(max(event_id), 0) + 1 FROM event_rows")),
    )
    in_run = batch.run_of_stack == index
    db.register(
        "ingest_stack_map",
        pa.table(
            {
                "raw_id": pa.array(batch.flat.raw_ids[in_run], pa.uint64()),
                "stack_id": pa.array(batch.stack_ids[in_run], pa.int64()),
            }
        ),
    )
    files_table = event_files_table(batch, index, first)
    db.register("ingest_event_files", files_table)
    try:
        con.execute(
            f"""
            INSERT INTO event_rows BY NAME
            SELECT f.first_event_id + e.file_row_number AS event_id, f.run_number, e.ts, e.thread_id, n.name_id,
                   m.stack_id, e.attrs
            FROM read_parquet({files}, filename = true, file_row_number = true) e
            JOIN ingest_event_files f ON f.filename = e.filename
            JOIN event_names n ON n.kind = e.kind AND n.name = e.name
            LEFT JOIN ingest_stack_map m ON m.raw_id = e.stack_id
            """
        )
        con.execute(
            """
            INSERT INTO event_counts BY NAME
            SELECT run_number, name_id, stack_id, count(*) AS events
            FROM event_rows
            WHERE run_number = ?
            GROUP BY run_number, name_id, stack_id
            """,
            [run.run_number],
        )
    finally:
        db.unregister("ingest_event_files")
        db.unregister("ingest_stack_map")
    run.stacks_used = int(
        query_value(con, "SELECT count(DISTINCT stack_id) FROM event_counts WHERE run_number = ?", [run.run_number])
        or 0
    )


def manifest_columns(m: dict[str, Any]) -> dict[str, Any]:
    """The `runs` columns taken from a manifest as they are (the database's and the lake's runs alike)."""
    counters = m.get("counters") or {}
    return {
        "run_id": m["run_id"],
        "parent_run_id": m.get("parent_run_id"),
        "complete": bool(m.get("complete")),
        "host": m.get("host"),
        "pid": m.get("pid"),
        "argv": list(m.get("argv") or []),
        "cwd": m.get("cwd"),
        "python_version": m.get("python_version"),
        "python_implementation": m.get("python_implementation"),
        "torch_version": m.get("torch_version"),
        "cuda_version": m.get("cuda_version"),
        "sys_path": m.get("sys_path"),
        "tbpipe_version": m.get("tbpipe_version"),
        "sources": list(m.get("sources") or []),
        "capture": json.dumps(m.get("capture") or {}),
        "events_recorded": counters.get("events_recorded"),
        "events_dropped": counters.get("events_dropped"),
        "capture_errors": list(m.get("errors") or []),
        "manifest": json.dumps(m),
    }


def insert_run(db: IngestDb, run: PreparedRun) -> None:
    """The `runs` row, from the manifest and what the ingest counted."""
    m = run.manifest
    labels = m.get("labels") or {}
    threads = m.get("threads") or {}
    db.con.execute(
        """
        INSERT INTO runs BY NAME SELECT
            $run_id AS run_id,
            $run_number AS run_number,
            $parent_run_id AS parent_run_id,
            CAST($started_at AS TIMESTAMPTZ) AS started_at,
            CAST($ended_at AS TIMESTAMPTZ) AS ended_at,
            $complete AS complete,
            $host AS host,
            $pid AS pid,
            CAST($argv AS VARCHAR[]) AS argv,
            $cwd AS cwd,
            map(CAST($label_keys AS VARCHAR[]), CAST($label_values AS VARCHAR[])) AS labels,
            $python_version AS python_version,
            $python_implementation AS python_implementation,
            $torch_version AS torch_version,
            $cuda_version AS cuda_version,
            CAST($sys_path AS VARCHAR[]) AS sys_path,
            $tbpipe_version AS tbpipe_version,
            CAST($sources AS VARCHAR[]) AS sources,
            CAST($capture AS JSON) AS capture,
            map(CAST($thread_ids AS BIGINT[]), CAST($thread_names AS VARCHAR[])) AS threads,
            $events_recorded AS events_recorded,
            $events_dropped AS events_dropped,
            $events AS events,
            $stacks AS stacks,
            $new_stacks AS new_stacks,
            CAST($capture_errors AS VARCHAR[]) AS capture_errors,
            CAST($ingest_notes AS VARCHAR[]) AS ingest_notes,
            $source_dir AS source_dir,
            $parts AS parts,
            now() AS ingested_at,
            CAST($manifest AS JSON) AS manifest
        """,
        {
            "run_number": run.run_number,
            "started_at": m.get("started_at"),
            "ended_at": m.get("ended_at"),
            "label_keys": list(labels.keys()),
            "label_values": list(labels.values()),
            "thread_ids": [int(k) for k in threads.keys()],
            "thread_names": list(threads.values()),
            **manifest_columns(m),
            "events": run.events,
            "stacks": run.stacks_used,
            "new_stacks": run.new_stacks,
            "ingest_notes": run.notes,
            "source_dir": str(run.run_dir.resolve()),
            "parts": run.fingerprint,
        },
    )
