"""`tbpipe retain --lake DIR`: the lake's old runs rolled up as the database's are (`pipeline.db.retain`).

For each run the policy rolls up, its events are counted per kind/name, stack and thread (and its
backward events per forward op) by DuckDB over the lake, checked equal to its `event_counts`, and
written as its partitions of `rolled_up_counts`, `rolled_up_name_counts`, `rolled_up_threads` and
`rolled_up_forward_counts`.
Then `runs.rolled_up_at` marks it (the `runs` table written afresh and swapped in), and only then
are its partitions of `event_rows`, `gpu_activity`, `event_counts` and `site_counts` removed. The
views read each run from one side by that mark (sql/counts.sql), so a retain killed between two
steps leaves a lake that answers as before, and the next retain finishes it: runs marked but still
holding event partitions lose them, rolled-up partitions of runs not marked (a killed retain's, or
of a run ingested again) are written again or removed.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.retain import RetainError, RetainPolicy, RetainResult, RolledUpRun, runs_to_roll_up
from tbpipe.pipeline.lake import store
from tbpipe.schemas.lake import PARTITION, TABLES

# What a rolled-up run no longer has, and what it has instead.
EVENT_TABLES = ("event_rows", "gpu_activity", "event_counts", "site_counts")
ROLLED_TABLES = ("rolled_up_counts", "rolled_up_name_counts", "rolled_up_threads", "rolled_up_forward_counts")


def _numbers(values: Any) -> str:
    return ", ".join(str(int(v)) for v in values) or "NULL"


def _partitions(root: Path, table: str) -> dict[int, Path]:
    """{run_number: folder} of a partitioned table's runs."""
    folder = store.table_dir(root, table)
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        name, _, value = entry.name.partition("=")
        if entry.is_dir() and name == PARTITION and value.lstrip("-").isdigit():
            found[int(value)] = entry
    return found


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _event_partitions(root: Path, numbers: set[int]) -> list[Path]:
    return [path for table in EVENT_TABLES for number, path in _partitions(root, table).items() if number in numbers]


def _check_counts(con: Any, numbers: list[int]) -> None:
    differing = query_rows(
        con,
        f"""
        WITH mine AS (
            SELECT run_number, name_id, stack_id, count(*) AS events
            FROM event_rows WHERE run_number IN ({_numbers(numbers)}) GROUP BY ALL
        ), stored AS (
            SELECT run_number, name_id, stack_id, events FROM event_counts WHERE run_number IN ({_numbers(numbers)})
        )
        SELECT DISTINCT r.run_id
        FROM mine m FULL JOIN stored s
            ON s.run_number = m.run_number AND s.name_id = m.name_id AND s.stack_id IS NOT DISTINCT FROM m.stack_id
        JOIN runs r ON r.run_number = coalesce(m.run_number, s.run_number)
        WHERE m.events IS DISTINCT FROM s.events
        ORDER BY 1
        """,
    )
    if differing:
        ids = [row[0] for row in differing]
        raise RetainError(
            f"the events of {len(ids)} run{'s' if len(ids) != 1 else ''} of the lake ({', '.join(ids[:3])}"
            f"{', ...' if len(ids) > 3 else ''}) do not add up to their event counts: not rolled up, nothing changed"
        )


def _roll_up_queries(numbers: list[int], run_ids: list[str]) -> dict[str, str]:
    """SELECTs of the rolled-up tables' rows of these runs, in the lake's columns."""
    runs = _numbers(numbers)
    threads = f"""
        SELECT run_number, thread_id,
               (row_number() OVER (PARTITION BY run_number ORDER BY min(event_id), thread_id) - 1)::INTEGER AS thread
        FROM event_rows WHERE run_number IN ({runs}) GROUP BY run_number, thread_id
    """
    ids = ", ".join(store.sql_text(run_id) for run_id in run_ids) or "NULL"
    return {
        "rolled_up_counts": f"""
            WITH threads AS ({threads})
            SELECT e.stack_id, e.name_id, t.thread, e.run_number, count(*)::BIGINT AS events
            FROM event_rows e JOIN threads t USING (run_number, thread_id)
            WHERE e.run_number IN ({runs})
            GROUP BY ALL ORDER BY e.run_number, e.stack_id, e.name_id, t.thread
        """,
        "rolled_up_name_counts": f"""
            SELECT run_number, name_id, count(*)::BIGINT AS events
            FROM event_rows WHERE run_number IN ({runs}) GROUP BY ALL ORDER BY ALL
        """,
        "rolled_up_threads": f"SELECT run_number, thread, thread_id FROM ({threads}) ORDER BY ALL",
        "rolled_up_forward_counts": f"""
            SELECT r.run_number, n.name_id, b.stack_id, b.forward_stack_id, count(*)::BIGINT AS events
            FROM backward_forward_ops b
            JOIN runs r ON r.run_id = b.run_id
            JOIN event_names n ON n.kind = b.kind AND n.name = b.name
            WHERE b.run_id IN ({ids}) AND b.forward_stack_id IS NOT NULL
            GROUP BY ALL
        """,
    }


def _write_rolled(con: Any, root: Path, numbers: list[int], run_ids: list[str]) -> int:
    """Each run's partitions of the rolled-up tables, written and swapped in; returns their bytes."""
    written = 0
    staging = store.staging_dir(root)
    try:
        for table, query in _roll_up_queries(numbers, run_ids).items():
            columns = ", ".join(
                f"CAST({f.name} AS {store.duckdb_type(f.type)}) AS {f.name}" for f in TABLES[table].schema
            )
            target = staging / table
            target.mkdir()
            con.execute(
                f"COPY (SELECT {columns} FROM ({query})) TO {store.sql_text(str(target))} "
                f"(FORMAT parquet, COMPRESSION zstd, PARTITION_BY ({PARTITION}), FILENAME_PATTERN 'part-{{i}}')"
            )
            fresh = _partitions(staging, table)
            for number in numbers:
                if number in fresh:
                    written += _folder_bytes(fresh[number])
                    store.swap_in(fresh[number], store.partition_dir(root, table, number))
                else:  # none of this run (no backward work, no events): an old partition goes
                    shutil.rmtree(store.partition_dir(root, table, number), ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _mark(root: Path, run_ids: list[str], when: datetime) -> None:
    """The `runs` table written afresh with these runs' `rolled_up_at` set, swapped in whole."""
    schema = TABLES["runs"].schema
    files = store.data_files(store.table_dir(root, "runs"))
    table = pa.concat_tables([pq.read_table(path, schema=schema) for path in files]) if files else schema.empty_table()
    chosen = pc.is_in(table["run_id"], value_set=pa.array(run_ids, pa.string()))
    stamp = pa.scalar(when, schema.field("rolled_up_at").type)
    marked = pc.if_else(chosen, stamp, table["rolled_up_at"])
    table = table.set_column(schema.get_field_index("rolled_up_at"), "rolled_up_at", marked)
    staging = store.staging_dir(root)
    try:
        (staging / "runs").mkdir()
        pq.write_table(table, staging / "runs" / "part-0.parquet", compression="zstd")
        store.swap_in(staging / "runs", store.table_dir(root, "runs"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _leftovers(con: Any, root: Path, chosen: set[int]) -> tuple[list[Path], list[Path]]:
    """(event partitions of runs already marked, rolled-up partitions of runs neither marked nor chosen)."""
    marked = {row[0] for row in query_rows(con, "SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL")}
    stale_events = _event_partitions(root, marked)
    orphans = [
        path
        for table in ROLLED_TABLES
        for number, path in _partitions(root, table).items()
        if number not in marked and number not in chosen
    ]
    return stale_events, orphans


def retain_lake(
    lake: Path, policy: RetainPolicy, *, dry_run: bool = False, now: datetime | None = None
) -> RetainResult:
    """Rolls up the lake's runs that `policy` does not keep (dry: says which, and the bytes of the
    partitions that would go)."""
    root = Path(lake)
    when = now or datetime.now(timezone.utc)
    con = store.connect(root)
    try:
        chosen, kept, already = runs_to_roll_up(con, policy, now)
        numbers = [r.run_number for r in chosen]
        events = dict(
            query_rows(
                con,
                f"SELECT run_number, count(*) FROM event_rows WHERE run_number IN ({_numbers(numbers)}) GROUP BY ALL",
            )
        )
        gpu = dict(
            query_rows(
                con,
                f"SELECT run_number, count(*) FROM gpu_activity WHERE run_number IN ({_numbers(numbers)}) GROUP BY ALL",
            )
        )
        runs = [
            RolledUpRun(r.run_id, r.run_number, r.started_at, tuple(r.labels.get(k) for k in policy.by),
                        int(events.get(r.run_number, 0)), int(gpu.get(r.run_number, 0)))
            for r in chosen
        ]  # fmt: skip
        going = _event_partitions(root, set(numbers))
        stale, orphans = _leftovers(con, root, set(numbers))
        freed = sum(_folder_bytes(path) for path in [*going, *stale, *orphans])
        if dry_run:
            return RetainResult(root, policy, True, runs, kept, already, freed, len(orphans))
        if numbers:
            _check_counts(con, numbers)
            freed -= _write_rolled(con, root, numbers, [r.run_id for r in chosen])
    finally:
        con.close()
    if numbers:
        _mark(root, [r.run_id for r in chosen], when)
    for path in [*going, *stale, *orphans]:
        shutil.rmtree(path, ignore_errors=True)
    return RetainResult(root, policy, False, runs, kept, already, freed, len(orphans))
