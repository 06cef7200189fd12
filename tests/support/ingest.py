"""Helpers of the ingest tests (tests/test_ingest*.py): ingesting folders, reading rows back,
snapshots of a whole database, copies of a run, and small synthetic runs and nights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tbpipe.pipeline.db import IngestOptions, IngestSummary, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.rawrun import find_run_dirs


def ingest(db: Path, *dirs: Path, cache: Path, **options) -> IngestSummary:
    return ingest_runs(list(dirs), IngestOptions(db_path=db, cache_dir=cache, progress=False, wait_s=30, **options))


def rows(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return query_rows(con, sql, params)
    finally:
        con.close()


SNAPSHOT_TABLES = {
    "runs": "run_id, run_number, complete, events, stacks, new_stacks, parts, ingested_at",
    "modules": "module_key, path, quality, reason",
    "run_modules": "*",
    "symbols": "*",
    "stacks": "*",
    "stack_frames": "*",
    "events": "*",
    "event_names": "*",
    "event_counts": "*",
    "sites": "*",
    "stack_sites": "*",
    "user_code": "prefix, is_user, origin",
    "settings": "*",
}


def snapshot(db: Path, exclude_ingest_times: bool = False) -> dict[str, tuple]:
    """Row count and an order-independent hash of every table's contents."""
    out = {}
    for table, columns in SNAPSHOT_TABLES.items():
        if exclude_ingest_times:
            columns = columns.replace(", ingested_at", "")
        out[table] = rows(db, f"SELECT count(*), coalesce(sum(hash(t)), 0) FROM (SELECT {columns} FROM {table}) t")[0]
    return out


def _copy(good: Path, root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(good, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["run_id"] = f"20260101T000000-1-{name}"
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def _manifest(run_dir: Path, **changes) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(changes)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def _rewrite(part: Path, change) -> None:
    table = pq.read_table(part)
    pq.write_table(change(table), part)


def _run_ids(runs: Path) -> list[str]:
    return [json.loads((d / "manifest.json").read_text())["run_id"] for d in find_run_dirs([runs])]


def _words(text: str) -> str:
    """Text with every run of whitespace made one blank: rich wraps messages at the terminal width."""
    return " ".join(text.split())


def _ingested_alone(tmp_path: Path, runs: Path, cache: Path) -> Path:
    """The runs ingested one transaction per run, into a database of their own."""
    db = tmp_path / "alone.duckdb"
    ingest(db, runs, cache=cache, runs_per_transaction=1)
    return db


def _synthetic_night(runs: Path, count: int) -> None:
    """Runs that bring in new stacks, symbols, modules and event names of their own, and share others."""
    from support.synthetic import SyntheticConfig, generate

    generate(
        runs,
        SyntheticConfig(
            runs=count, events=1000 * count, unique_stacks=400, native_addresses=600, code_objects=120, max_modules=6
        ),
    )


def _synthetic_tables(native_extra: list | None = None) -> dict[str, pa.Table]:
    """A small raw run whose stacks exercise every interleaving case (see the test in tests/test_ingest.py)."""
    from support.synthetic import loaded_modules
    from tbpipe.schemas import raw

    libc = next(m for m in loaded_modules() if "libc.so" in m.path)
    lo, hi = libc.exec_ranges[0]
    a = [lo + (hi - lo) * k // 10 for k in range(1, 9)]
    fake = "00112233445566778899aabbccddeeff00112233"
    n = lambda module, address, flags=0: {"module": module, "offset": address, "flags": flags}  # noqa: E731
    p = lambda code, line, flags=0: {"code_id": code, "offset": 0, "line": line, "flags": flags}  # noqa: E731
    EVAL, MARK, EXACT, ENTRY = (
        raw.NATIVE_FRAME_EVAL_LOOP,
        raw.NATIVE_FRAME_MARKER,
        raw.NATIVE_FRAME_EXACT_PC,
        raw.PYTHON_FRAME_ENTRY,
    )
    stacks = [
        # 1: the walk stopped (marker) with one Python group unclaimed: it follows the marker.
        (
            1,
            1,
            [n(0, a[0], EXACT), n(0, a[1], EVAL), n(-1, 2, MARK)],
            [p(10, 5), p(11, 6, ENTRY), p(12, 7), p(13, 8, ENTRY)],
        ),
        # 2: a complete native walk without eval-loop frames: the Python stack alone, with a problem.
        (2, 0, [n(0, a[2], EXACT), n(0, a[3])], [p(10, 9), p(11, 10, ENTRY)]),
        # 3: no native frames asked for.
        (3, 4, [], [p(12, 11), p(13, 12, ENTRY)]),
        # 4: more eval-loop frames than Python groups: the extra ones stay native frames.
        (
            4,
            0,
            [n(0, a[4], EXACT), n(0, a[1], EVAL), n(0, a[5]), n(0, a[1], EVAL), n(0, a[6], EVAL)],
            [p(10, 13, ENTRY)],
        ),
        # 5: nothing at all.
        (5, 0, [], []),
        # 6: a module without any debug info anywhere (a build-ID nothing has).
        (6, 0, [n(1, 0x1234, EXACT), n(1, 0x5678), n(0, a[7])], []),
    ]
    stacks_table = pa.table(
        {
            "stack_id": pa.array([s[0] for s in stacks], pa.uint64()),
            "thread_id": pa.array([1] * len(stacks), pa.int64()),
            "status": pa.array([s[1] for s in stacks], pa.uint32()),
            "native": pa.array([s[2] for s in stacks], raw.stacks_schema().field("native").type),
            "python": pa.array([s[3] for s in stacks], raw.stacks_schema().field("python").type),
        }
    )
    modules = pa.table(
        {
            "module_index": pa.array([0, 1], pa.int32()),
            "path": pa.array([libc.path, "/nonexistent/libfake.so"]),
            "build_id": pa.array([libc.build_id, fake]),
            "load_bias": pa.array([0, 0], pa.uint64()),
            "exec_ranges": pa.array([[], []], raw.modules_schema().field("exec_ranges").type),
            "eval_ranges": pa.array([[], []], raw.modules_schema().field("eval_ranges").type),
        }
    )
    code = pa.table(
        {
            "code_id": pa.array([10, 11, 12, 13], pa.uint64()),
            "filename": ["/srv/app/a.py", "/srv/app/b.py", "/usr/lib/python3.11/threading.py", "/srv/app/c.py"],
            "qualname": ["inner", "middle", "Thread.run", "outer"],
            "first_line": pa.array([1, 1, 1, 1], pa.int32()),
        }
    )
    events = pa.table(
        {
            "ts": pa.array([1_700_000_000_000_000_000 + i for i in range(12)], pa.int64()).cast(
                pa.timestamp("ns", tz="UTC")
            ),
            "thread_id": pa.array([1] * 12, pa.int64()),
            "kind": ["kernel_launch"] * 12,
            "name": [f"k{i % 6 + 1}" for i in range(12)],
            "stack_id": pa.array([i % 6 + 1 for i in range(12)], pa.uint64()),
            "attrs": pa.array(['{"grid": 1}'] * 12),
        }
    )
    return {"events": events, "stacks": stacks_table, "modules": modules, "code": code}
