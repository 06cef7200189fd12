"""A run's rows, inserted by column name inside its transaction: modules, stacks, frames, events, the run.

Events go straight from the run's Parquet parts into `events` (DuckDB reads them faster than a
detour through Arrow), their raw stack ids re-keyed to database stack ids with a join.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db.connection import query_value
from tbpipe.pipeline.db.ingest.frames import insert_frame_rows
from tbpipe.pipeline.db.ingest.symbols import upsert_module_statuses
from tbpipe.pipeline.db.ingest.tables import IngestDb, sql_text
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.stacks.flatten import FlatRun


@dataclass
class RunData:
    """One run, read and laid out, ready for its transaction."""

    run_dir: Path
    manifest: dict[str, Any]
    fingerprint: str
    event_files: list[tuple[Path, int]]  # events parts and their row counts, in order
    flat: FlatRun
    stack_ids: np.ndarray  # database stack id per distinct raw stack
    new_ids: np.ndarray  # database stack id where this run brings the stack in, else -1
    frames: layout.Frames | None
    problems: pa.Array | None  # per new stack (order of `new_order`)
    new_order: np.ndarray  # distinct raw stack indices of the new stacks, by stack id
    symbols: pa.Table | None  # new `symbols` rows
    statuses: pa.Table | None  # `modules` rows of the modules just symbolized
    notes: list[str]

    @property
    def events(self) -> int:
        return sum(rows for _path, rows in self.event_files)


def stack_map(flat: FlatRun, stack_ids: np.ndarray) -> pa.Table:
    """raw_id -> stack_id for every distinct raw stack of the run."""
    return pa.table({"raw_id": pa.array(flat.raw_ids, pa.uint64()), "stack_id": pa.array(stack_ids, pa.int64())})


def insert_modules(db: IngestDb, data: RunData, run_id: str) -> None:
    """`run_modules` rows of the run, and a `modules` row for every module the database lacks."""
    if data.statuses is not None and data.statuses.num_rows:
        upsert_module_statuses(db, data.statuses)
    db.insert(
        f"INSERT INTO run_modules BY NAME SELECT {sql_text(run_id)} AS run_id, module_index, module_key, path, "
        "load_bias, exec_ranges FROM {}",
        data.flat.modules,
    )
    # Every module a run loaded has a row, even one none of whose addresses needed symbols yet.
    db.con.execute(
        """
        INSERT INTO modules BY NAME
        SELECT module_key, any_value(path) AS path,
               CASE WHEN NOT starts_with(module_key, 'path:') AND NOT starts_with(module_key, 'invalid:')
                    THEN module_key END AS build_id
        FROM run_modules r
        WHERE run_id = ? AND NOT EXISTS (SELECT 1 FROM modules m WHERE m.module_key = r.module_key)
        GROUP BY module_key
        """,
        [run_id],
    )


def insert_stacks(db: IngestDb, data: RunData, run_id: str) -> None:
    """`stacks` rows of the stacks this run brings in, and their frames."""
    flat, order, frames = data.flat, data.new_order, data.frames
    ids = data.new_ids[order]
    counts = np.zeros(len(order), dtype=np.int64)
    symbolized_depth = np.full(len(order), -1, dtype=np.int32)
    position = np.searchsorted(ids, frames.stack_order)
    counts[position] = frames.per_stack_frames
    symbolized_depth[position] = frames.symbolized_depth
    stacks = pa.table(
        {
            "stack_id": pa.array(ids, pa.int64()),
            "stack_hash": pa.array(flat.hashes[order], pa.uint64()),
            "status": pa.array(flat.status[order], pa.uint32()),
            "native_frames": pa.array(flat.native_lengths[order], pa.int32()),
            "python_frames": pa.array(flat.python_lengths[order], pa.int32()),
            "frames": pa.array(counts, pa.int32()),
            "problem": data.problems,
            "symbolized_depth": pa.array(symbolized_depth, pa.int32(), mask=symbolized_depth < 0),
        }
    )
    db.insert(f"INSERT INTO stacks BY NAME SELECT *, {sql_text(run_id)} AS first_run_id FROM {{}}", stacks)
    insert_frame_rows(db, frames)


def insert_events(db: IngestDb, data: RunData, run_id: str, run_number: int) -> None:
    """The run's `event_names` the database lacks, `event_rows` straight from its Parquet parts, and
    its `event_counts`."""
    con = db.con
    if not data.event_files:
        return
    files = "[" + ", ".join(sql_text(str(path)) for path, _rows in data.event_files) + "]"
    con.execute(
        f"""
        INSERT INTO event_names BY NAME
        SELECT (SELECT coalesce(max(name_id), 0) FROM event_names) + row_number() OVER (ORDER BY kind, name)
                   AS name_id,
               kind, name
        FROM (SELECT DISTINCT kind, name FROM read_parquet({files})) e
        ANTI JOIN event_names n USING (kind, name)
        """
    )
    db.register("ingest_stack_map", stack_map(data.flat, data.stack_ids))
    try:
        first = int(query_value(con, "SELECT coalesce(max(event_id), 0) + 1 FROM event_rows"))
        # One statement per part: event ids follow the parts' order and their rows' order.
        for path, rows in data.event_files:
            con.execute(
                f"""
                INSERT INTO event_rows BY NAME
                SELECT {first} + e.file_row_number AS event_id, {int(run_number)} AS run_number, e.ts, e.thread_id,
                       n.name_id, m.stack_id, e.attrs
                FROM read_parquet({sql_text(str(path))}, file_row_number = true) e
                JOIN event_names n ON n.kind = e.kind AND n.name = e.name
                LEFT JOIN ingest_stack_map m ON m.raw_id = e.stack_id
                """
            )
            first += rows
        con.execute(
            """
            INSERT INTO event_counts BY NAME
            SELECT run_number, name_id, stack_id, count(*) AS events
            FROM event_rows
            WHERE run_number = ?
            GROUP BY run_number, name_id, stack_id
            """,
            [run_number],
        )
    finally:
        db.unregister("ingest_stack_map")


def insert_run(db: IngestDb, data: RunData, run_number: int, stacks: int) -> None:
    """The `runs` row, from the manifest and what the ingest counted."""
    m = data.manifest
    labels = m.get("labels") or {}
    threads = m.get("threads") or {}
    counters = m.get("counters") or {}
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
            "run_id": m["run_id"],
            "run_number": run_number,
            "parent_run_id": m.get("parent_run_id"),
            "started_at": m.get("started_at"),
            "ended_at": m.get("ended_at"),
            "complete": bool(m.get("complete")),
            "host": m.get("host"),
            "pid": m.get("pid"),
            "argv": list(m.get("argv") or []),
            "cwd": m.get("cwd"),
            "label_keys": list(labels.keys()),
            "label_values": list(labels.values()),
            "python_version": m.get("python_version"),
            "python_implementation": m.get("python_implementation"),
            "torch_version": m.get("torch_version"),
            "cuda_version": m.get("cuda_version"),
            "sys_path": m.get("sys_path"),
            "tbpipe_version": m.get("tbpipe_version"),
            "sources": list(m.get("sources") or []),
            "capture": json.dumps(m.get("capture") or {}),
            "thread_ids": [int(k) for k in threads.keys()],
            "thread_names": list(threads.values()),
            "events_recorded": counters.get("events_recorded"),
            "events_dropped": counters.get("events_dropped"),
            "events": data.events,
            "stacks": stacks,
            "new_stacks": len(data.new_order),
            "capture_errors": list(m.get("errors") or []),
            "ingest_notes": data.notes,
            "source_dir": str(data.run_dir.resolve()),
            "parts": data.fingerprint,
            "manifest": json.dumps(m),
        },
    )
