"""A run's GPU activity (raw `gpu_activity` and `gpu_graph_nodes` parts), loaded in the run's transaction
after its events.

Every activity record is joined to the event of the API call that caused it by the correlation id
that event carries in its `correlation_id` column (a kernel launch, a graph launch, a copy or a set). A kernel of a
replayed CUDA graph carries the graph launch's correlation id, and its graph node id: the node's clone
chain (`gpu_graph_nodes`: the executable graph's nodes are clones of the captured graph's) leads to
the node made while a launch was being captured, and that launch's correlation id to its event (the
capture site). Then the run's GPU time is counted per launch name, stack and capture stack
(`gpu_time_counts`), which the views and the regression report read.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_value
from tbpipe.pipeline.db.ingest.rows import event_name_ids
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.rawrun import read_tables
from tbpipe.schemas.raw import CORRELATED_KINDS

GPU_TABLES = ("gpu_activity", "gpu_graph_nodes")
# Event kinds that carry the correlation id of the CUDA API call they record.
LAUNCH_KINDS = CORRELATED_KINDS
# Longest clone chain followed from a replayed node back to the node a capture made.
MAX_CLONE_DEPTH = 64


def capture_correlations(nodes: pa.Table) -> pa.Table:
    """Per graph node id: the correlation id of the launch captured into the node it descends from
    (itself, or the node it was cloned from, and so on), where one was recorded."""
    if nodes.num_rows == 0:
        return pa.table(
            {"graph_node_id": pa.array([], pa.uint64()), "capture_correlation_id": pa.array([], pa.uint32())}
        )
    node = nodes["graph_node_id"].to_pylist()
    original = nodes["original_graph_node_id"].to_pylist()
    correlation = nodes["correlation_id"].to_pylist()
    made_by: dict[int, int] = {}  # node -> correlation of the launch that made it
    cloned_from: dict[int, int] = {}
    for n, o, c in zip(node, original, correlation):
        if o is not None:
            cloned_from[n] = o
        elif c is not None:
            made_by[n] = c
    out_nodes, out_correlations = [], []
    for start in set(node):
        current = start
        for _ in range(MAX_CLONE_DEPTH):
            if current in made_by:
                out_nodes.append(start)
                out_correlations.append(made_by[current])
                break
            if current not in cloned_from:
                break
            current = cloned_from[current]
    return pa.table(
        {
            "graph_node_id": pa.array(out_nodes, pa.uint64()),
            "capture_correlation_id": pa.array(out_correlations, pa.uint32()),
        }
    )


def activity_rows(paths: list[Path]) -> pa.Table:
    """The records of a run's `gpu_activity` parts, numbered from 1 in the order of the parts and of their
    rows, with each one's duration in nanoseconds: taken here, because the database keeps times to the
    microsecond, and the difference of two rounded times is off by up to a microsecond per kernel."""
    table = read_tables({"gpu_activity": list(paths)}, ("gpu_activity",))["gpu_activity"]
    start = pc.cast(table["gpu_start"], pa.int64())
    end = pc.cast(table["gpu_end"], pa.int64())
    duration = pc.subtract(end, start)
    duration = pc.if_else(pc.greater_equal(duration, 0), duration, pa.scalar(None, pa.int64()))
    return table.append_column("duration_ns", duration).append_column(
        "record", pa.array(np.arange(1, table.num_rows + 1), pa.int64())
    )


def insert_gpu_activity(db: IngestDb, run_number: int, files: dict[str, list[Path]]) -> int:
    """The run's `gpu_activity` rows and `gpu_time_counts`; returns the records loaded. The launch
    kinds' name ids and the activity ids come from what the ingest keeps, not from the tables: the
    transaction before this one may add both after this one began."""
    activity_files = files.get("gpu_activity") or []
    if not activity_files:
        return 0
    launch_names = [i for (kind, _name), i in event_name_ids(db).items() if kind in LAUNCH_KINDS]
    con = db.con
    nodes = read_tables({"gpu_graph_nodes": files.get("gpu_graph_nodes") or []}, ("gpu_graph_nodes",))
    captures = capture_correlations(nodes["gpu_graph_nodes"])
    records = activity_rows(activity_files)
    first = db.next_ids(
        "activity_id",
        records.num_rows,
        lambda: int(query_value(con, "SELECT coalesce(max(activity_id), 0) + 1 FROM gpu_activity")),
    )
    db.register("ingest_gpu_captures", captures)
    db.register("ingest_gpu_records", records)
    try:
        con.execute(
            f"""
            CREATE OR REPLACE TEMP TABLE ingest_gpu_launches AS
            SELECT e.correlation_id, min(e.event_id) AS event_id
            FROM event_rows e
            WHERE e.run_number = {int(run_number)} AND list_contains({[int(i) for i in launch_names]}, e.name_id)
              AND e.correlation_id IS NOT NULL
            GROUP BY e.correlation_id
            """
        )
        _insert_activity(con, run_number, first)
        _count_gpu_time(con, run_number)
        loaded = int(query_value(con, f"SELECT count(*) FROM gpu_activity WHERE run_number = {int(run_number)}"))
    finally:
        _drop_quietly(con, "ingest_gpu_launches")
        db.unregister("ingest_gpu_records")
        db.unregister("ingest_gpu_captures")
    return loaded


def _insert_activity(con, run_number: int, first: int) -> None:
    """The run's `gpu_activity` rows from `ingest_gpu_records`, each linked to its launch event (and
    a replayed graph node's to the launch that captured it), ids from `first` on."""
    # Records in the order of the run's parts, and of their rows within a part.
    con.execute(
        f"""
        INSERT INTO gpu_activity BY NAME
        SELECT
            {int(run_number)} AS run_number,
            {first} + a.record - 1 AS activity_id,
            a.kind, a.name, a.gpu_start, a.gpu_end, a.duration_ns,
            a.device, a.context, a.stream, a.correlation_id,
            l.event_id,
            a.graph_id, a.graph_node_id,
            cl.event_id AS capture_event_id,
            a.bytes, a.grid_x, a.grid_y, a.grid_z, a.block_x, a.block_y, a.block_z,
            a.registers_per_thread, a.static_shared_mem, a.dynamic_shared_mem
        FROM ingest_gpu_records a
        LEFT JOIN ingest_gpu_launches l ON l.correlation_id = a.correlation_id
        LEFT JOIN ingest_gpu_captures c ON c.graph_node_id = a.graph_node_id
        LEFT JOIN ingest_gpu_launches cl ON cl.correlation_id = c.capture_correlation_id
        """
    )


def _count_gpu_time(con, run_number: int) -> None:
    """The run's `gpu_time_counts`: executions and GPU time per launch name, stack and kind."""
    con.execute(
        f"""
        INSERT INTO gpu_time_counts BY NAME
        SELECT
            a.run_number, e.name_id, e.stack_id, ce.stack_id AS capture_stack_id, a.kind, a.name,
            count(*) AS executions,
            count(a.duration_ns) AS timed,
            coalesce(sum(a.duration_ns), 0)::BIGINT AS gpu_time_ns,
            coalesce(sum((a.duration_ns / 1000.0) ^ 2), 0) AS gpu_time_sq_us,
            min(a.duration_ns) AS min_ns,
            max(a.duration_ns) AS max_ns,
            sum(a.bytes)::UBIGINT AS bytes
        FROM gpu_activity a
        LEFT JOIN event_rows e ON e.event_id = a.event_id
        LEFT JOIN event_rows ce ON ce.event_id = a.capture_event_id
        WHERE a.run_number = {int(run_number)}
        GROUP BY a.run_number, e.name_id, e.stack_id, ce.stack_id, a.kind, a.name
        """
    )


def _drop_quietly(con, table: str) -> None:

    try:  # inside a failed transaction DuckDB refuses even this; the next run replaces the table
        con.execute(f"DROP TABLE IF EXISTS {table}")
    except duckdb.Error:
        pass


def delete_run(db: IngestDb, run_number: int) -> None:
    """Removes a run's GPU rows (before it is loaded again)."""
    for table in ("gpu_activity", "gpu_time_counts"):
        db.delete(f"DELETE FROM {table} WHERE run_number = ?", [run_number])
