"""`tbpipe lake export --db FILE --lake DIR`: a DuckDB database file written as a lake.

The database's sequential ids become the lake's content ids (`lake.ids`): runs, event names,
stacks, frames and sites are renumbered through maps computed here, and every table that refers
to them is written through those maps by DuckDB (`COPY ... TO` zstd Parquet, events partitioned
by run). Each table is written into a staging folder and swapped in, so an export into an existing
lake replaces the tables it writes: the lake then holds what the database holds.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db import open_database
from tbpipe.pipeline.db.connection import query_arrow, query_value
from tbpipe.pipeline.lake import ids, store
from tbpipe.pipeline.progress import StepProgress
from tbpipe.schemas.lake import PARTITION, TABLES


@dataclass
class ExportSummary:
    lake: Path
    rows: dict[str, int]
    seconds: float


def _cast(table: str, column: str, expression: str | None = None) -> str:
    type_ = store.duckdb_type(TABLES[table].schema.field(column).type)
    return f"CAST({expression or column} AS {type_}) AS {column}"


def _select(table: str, overrides: dict[str, str], source: str) -> str:
    """SELECT of every lake column of `table` from `source`, cast to the lake's types."""
    columns = [_cast(table, f.name, overrides.get(f.name)) for f in TABLES[table].schema]
    return f"SELECT {', '.join(columns)} FROM {source}"


def _maps(con: Any) -> dict[str, pa.Table]:
    """Old id -> lake id, per kind of id."""

    runs = query_arrow(con, "SELECT run_number AS old, run_id FROM runs")
    names = query_arrow(con, "SELECT name_id AS old, kind, name FROM event_names")
    stacks = query_arrow(con, "SELECT stack_id AS old, stack_hash FROM stacks")
    sites = query_arrow(con, "SELECT site_id AS old, site_key FROM sites")
    frames = query_arrow(con, "SELECT frame_id AS old, * EXCLUDE (frame_id, frame_hash) FROM frames")
    stack_hash = stacks["stack_hash"].combine_chunks().to_numpy(zero_copy_only=False)
    return {
        "map_runs": pa.table(
            {"old": runs["old"], "new": pa.array(ids.run_numbers(runs["run_id"].to_pylist()), pa.int64())}
        ),
        "map_names": pa.table(
            {
                "old": names["old"],
                "new": pa.array(ids.name_ids(names["kind"].to_pylist(), names["name"].to_pylist()), pa.int64()),
            }
        ),
        "map_stacks": pa.table(
            {"old": stacks["old"], "new": pa.array(ids.signed(stack_hash.astype(np.uint64)), pa.int64())}
        ),
        "map_sites": pa.table({"old": sites["old"], "new": ids.site_ids(sites["site_key"])}),
        "map_frames": pa.table({"old": frames["old"], "new": ids.frame_ids(frames)}),
    }


# Events (and GPU activity records) are numbered from 1 within their run, in recording order (the
# file numbers them across runs in the same order): an id minus its run's first, plus one.
_FIRST_EVENTS = "(SELECT run_number, min(event_id) AS first FROM event_rows GROUP BY ALL)"


_ROLLED = "WHERE t.run_number IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)"


def _in_run(column: str, first: str = "f.first") -> str:
    return f"t.{column} - {first} + 1"


def _queries() -> dict[str, str]:
    stack = "(SELECT new FROM map_stacks m WHERE m.old = t.stack_id)"
    run = "(SELECT new FROM map_runs m WHERE m.old = t.run_number)"
    name = "(SELECT new FROM map_names m WHERE m.old = t.name_id)"
    site = "(SELECT new FROM map_sites m WHERE m.old = t.site_id)"
    frame = "(SELECT new FROM map_frames m WHERE m.old = t.frame_id)"
    return {
        "runs": _select("runs", {"run_number": run}, "runs t"),
        "run_modules": _select("run_modules", {}, "run_modules t"),
        "modules": _select("modules", {}, "modules t"),
        "symbols": _select("symbols", {}, "symbols t"),
        "stacks": _select("stacks", {"stack_id": stack}, "stacks t"),
        "frames": _select("frames", {"frame_id": frame}, "frames t"),
        "stack_frame_rows": _select("stack_frame_rows", {"stack_id": stack, "frame_id": frame}, "stack_frame_rows t"),
        "event_names": _select("event_names", {"name_id": name}, "event_names t"),
        "event_rows": _select(
            "event_rows",
            {
                "event_id": _in_run("event_id"),
                "run_number": run,
                "name_id": name,
                "stack_id": stack,
                "attrs": "event_attrs(t.attrs, t.correlation_id)",  # the lake keeps the correlation id in them
            },
            f"event_rows t JOIN {_FIRST_EVENTS} f USING (run_number)",
        ),
        "gpu_activity": _select(
            "gpu_activity",
            {
                "run_number": run,
                "activity_id": _in_run("activity_id", "a.first"),
                "event_id": _in_run("event_id"),
                "capture_event_id": _in_run("capture_event_id"),
                "graph_node_id": "CAST(CAST(t.graph_node_id AS HUGEINT) - CASE WHEN t.graph_node_id >= 9223372036854775808 "
                "THEN 18446744073709551616 ELSE 0 END AS BIGINT)",
            },
            f"gpu_activity t LEFT JOIN {_FIRST_EVENTS} f USING (run_number) "
            "JOIN (SELECT run_number, min(activity_id) AS first FROM gpu_activity GROUP BY ALL) a USING (run_number)",
        ),
        "gpu_time_counts": _select(
            "gpu_time_counts",
            {
                "run_number": run,
                "name_id": name,
                "stack_id": stack,
                "capture_stack_id": "(SELECT new FROM map_stacks m WHERE m.old = t.capture_stack_id)",
            },
            "gpu_time_counts t",
        ),
        "event_counts": _select(
            "event_counts", {"run_number": run, "name_id": name, "stack_id": stack}, "event_counts t"
        ),
        "site_counts": _select("site_counts", {"run_number": run, "name_id": name, "site_id": site}, "site_counts t"),
        # Rolled-up runs' counts (`tbpipe retain`), of the runs rolled up (not of one ingested again since).
        "rolled_up_counts": _select(
            "rolled_up_counts", {"run_number": run, "name_id": name, "stack_id": stack}, f"rolled_up_counts t {_ROLLED}"
        ),
        "rolled_up_name_counts": _select(
            "rolled_up_name_counts", {"run_number": run, "name_id": name}, f"rolled_up_name_counts t {_ROLLED}"
        ),
        "rolled_up_threads": _select("rolled_up_threads", {"run_number": run}, f"rolled_up_threads t {_ROLLED}"),
        "rolled_up_forward_counts": _select(
            "rolled_up_forward_counts",
            {
                "run_number": run,
                "name_id": name,
                "stack_id": stack,
                "forward_stack_id": "(SELECT new FROM map_stacks m WHERE m.old = t.forward_stack_id)",
            },
            f"rolled_up_forward_counts t {_ROLLED}",
        ),
        "sites": _select("sites", {"site_id": site}, "sites t"),
        "stack_sites": _select("stack_sites", {"stack_id": stack, "site_id": site}, "stack_sites t"),
        "source_files": _select("source_files", {}, "source_files t"),
        "user_code": _select("user_code", {}, "user_code t"),
        "generated_code": _select("generated_code", {}, "generated_code t"),
    }


def export_database(db_path: Path, lake: Path, progress: bool | None = False) -> ExportSummary:
    """Writes every table of the database at `db_path` into the lake at `lake` (made if needed);
    `progress`: a bar over the tables on stderr (None: on a terminal, `progress.on_terminal`)."""

    started = time.monotonic()
    lake = Path(lake)
    store.create_lake(lake)
    con = open_database(db_path, read_only=True)
    queries = _queries()
    try:
        with StepProgress("lake export", 1 + len(queries), progress) as bar:
            bar.describe("content ids of runs, stacks, frames and sites")
            rows = _write_tables(con, lake, queries, bar)
    finally:
        con.close()
    return ExportSummary(lake, rows, time.monotonic() - started)


def _write_tables(con: Any, lake: Path, queries: dict[str, str], bar: StepProgress) -> dict[str, int]:
    """Every table of `queries` written into a staging folder, then all swapped into the lake; each
    table's row count."""

    for name, table in _maps(con).items():
        con.register(name, table)
    rows: dict[str, int] = {}
    staging = store.staging_dir(lake)
    try:
        for table, query in queries.items():
            bar.step(f"table {table}")
            target = staging / table
            target.mkdir()
            rows[table] = int(query_value(con, f"SELECT count(*) FROM ({query})") or 0)
            if TABLES[table].partitioned:
                con.execute(
                    f"COPY ({query}) TO {store.sql_text(str(target))} "
                    f"(FORMAT parquet, COMPRESSION zstd, PARTITION_BY ({PARTITION}), FILENAME_PATTERN 'part-{{i}}')"
                )
            elif rows[table]:
                con.execute(
                    f"COPY ({query}) TO {store.sql_text(str(target / 'part-0.parquet'))} "
                    "(FORMAT parquet, COMPRESSION zstd)"
                )
        for table in queries:
            store.swap_in(staging / table, store.table_dir(lake, table))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return rows
