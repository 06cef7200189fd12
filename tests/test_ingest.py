"""`tbpipe ingest`: real runs (captured here or in child processes) into real DuckDB files."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import TBPIPE
from support.runs import read_run, transaction_sizes

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, IngestSummary, ingest_runs, open_database
from tbpipe.pipeline.db import read as db_read
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.ingest import IngestHooks, IngestLimits
from tbpipe.pipeline.rawrun import find_run_dirs
from tbpipe.pipeline.stacks.render import symbolize_stacks


def ingest(db: Path, *dirs: Path, cache: Path, **options) -> IngestSummary:
    return ingest_runs(list(dirs), IngestOptions(db_path=db, cache_dir=cache, progress=False, wait_s=30, **options))


def rows(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return query_rows(con, sql, params)
    finally:
        con.close()


# ------------------------------------------------------------------------------ a workload at known lines

LINES: dict[str, int] = {}


def _here() -> int:
    return sys._getframe(1).f_lineno


def launch_gemm(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "gemm", grid=1); LINES["gemm"] = _here()  # noqa: E702  # fmt: skip


def launch_pair() -> None:
    capture.record("kernel_launch", "gemm", grid=2); LINES["pair_gemm"] = _here()  # noqa: E702  # fmt: skip
    capture.record("op", "aten::mm"); LINES["pair_mm"] = _here()  # noqa: E702  # fmt: skip


def _key(value: int) -> int:
    capture.record("kernel_launch", "sort_kernel"); LINES["sort"] = _here()  # noqa: E702  # fmt: skip
    return -value


def workload(library) -> None:
    launch_gemm(7)
    for _ in range(3):
        launch_pair()
    library.launch("softmax", 5); LINES["softmax"] = _here()  # noqa: E702  # fmt: skip
    sorted(range(4), key=_key)  # a C function calling back into Python


LIBRARY = """
from tbpipe.capture import record


def launch(name, count):
    for _ in range(count):
        record("kernel_launch", name)  # line 7
"""
LIBRARY_LINE = 7


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A module under a site-packages folder: not user code, so sites skip its frames."""
    site_packages = tmp_path_factory.mktemp("venv") / "site-packages"
    package = site_packages / "fakelib_tbpipe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch.py").write_text(LIBRARY)
    sys.path.insert(0, str(site_packages))
    try:
        yield importlib.import_module("fakelib_tbpipe.launch")
    finally:
        sys.path.remove(str(site_packages))
        sys.modules.pop("fakelib_tbpipe.launch", None)
        sys.modules.pop("fakelib_tbpipe", None)


@pytest.fixture(scope="module")
def workload_runs(tmp_path_factory, library) -> Path:
    out = tmp_path_factory.mktemp("workload") / "runs"
    with capture.session(out, labels={"suite": "workload"}):
        workload(library)
    return out


@pytest.fixture(scope="module")
def workload_db(tmp_path_factory, workload_runs, symbol_cache) -> Path:
    db = tmp_path_factory.mktemp("workload-db") / "tbpipe.duckdb"
    summary = ingest(db, workload_runs, cache=symbol_cache)
    assert summary.ok and summary.ingested == 1
    return db


def site_counts(db: Path) -> dict[tuple, int]:
    found = rows(db, "SELECT kind, name, site_function, site_file, site_line, events FROM call_sites")
    return {
        (kind, name, function.rsplit(".", 1)[-1] if function else None, file, line): events
        for kind, name, function, file, line, events in found
    }


def test_exact_event_counts_per_call_site(workload_db, library) -> None:
    here = __file__
    assert site_counts(workload_db) == {
        ("kernel_launch", "gemm", "launch_gemm", here, LINES["gemm"]): 7,
        ("kernel_launch", "gemm", "launch_pair", here, LINES["pair_gemm"]): 3,
        ("op", "aten::mm", "launch_pair", here, LINES["pair_mm"]): 3,
        # The library's own frames are skipped: the site is the user line that called it.
        ("kernel_launch", "softmax", "workload", here, LINES["softmax"]): 5,
        # Called back from C (sorted): the site is the callback, whose frame sits under `sorted`.
        ("kernel_launch", "sort_kernel", "_key", here, LINES["sort"]): 4,
    }
    (launches,) = rows(workload_db, "SELECT sum(events) FROM kernel_launch_sites")[0]
    assert launches == 7 + 3 + 5 + 4
    (kinds,) = rows(workload_db, "SELECT list(DISTINCT kind) FROM kernel_launch_sites")[0]
    assert kinds == ["kernel_launch"]


def test_site_keys_name_file_function_and_line_offset(workload_db) -> None:
    # A Python site's key: its file relative to the longest import root holding it, its function's
    # qualified name, and its line's offset from the function's first line. No absolute path, no
    # address, no database-local id.
    import hashlib

    here = os.path.abspath(__file__)
    roots = sorted({os.path.abspath(p or ".") for p in sys.path}, key=len, reverse=True)
    root = next(r for r in roots if here.startswith(r.rstrip("/") + "/"))
    portable = here[len(root.rstrip("/")) + 1 :]
    function, file, line, key, stored_portable = rows(
        workload_db,
        "SELECT site_function, site_file, site_line, site_key, site_portable_file FROM call_sites "
        "WHERE name = 'softmax'",
    )[0]
    assert (function, file, line) == ("workload", here, LINES["softmax"])
    assert stored_portable == portable
    offset = LINES["softmax"] - workload.__code__.co_firstlineno
    assert key == hashlib.md5(f"py\x1f{portable}\x1f{function}\x1f{offset}".encode()).hexdigest()[:16]
    keys = rows(workload_db, "SELECT DISTINCT site_key FROM call_sites WHERE site_key IS NOT NULL")
    assert keys and all(len(k) == 16 for (k,) in keys)


def test_sites_of_new_stacks_equal_the_sql_definition(workload_db, tmp_path) -> None:
    # The ingest sites new stacks from their frames in memory; `stack_sites_from` (SQL) is the
    # definition, used when every stack is sited again. Both must give every stack the same site.
    import shutil as _shutil

    from tbpipe.pipeline.db.ingest.siting import site_stacks
    from tbpipe.pipeline.db.ingest.tables import IngestDb

    copy = tmp_path / "copy.duckdb"
    _shutil.copy(workload_db, copy)
    query = (
        "SELECT s.stack_id, s.site_depth, s.site_kind, s.site_is_user, s.site_file, s.site_line, t.site_key, "
        "t.portable_file, t.line_offset FROM stack_sites s LEFT JOIN sites t USING (site_id) ORDER BY s.stack_id"
    )
    before = rows(copy, query)
    con = open_database(copy)
    try:
        con.execute("BEGIN TRANSACTION")
        site_stacks(IngestDb(con), from_stack=None)
        con.execute("COMMIT")
    finally:
        con.close()
    after = rows(copy, query)
    assert len(before) == rows(copy, "SELECT count(*) FROM stacks")[0][0] > 3
    assert before == after


def test_user_code_rule_changes_sites(workload_db, symbol_cache, library) -> None:
    here = __file__
    library_file = library.__file__
    # Saying the library is user code moves the softmax site into it, for stacks already stored.
    ingest(workload_db, cache=symbol_cache, user_code=["fakelib_tbpipe/"])
    counts = site_counts(workload_db)
    assert counts[("kernel_launch", "softmax", "launch", library_file, LIBRARY_LINE)] == 5
    # '!PREFIX' takes it back.
    ingest(workload_db, cache=symbol_cache, user_code=["!fakelib_tbpipe/"])
    counts = site_counts(workload_db)
    assert counts[("kernel_launch", "softmax", "workload", here, LINES["softmax"])] == 5
    rules = dict(rows(workload_db, "SELECT prefix, is_user FROM user_code WHERE origin = 'user'"))
    assert rules == {"fakelib_tbpipe/": False}
    # A rule changed by hand (another DuckDB client) is applied by the next ingest.
    import duckdb

    con = duckdb.connect(str(workload_db))
    con.execute("UPDATE user_code SET is_user = true WHERE prefix = 'fakelib_tbpipe/'")
    con.close()
    ingest(workload_db, cache=symbol_cache)
    assert site_counts(workload_db)[("kernel_launch", "softmax", "launch", library_file, LIBRARY_LINE)] == 5
    ingest(workload_db, cache=symbol_cache, user_code=["!fakelib_tbpipe/"])


def test_db_frames_match_the_in_process_reference(workload_db, workload_runs, symbol_cache) -> None:
    assert_frames_match_reference(workload_db, workload_runs, symbol_cache)


def assert_frames_match_reference(db: Path, runs: Path, cache: Path) -> int:
    """Every stack's frames in the database equal `pipeline.stacks.symbolize_stacks` of the raw run."""
    from tbpipe.pipeline.symbols import Symbolizer

    con = open_database(db, read_only=True)
    compared = 0
    try:
        with Symbolizer(cache_dir=cache, jobs=1, progress=False) as symbolizer:
            for run_dir in find_run_dirs([runs]):
                run = read_run(run_dir)
                reference = symbolize_stacks(
                    run.tables["stacks"], run.tables["modules"], run.tables["code"], symbolizer
                )
                raw_ids = run.tables["events"]["stack_id"].to_pylist()
                db_ids = [
                    r[0]
                    for r in query_rows(
                        con, "SELECT stack_id FROM events WHERE run_id = ? ORDER BY event_id", [run.run_id]
                    )
                ]
                to_db = {}
                for raw_id, db_id in zip(raw_ids, db_ids):
                    to_db.setdefault(raw_id, db_id)
                for raw_id, expected in zip(run.tables["stacks"]["stack_id"].to_pylist(), reference):
                    if raw_id not in to_db:
                        continue
                    got = db_read.stack_frames(con, to_db[raw_id])

                    def key(f):
                        return (f["kind"], f["name"], f["filename"], f["line"], bool(f.get("inlined")))

                    assert [key(f) for f in got] == [key(f) for f in expected]
                    compared += 1
    finally:
        con.close()
    assert compared
    return compared


def test_sites_without_user_frames_use_the_innermost_symbolized_frame(tmp_path, symbol_cache) -> None:
    out = tmp_path / "runs"
    with capture.session(out, native=False):
        # Only threading.py (standard library) is on this thread's Python stack.
        thread = threading.Thread(target=capture.record, args=("kernel_launch", "from_thread"))
        thread.start()
        thread.join()
    db = tmp_path / "t.duckdb"
    ingest(db, out, cache=symbol_cache)
    function, file, line, events = rows(
        db, "SELECT site_function, site_file, site_line, events FROM call_sites WHERE name = 'from_thread'"
    )[0]
    assert function.endswith("run") and file == threading.__file__ and events == 1
    (is_user,) = rows(db, "SELECT bool_or(site_is_user) FROM stack_sites")[0]
    assert is_user is False


# ------------------------------------------------------------------------------ idempotence, incomplete runs

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


def test_reingest_changes_nothing(workload_db, workload_runs, symbol_cache) -> None:
    before = snapshot(workload_db)
    summary = ingest(workload_db, workload_runs, cache=symbol_cache)
    assert (summary.ingested, summary.present, summary.events, summary.new_stacks) == (0, 1, 0, 0)
    assert snapshot(workload_db) == before


SIGKILLED = """
import os, signal, sys, time
from tbpipe import capture
session = capture.session(sys.argv[1], flush_interval_s=0.2).start()
def deep(n):
    if n:
        return deep(n - 1)
    for i in range(500):
        capture.record("kernel_launch", "before_kill", i=i)
deep(3)
time.sleep(1.0)  # several flushes
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkilled_capture_is_ingested_incomplete(tmp_path, symbol_cache) -> None:
    out = tmp_path / "runs"
    script = tmp_path / "killed.py"
    script.write_text(SIGKILLED)
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    db = tmp_path / "t.duckdb"
    summary = ingest(db, out, cache=symbol_cache)
    assert (summary.ingested, summary.incomplete, summary.events) == (1, 1, 500)
    complete, ended, events = rows(db, "SELECT complete, ended_at, events FROM runs")[0]
    assert (complete, ended, events) == (False, None, 500)
    assert rows(db, "SELECT count(*), count(stack_id) FROM events") == [(500, 500)]
    assert rows(db, "SELECT site_function, events FROM call_sites") == [("deep", 500)]

    # Ingesting it again changes nothing while its files stay the same ...
    assert ingest(db, out, cache=symbol_cache).present == 1
    # ... and once they change (here: the run is marked complete) it is loaded again, not twice.
    (run_dir,) = find_run_dirs([out])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["complete"] = True
    manifest["ended_at"] = manifest["updated_at"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    summary = ingest(db, out, cache=symbol_cache)
    assert [o.status for o in summary.outcomes] == ["updated"]
    assert rows(db, "SELECT complete, events FROM runs") == [(True, 500)]
    assert rows(db, "SELECT count(*), sum(events) FROM event_counts") == [(1, 500)]


def test_unflushed_stacks_of_a_killed_run_are_noted(tmp_path, symbol_cache) -> None:
    from support.synthetic import manifest_for, write_run

    run = _synthetic_tables()
    events = run["events"]
    orphan = events.slice(0, 1).set_column(4, "stack_id", pa.array([12345], pa.uint64()))
    run["events"] = pa.concat_tables([events, orphan])
    write_run(tmp_path / "runs" / "orphan", manifest_for("20260101T000000-1-orphan", complete=False), run)
    db = tmp_path / "t.duckdb"
    summary = ingest(db, tmp_path / "runs", cache=symbol_cache)
    (outcome,) = summary.outcomes
    assert outcome.status == "ingested" and not outcome.complete
    assert any("1 events refer to stacks the run does not hold" in note for note in outcome.notes)
    assert rows(db, "SELECT count(*), count(stack_id) FROM events") == [(events.num_rows + 1, events.num_rows)]


def test_a_run_killed_before_its_first_flush(tmp_path, symbol_cache) -> None:
    from support.synthetic import manifest_for, write_run

    write_run(tmp_path / "runs" / "empty", manifest_for("20260101T000000-1-empty", complete=False), {})
    db = tmp_path / "t.duckdb"
    summary = ingest(db, tmp_path / "runs", cache=symbol_cache)
    assert [(o.status, o.complete, o.events) for o in summary.outcomes] == [("ingested", False, 0)]
    assert rows(db, "SELECT complete, events, stacks FROM runs") == [(False, 0, 0)]


# ------------------------------------------------------------------------------ combined order edge cases


def _synthetic_tables(native_extra: list | None = None) -> dict[str, pa.Table]:
    """A small raw run whose stacks exercise every interleaving case (see test below)."""
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


def test_interleaving_edge_cases_match_the_reference(tmp_path, symbol_cache) -> None:
    from support.synthetic import manifest_for, write_run

    runs = tmp_path / "runs"
    write_run(runs / "edge", manifest_for("20260101T000000-1-edges"), _synthetic_tables())
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.new_stacks == 6
    assert assert_frames_match_reference(db, runs, symbol_cache) == 6
    problems = dict(rows(db, "SELECT s.stack_id, s.problem FROM stacks s"))
    texts = sorted(p for p in problems.values() if p)
    assert texts == [
        "2 Python frames had no eval-loop frame to match; showing the Python stack alone",
        "native walk stopped early; 2 outer Python frames follow it",
    ]
    # Unsymbolized frames are explained, grouped by reason, with the modules they are in.
    groups = {g.reason: g for g in summary.unsymbolized.values()}
    no_debug = next(g for reason, g in groups.items() if reason.startswith("no debug info for build-ID"))
    assert no_debug.frames == 2 and list(no_debug.modules) == ["00112233445566778899aabbccddeeff00112233"]
    quality, reason = rows(db, "SELECT quality, reason FROM modules WHERE path = '/nonexistent/libfake.so'")[0]
    assert quality == "none" and "no debug info for build-ID" in reason
    # The empty stack has no site; the one sited on a native frame is not a user site.
    assert rows(db, "SELECT count(*) FROM stack_sites WHERE site_id IS NULL") == [(1,)]


def test_equal_stacks_of_different_runs_are_stored_once(tmp_path, symbol_cache) -> None:
    from support.synthetic import SyntheticConfig, generate

    runs = tmp_path / "runs"
    generated = generate(
        runs,
        SyntheticConfig(runs=3, events=6000, unique_stacks=300, native_addresses=500, code_objects=100, max_modules=4),
    )
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.events == 6000
    # Each run numbers its modules, code objects and stacks its own way; equal content is one stack.
    assert summary.new_stacks == generated.stacks_used
    assert rows(db, "SELECT count(*), count(DISTINCT stack_hash) FROM stacks") == [(generated.stacks_used,) * 2]
    assert rows(db, "SELECT sum(events) FROM call_sites") == [(6000,)]
    assert assert_frames_match_reference(db, runs, symbol_cache) >= generated.stacks_used


# ------------------------------------------------------------------------------ damaged runs


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, library) -> Path:
    out = tmp_path_factory.mktemp("good") / "runs"
    with capture.session(out, labels={"suite": "good"}):
        workload(library)
    (run_dir,) = find_run_dirs([out])
    return run_dir


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


def _name_not_utf8(table: pa.Table) -> pa.Table:
    names = [name.encode() for name in table["name"].to_pylist()]
    names[0] += b"\xff"
    column = pa.array(names, pa.binary()).view(pa.string())
    return table.set_column(table.schema.get_field_index("name"), table.schema.field("name"), column)


def _counter(run_dir: Path, key: str, value) -> None:
    counters = json.loads((run_dir / "manifest.json").read_text())["counters"]
    assert key in counters
    _manifest(run_dir, counters={**counters, key: value})


def _drop_described(run_dir: Path, frames: str, field: str, table: str, key: str) -> None:
    """Rewrites `table`'s part without the row describing one module/code object that the stacks'
    `frames` refer to through `field`, so the run is otherwise whole."""
    stacks = pq.read_table(run_dir / "stacks-000001.parquet")
    used = set(pc.struct_field(pc.list_flatten(stacks[frames]), field).to_pylist()) - {-1}
    part = run_dir / f"{table}-000001.parquet"
    described = pq.read_table(part)
    victim = sorted(used & set(described[key].to_pylist()))[0]
    kept = described.filter(pc.not_equal(described[key], pa.scalar(victim, described.schema.field(key).type)))
    assert kept.num_rows == described.num_rows - 1
    pq.write_table(kept, part)


def _flip_a_bit_only_page_checksums_catch(part: Path, column: str) -> None:
    """Flips the first bit in `column`'s pages that pyarrow reads back silently as other values
    when it skips the page checksums, and refuses when it checks them: damage that only the
    checksums the capture writes can catch."""
    original = part.read_bytes()
    good = pq.read_table(part)
    chunk = pq.read_metadata(part).row_group(0).column(good.schema.get_field_index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    for position in range(start, chunk.data_page_offset + chunk.total_compressed_size):
        for bit in range(8):
            damaged = bytearray(original)
            damaged[position] ^= 1 << bit
            part.write_bytes(bytes(damaged))
            try:
                unchecked = pq.read_table(part, page_checksum_verification=False)
            except (OSError, pa.ArrowException):
                continue
            if unchecked.num_rows != good.num_rows or unchecked[column].equals(good[column]):
                continue
            if not unchecked.drop_columns([column]).equals(good.drop_columns([column])):
                continue
            try:
                pq.read_table(part, page_checksum_verification=True)
            except (OSError, pa.ArrowException):
                return  # caught by the checksums alone: keep this damage
    part.write_bytes(original)
    raise AssertionError(f"no bit of {part.name}:{column} is damage that only page checksums catch")


DAMAGE = {
    "truncated": (
        lambda d: (d / "events-000001.parquet").write_bytes((d / "events-000001.parquet").read_bytes()[:200]),
        "unreadable Parquet",
    ),
    "notjson": (lambda d: (d / "manifest.json").write_text("{not json"), "manifest is not JSON"),
    "version": (lambda d: _manifest(d, schema_version=99), "raw schema version 99"),
    "labels": (lambda d: _manifest(d, labels=["suite"]), "manifest field 'labels' is list"),
    "started": (lambda d: _manifest(d, started_at="yesterday"), "'started_at' is not an ISO-8601 time"),
    "runid": (lambda d: _manifest(d, run_id="../../etc"), "malformed run_id"),
    "missing": (
        lambda d: (d / "stacks-000001.parquet").unlink(),
        "files listed in the manifest are missing: stacks-000001.parquet",
    ),
    "othertable": (
        lambda d: shutil.copy(d / "stacks-000001.parquet", d / "events-000001.parquet"),
        "expected table 'events'",
    ),
    "columns": (
        lambda d: _rewrite(
            d / "events-000001.parquet",
            lambda t: t.drop_columns(["attrs"]).replace_schema_metadata(t.schema.metadata),
        ),
        "columns do not match the 'events' schema: no column 'attrs'",
    ),
    "dangling": (
        lambda d: _rewrite(d / "stacks-000001.parquet", lambda t: t.slice(0, 1)),
        "events refer to stacks the run does not hold",
    ),
    "attrs": (
        lambda d: _rewrite(
            d / "events-000001.parquet",
            lambda t: t.set_column(
                5, t.schema.field("attrs"), pa.array(["{broken"] * t.num_rows)
            ).replace_schema_metadata(t.schema.metadata),
        ),
        "attributes that are not JSON",
    ),
    # pyarrow reads a name that is not UTF-8 as it is; DuckDB refuses it. The run whose part holds
    # it must be the one quarantined, not the runs read beside it.
    "badname": (
        lambda d: _rewrite(d / "events-000001.parquet", _name_not_utf8),
        "events unreadable",
    ),
    "nomodule": (
        lambda d: _drop_described(d, "native", "module", "modules", "module_index"),
        "native frames refer to modules the run does not describe",
    ),
    "nocode": (
        lambda d: _drop_described(d, "python", "code_id", "code", "code_id"),
        "Python frames refer to code objects the run does not describe",
    ),
    "startnotz": (
        lambda d: _manifest(d, started_at="2026-01-01T00:00:00"),
        "manifest field 'started_at' has no time zone",
    ),
    "endnotz": (
        lambda d: _manifest(d, ended_at="2026-01-01T00:05:00.123456"),
        "manifest field 'ended_at' has no time zone",
    ),
    # bool is an int in Python: a count that is true/false is garbage all the same.
    "countbool": (
        lambda d: _counter(d, "events_recorded", True),
        "manifest counter 'events_recorded' is True, not a number",
    ),
    "countfalse": (
        lambda d: _counter(d, "events_dropped", False),
        "manifest counter 'events_dropped' is False, not a number",
    ),
    "counttext": (
        lambda d: _counter(d, "events_written", "12"),
        "manifest counter 'events_written' is '12', not a number",
    ),
    "pidbool": (lambda d: _manifest(d, pid=True), "manifest field 'pid' is True, not int"),
    "eventsbit": (
        lambda d: _flip_a_bit_only_page_checksums_catch(d / "events-000001.parquet", "ts"),
        "events-000001.parquet: unreadable Parquet",
    ),
    "stacksbit": (
        lambda d: _flip_a_bit_only_page_checksums_catch(d / "stacks-000001.parquet", "thread_id"),
        "stacks-000001.parquet: unreadable Parquet",
    ),
    "codebit": (
        lambda d: _flip_a_bit_only_page_checksums_catch(d / "code-000001.parquet", "first_line"),
        "code-000001.parquet: unreadable Parquet",
    ),
}


def test_damaged_runs_are_quarantined_and_good_ones_go_in(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    good = [_copy(good_run, runs, "good1"), _copy(good_run, runs, "good2")]
    damaged = {}
    for name, (damage, _reason) in DAMAGE.items():
        damaged[name] = _copy(good_run, runs, name)
        damage(damaged[name])
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    reasons = {o.path.name: o.reason for o in summary.quarantined}
    let_in = sorted(set(DAMAGE) - set(reasons))
    assert not let_in, f"damaged runs that were not quarantined: {let_in}"
    assert sorted(reasons) == sorted(DAMAGE)
    wrong = {
        name: reasons[name]
        for name, (_damage, expected) in DAMAGE.items()
        if str(damaged[name]) not in reasons[name] or expected not in reasons[name]
    }
    assert not wrong, f"quarantined for another reason than their damage: {wrong}"
    assert summary.ingested == 2
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted(
        json.loads((g / "manifest.json").read_text())["run_id"] for g in good
    )
    # Nothing of the quarantined runs got in: two copies of one workload, events and all.
    assert rows(db, "SELECT count(*) FROM events") == [(2 * read_run(good_run).tables["events"].num_rows,)]
    # The runs are laid out in one batch: stacks a quarantined run would have brought in (the
    # damaged copies sort before the good ones) were brought in by the good runs instead.
    assert rows(
        db, "SELECT count(*) FROM events e ANTI JOIN stacks s USING (stack_id) WHERE e.stack_id IS NOT NULL"
    ) == [(0,)]
    assert rows(db, "SELECT count(*) FROM stacks s ANTI JOIN stack_sites USING (stack_id)") == [(0,)]
    assert rows(db, "SELECT count(DISTINCT first_run_id) FROM stacks") == [(1,)]
    # What the ingest keeps between runs (next run number and event id, module keys stored) was
    # forgotten with each rolled-back run: "attrs" failed inside its transaction before the good runs.
    assert rows(db, "SELECT list(run_number ORDER BY run_number) FROM runs") == [([1, 2],)]
    assert rows(db, "SELECT min(event_id), max(event_id) = count(*) FROM event_rows") == [(1, True)]
    assert rows(db, "SELECT count(*) FROM run_modules ANTI JOIN modules USING (module_key)") == [(0,)]
    assert rows(db, "SELECT count(*) FROM run_modules") != [(0,)]


def test_cli_exit_status_and_messages_for_quarantined_runs(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    _copy(good_run, runs, "fine")
    broken = _copy(good_run, runs, "broken")
    (broken / "manifest.json").write_text("[]")
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="200")
    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(tmp_path / "t.duckdb")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"quarantined {broken}/manifest.json: not a tbpipe-raw manifest" in result.stdout
    assert "runs ingested" in result.stdout and "quarantined" in result.stdout
    result = subprocess.run(
        [*TBPIPE, "ingest", str(tmp_path / "nowhere"), "--db", str(tmp_path / "t.duckdb")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2 and "no such folder" in result.stderr and "Traceback" not in result.stderr


def test_a_run_without_its_manifest_is_reported_and_can_be_recovered(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    _copy(good_run, runs, "fine")
    lost = _copy(good_run, runs, "lost")
    manifest = json.loads((lost / "manifest.json").read_text())
    (lost / "manifest.json").unlink()
    before = sorted(p.name for p in lost.iterdir())
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="300")
    db = tmp_path / "t.duckdb"
    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(db)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 1, result.stderr
    assert f"quarantined {lost}/manifest.json: manifest is missing" in result.stdout
    assert "--recover-manifests" in result.stdout
    fine_id = json.loads((runs / "fine" / "manifest.json").read_text())["run_id"]
    assert [r[0] for r in rows(db, "SELECT run_id FROM runs")] == [fine_id]

    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(db), "--recover-manifests"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ((run_id, complete, labels, events, notes),) = rows(
        db, "SELECT run_id, complete, labels, events, ingest_notes FROM runs WHERE run_id = 'lost'"
    )
    assert (complete, labels) == (False, {})
    assert events == manifest["counters"]["events_written"] > 0
    assert any("manifest.json was missing" in note for note in notes)
    # Counted per site like the run it was copied from; the folder itself is left as found.
    per_site = "SELECT site_key, name, events FROM call_sites WHERE run_id = ? ORDER BY ALL"
    assert rows(db, per_site, ["lost"]) == rows(db, per_site, [fine_id])
    assert sorted(p.name for p in lost.iterdir()) == before


# ------------------------------------------------------------------------------ killed and concurrent ingests

PAUSING_INGEST = """
import sys, time
from pathlib import Path
import tbpipe.pipeline.db.ingest as ingest_module


def before_commit(run_id):
    if run_id == victim:
        Path(marker).write_text("inside the transaction")
        deadline = time.monotonic() + 300
        while not Path(release).exists():
            if time.monotonic() > deadline:
                sys.exit("never released")
            time.sleep(0.02)


# Guarded: with a cold symbol store the symbolizer starts a forkserver pool, which imports this
# script again as __mp_main__.
if __name__ == "__main__":
    runs, db, cache, victim, marker, release, per_transaction = sys.argv[1:8]
    options = ingest_module.IngestOptions(
        db_path=Path(db),
        cache_dir=Path(cache),
        progress=False,
        runs_per_transaction=int(per_transaction),
        hooks=ingest_module.IngestHooks(before_commit=before_commit),
    )
    summary = ingest_module.ingest_runs([Path(runs)], options)
    print("ingested", summary.ingested)
"""


class PausingIngest:
    """An ingest in a child process that stops inside the victim run's transaction, holding the
    database, until `release()` (or until it is killed)."""

    def __init__(self, tmp_path: Path, runs: Path, db: Path, cache: Path, victim: str, runs_per_transaction: int = 1):
        script = tmp_path / "pausing_ingest.py"
        script.write_text(PAUSING_INGEST)
        marker = tmp_path / f"marker-{victim}"
        self.release_file = tmp_path / f"release-{victim}"
        self.process = subprocess.Popen(
            [
                *(sys.executable, str(script), str(runs), str(db), str(cache), victim),
                *(str(marker), str(self.release_file), str(runs_per_transaction)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 240
        while not marker.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"ingest ended early: {self.process.communicate()}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"ingest never reached the victim run's commit: {self.process.communicate()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.process.pid

    def release(self) -> tuple[str, str]:
        """Lets the ingest commit and finish; its (stdout, stderr)."""
        self.release_file.write_text("go on")
        return self.process.communicate(timeout=240)


def _run_ids(runs: Path) -> list[str]:
    return [json.loads((d / "manifest.json").read_text())["run_id"] for d in find_run_dirs([runs])]


def _words(text: str) -> str:
    """Text with every run of whitespace made one blank: rich wraps messages at the terminal width."""
    return " ".join(text.split())


def test_killed_ingest_leaves_the_database_as_before(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    first = _copy(good_run, runs, "a-first")
    _copy(good_run, runs, "b-second")
    first_id, second_id = _run_ids(runs)
    # The same first run alone, ingested into another database: what the killed one must equal.
    reference = tmp_path / "reference.duckdb"
    ingest(reference, first, cache=symbol_cache)

    db = tmp_path / "t.duckdb"
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, second_id)
    holder.process.send_signal(signal.SIGKILL)  # in the middle of the second run's transaction
    holder.process.communicate(timeout=30)
    assert rows(db, "SELECT run_id FROM runs") == [(first_id,)]
    assert snapshot(db, exclude_ingest_times=True) == snapshot(reference, exclude_ingest_times=True)
    # The lock died with the process, and the next ingest finishes the job.
    summary = ingest(db, runs, cache=symbol_cache)
    assert (summary.ingested, summary.present) == (1, 1)
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted([first_id, second_id])


def test_killed_ingest_loses_only_the_transaction_in_progress(tmp_path, good_run, symbol_cache) -> None:
    """Runs sharing a transaction go in together or not at all: a kill inside it loses them all
    (and nothing else), and the next ingest loads them."""
    runs = tmp_path / "runs"
    for name in ("a", "b", "c"):
        _copy(good_run, runs, name)
    first_id, second_id, third_id = _run_ids(runs)
    # The symbol store warmed first: a symbolizer pool started by the killed ingest would outlive it.
    ingest(tmp_path / "warm.duckdb", runs / "a", cache=symbol_cache)
    db = tmp_path / "t.duckdb"
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, third_id, runs_per_transaction=2)
    holder.process.send_signal(signal.SIGKILL)  # inside the second transaction: the third run alone
    holder.process.communicate(timeout=30)
    assert sorted(rows(db, "SELECT run_id FROM runs")) == sorted([(first_id,), (second_id,)])
    assert rows(db, "SELECT count(*) FROM event_rows WHERE run_number > 2") == [(0,)]
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=2)
    assert (summary.ingested, summary.present) == (1, 2)
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)


def test_killed_ingest_loses_the_run_loading_beside_the_one_in_progress(tmp_path, good_run, symbol_cache) -> None:
    """Killed while a run's transaction commits, with the next run's events already loading on the
    other connection: both runs are lost, the one before stays, and the next ingest loads the two."""
    runs = tmp_path / "runs"
    for name in ("a", "b", "c"):
        _copy(good_run, runs, name)
    first_id, second_id, _third_id = _run_ids(runs)
    ingest(tmp_path / "warm.duckdb", runs / "a", cache=symbol_cache)  # (see above)
    db = tmp_path / "t.duckdb"
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, second_id, runs_per_transaction=1)
    holder.process.send_signal(signal.SIGKILL)
    holder.process.communicate(timeout=30)
    assert rows(db, "SELECT run_id FROM runs") == [(first_id,)]
    assert rows(db, "SELECT count(*) FROM event_rows WHERE run_number > 1") == [(0,)]
    summary = ingest(db, runs, cache=symbol_cache)
    assert (summary.ingested, summary.present) == (2, 1)
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)


def _ingested_alone(tmp_path: Path, runs: Path, cache: Path) -> Path:
    """The runs ingested one transaction per run, into a database of their own."""
    db = tmp_path / "alone.duckdb"
    ingest(db, runs, cache=cache, runs_per_transaction=1)
    return db


def test_small_runs_share_a_transaction_up_to_its_events_and_a_big_run_goes_alone() -> None:
    """By default consecutive runs share a transaction while they load at most `rows_per_transaction`
    rows together; a run at or past it (or past what is left) starts one of its own, and runs
    without rows add none. `runs_per_transaction` overrides that with a count."""
    from tbpipe.pipeline.db.ingest.load import transaction_end
    from tbpipe.pipeline.db.ingest.tuning import IngestLimits

    def groups(events: list[int], per_transaction: int | None = None) -> list[int]:
        sizes, first = [], 0
        while first < len(events):
            end = transaction_end(events, first, budget, per_transaction)
            assert end > first
            sizes.append(end - first)
            first = end
        return sizes

    budget = IngestLimits().rows_per_transaction
    small = budget // 25
    assert groups([small] * 60) == [25, 25, 10]
    assert groups([small, budget, small, small]) == [1, 1, 2]
    assert groups([small, budget - small, 1, 0, 0]) == [2, 3]
    assert groups([budget * 4, small, small]) == [1, 2]
    assert groups([0] * 70) == [70]
    assert groups([small] * 7, 3) == [3, 3, 1]
    assert groups([budget * 4] * 3, 2) == [2, 1]
    assert groups([small] * 4, 1) == [1, 1, 1, 1]
    # The CLI's help (which does not import the ingest) says the same budget.
    shown = subprocess.run(
        [*TBPIPE, "ingest", "--help"], capture_output=True, text=True, env=dict(os.environ, COLUMNS="200")
    )
    assert f"share one up to {budget // 1000}k rows" in _words(shown.stdout.replace("│", " "))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_THP_DISABLE is Linux's")
def test_ingest_runs_without_transparent_huge_pages_and_restores_the_setting(tmp_path, symbol_cache) -> None:
    """While runs load, the process has transparent huge pages off (the kernel would zero a fresh
    2 MB page for each buffer the ingest makes and drops); after it, the setting is as it was."""
    import ctypes

    prctl = ctypes.CDLL(None).prctl
    get_thp_disable, set_thp_disable = 42, 41

    def thp_disabled() -> int:
        return prctl(get_thp_disable, 0, 0, 0, 0)

    seen = []
    hooks = IngestHooks(laying_out=lambda _run_ids: seen.append(thp_disabled()))
    runs = tmp_path / "runs"
    _synthetic_night(runs, 2)
    initial = thp_disabled()
    try:
        for before in (0, 1):  # a process that had them off keeps them off
            prctl(set_thp_disable, before, 0, 0, 0)
            seen.clear()
            assert ingest(tmp_path / f"{before}.duckdb", runs, cache=symbol_cache, hooks=hooks).ingested == 2
            assert seen == [1] and thp_disabled() == before
    finally:
        prctl(set_thp_disable, initial, 0, 0, 0)


@pytest.mark.parametrize("merge_at", [4, 1 << 14])
def test_stack_claims_answer_as_a_claim_per_hash_would(merge_at) -> None:
    """Which run first claims each stack hash, asked by runs prepared out of order: the sorted arrays
    answer every question as a dictionary of hash -> first claiming run does (with and without
    merges of the small array into the big one), and end holding the same claims."""
    from tbpipe.pipeline.db.ingest.read_ahead import StackClaims

    rng = np.random.default_rng(7)
    for pool_size in (40, 3000):
        pool = rng.integers(0, 2**64, pool_size, dtype=np.uint64)
        positions = np.arange(300)
        swapped = np.flatnonzero(rng.random(150) < 0.5) * 2  # neighbours prepared in either order
        positions[swapped], positions[swapped + 1] = positions[swapped + 1], positions[swapped]
        expected: dict[int, int] = {}
        claims = StackClaims(merge_at=merge_at)
        answers = []
        for position in positions.tolist():
            hashes = rng.choice(pool, int(rng.integers(1, 200)))
            before = all(expected.get(h, position) < position for h in hashes.tolist())
            if not before:
                for h in hashes.tolist():
                    if expected.get(h, position + 1) > position:
                        expected[h] = position
            answers.append(before)
            assert claims.claimed_before(hashes, position) == before, position
        assert any(answers) and not all(answers)
        assert claims.claims() == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_runs_are_read_ahead_at_a_lower_priority_than_the_loading_thread(tmp_path, symbol_cache) -> None:
    """The threads that read runs ahead run READ_NICE above the loading thread's nice value (it is
    the critical path), and the loading thread's own is left as it was."""
    from tbpipe.pipeline.db.ingest.tuning import READ_NICE

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    readers, loaders = [], []
    hooks = IngestHooks(
        run_read=lambda _run_dir, _whole: readers.append(nice()), laying_out=lambda _ids: loaders.append(nice())
    )
    runs = tmp_path / "runs"
    _synthetic_night(runs, 3)
    before = nice()
    assert ingest(tmp_path / "db.duckdb", runs, cache=symbol_cache, hooks=hooks).ingested == 3
    assert loaders and set(loaders) == {before} and nice() == before
    assert len(readers) == 3 and set(readers) == {min(19, before + READ_NICE)}


def test_small_runs_share_transactions_by_default_and_load_as_runs_alone(tmp_path, symbol_cache) -> None:
    """The default ingest of a night of small runs loads them in shared transactions, and stores
    exactly what an ingest of one transaction per run does; with runs past the budget, each goes alone."""
    runs = tmp_path / "runs"
    _synthetic_night(runs, 7)  # 1,000 events a run
    hooks, groups = transaction_sizes()
    db = tmp_path / "default.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, hooks=hooks)
    assert summary.ok and summary.ingested == 7
    assert groups == [7]
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)
    groups.clear()
    small_budget = IngestLimits(rows_per_transaction=1500)
    assert (
        ingest(tmp_path / "small-budget.duckdb", runs, cache=symbol_cache, hooks=hooks, limits=small_budget).ingested
        == 7
    )
    assert groups == [1] * 7


def test_runs_sharing_a_transaction_load_as_runs_alone(tmp_path, symbol_cache) -> None:
    from support.synthetic import SyntheticConfig, generate

    runs = tmp_path / "runs"
    # Runs that bring in new stacks, symbols, modules and event names of their own, and share others.
    generate(
        runs,
        SyntheticConfig(runs=7, events=7000, unique_stacks=400, native_addresses=600, code_objects=120, max_modules=6),
    )
    hooks, groups = transaction_sizes()
    db = tmp_path / "grouped.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=3, hooks=hooks)
    assert summary.ok and summary.ingested == 7 and summary.events == 7000
    assert groups == [3, 3, 1]
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)
    assert rows(db, "SELECT count(*) FROM stacks s ANTI JOIN stack_sites USING (stack_id)") == [(0,)]
    assert rows(db, "SELECT list(run_number ORDER BY run_number) FROM runs") == [(list(range(1, 8)),)]


def _ingested_one_by_one(tmp_path: Path, runs: Path, cache: Path, skip: tuple[str, ...] = ()) -> Path:
    """The runs ingested by one ingest each, in order: nothing else is under way while one loads."""
    db = tmp_path / "one-by-one.duckdb"
    for run_dir in find_run_dirs([runs]):
        if run_dir.name not in skip:
            assert ingest(db, run_dir, cache=cache).ingested == 1
    return db


def _stored_alike(db: Path, other: Path) -> None:
    """The two databases hold the same rows, but for the numbers given to frames (a batch of runs
    laid out together numbers its distinct frames in another order than its runs laid out alone)."""
    ours, theirs = snapshot(db, exclude_ingest_times=True), snapshot(other, exclude_ingest_times=True)
    ours.pop("stack_frames"), theirs.pop("stack_frames")
    assert ours == theirs
    frames = "SELECT count(*), sum(hash(t)) FROM (SELECT * EXCLUDE (frame_id) FROM stack_frames) t"
    assert rows(db, frames) == rows(other, frames)


def _synthetic_night(runs: Path, count: int) -> None:
    """Runs that bring in new stacks, symbols, modules and event names of their own, and share others."""
    from support.synthetic import SyntheticConfig, generate

    generate(
        runs,
        SyntheticConfig(
            runs=count, events=1000 * count, unique_stacks=400, native_addresses=600, code_objects=120, max_modules=6
        ),
    )


# ------------------------------------------------------------------ runs read without their frames


def _frames_read() -> tuple[IngestHooks, list[str]]:
    """Hooks, and the run folders whose stacks the ingest reads with their frames (filled as it goes)."""
    read: list[str] = []
    return IngestHooks(run_read=lambda run_dir, whole: read.append(run_dir.name) if whole else None), read


def _content(db: Path) -> dict[str, tuple]:
    """What `snapshot` holds but the runs' file fingerprints, and the site counts."""
    content = snapshot(db, exclude_ingest_times=True)
    content["runs"] = rows(
        db, "SELECT count(*), sum(hash(t)) FROM (SELECT run_id, run_number, events, stacks, new_stacks FROM runs) t"
    )
    content["site_counts"] = rows(db, "SELECT count(*), sum(hash(t)) FROM site_counts t")
    return content


def test_runs_whose_stacks_are_stored_load_without_their_frames(tmp_path, symbol_cache) -> None:
    """The capture writes each stack's hash (raw schema 4): a run all of whose stacks the database
    holds, or that a run loaded before it brings in, is read without its frames. What is stored is
    the same as when every run is read whole (runs written without the hashes)."""
    from support.synthetic import SyntheticConfig, generate

    config = SyntheticConfig(
        runs=9, events=9000, unique_stacks=300, native_addresses=500, code_objects=100, max_modules=6
    )
    generate(tmp_path / "hashed", config)
    generate(tmp_path / "unhashed", SyntheticConfig(**{**config.__dict__, "written_hashes": False}))
    hooks, read = _frames_read()
    # Runs prepared one at a time: read side by side, a run may look before the one ahead of it
    # tells which stacks it brings in, and read its frames for nothing (which changes no row).
    options = {"cache": symbol_cache, "hooks": hooks, "limits": IngestLimits(read_threads=1)}
    first, rest = find_run_dirs([tmp_path / "hashed"])[:4], find_run_dirs([tmp_path / "hashed"])[4:]
    hashed = tmp_path / "hashed.duckdb"
    assert ingest(hashed, *first, runs_per_transaction=2, **options).ingested == 4
    assert ingest(hashed, *rest, **options).ingested == 5
    bringing = {path.rsplit("/", 1)[-1] for (path,) in rows(hashed, "SELECT source_dir FROM runs WHERE new_stacks > 0")}
    assert 0 < len(bringing) < 9
    assert sorted(read) == sorted(bringing), "frames are read for the runs that bring in stacks, and only for them"

    read.clear()
    unhashed = tmp_path / "unhashed.duckdb"
    assert (
        ingest(unhashed, *find_run_dirs([tmp_path / "unhashed"])[:4], runs_per_transaction=2, **options).ingested == 4
    )
    assert ingest(unhashed, *find_run_dirs([tmp_path / "unhashed"])[4:], **options).ingested == 5
    assert len(read) == 9
    assert _content(hashed) == _content(unhashed)


def test_runs_read_without_their_frames_are_still_checked(tmp_path, good_run, symbol_cache) -> None:
    """A run whose stacks are stored is still quarantined when its stacks refer to a module or code
    object it does not describe, when its events refer to stacks it does not hold, and when a page
    of a column it does not read is damaged."""
    runs = tmp_path / "runs"
    db = tmp_path / "t.duckdb"
    assert ingest(db, _copy(good_run, runs, "first"), cache=symbol_cache).ingested == 1
    later = tmp_path / "later"
    damage = {
        "nomodule": (DAMAGE["nomodule"][0], DAMAGE["nomodule"][1]),
        "nocode": (DAMAGE["nocode"][0], DAMAGE["nocode"][1]),
        "stacksbit": (DAMAGE["stacksbit"][0], DAMAGE["stacksbit"][1]),
        "dangling": (_events_without_their_stack, "events refer to stacks the run does not hold"),
    }
    for name, (change, _reason) in damage.items():
        change(_copy(good_run, later, name))
    _copy(good_run, later, "whole")
    hooks, read = _frames_read()
    summary = ingest(db, later, cache=symbol_cache, hooks=hooks)
    assert read == [], "every one of them was read without its frames"
    reasons = {outcome.path.name: outcome.reason for outcome in summary.quarantined}
    assert sorted(reasons) == sorted(damage)
    for name, (_change, reason) in damage.items():
        assert reason in reasons[name], (name, reasons[name])
    assert rows(db, "SELECT count(*) FROM runs") == [(2,)]
    assert rows(db, "SELECT sum(new_stacks) FROM runs WHERE run_id LIKE '%whole'") == [(0,)]


def test_module_references_are_shown_described_by_statistics_only_when_they_are(tmp_path) -> None:
    """A run read without its frames skips decoding its native frames' module references when the
    footer's statistics show each one described (`_references_described`): every value between a
    row group's min and max must be a described module, and a part without statistics is decoded."""
    import numpy as np

    from tbpipe.pipeline.rawrun import _references_described

    def footer(groups: list[list[int]], statistics: bool = True) -> pq.FileMetaData:
        path = tmp_path / f"part-{len(list(tmp_path.iterdir()))}.parquet"
        table = pa.table({"module": pa.array([m for group in groups for m in group], pa.int32())})
        pq.write_table(table, path, row_group_size=len(groups[0]), write_statistics=statistics)
        return pq.read_metadata(path)

    described = np.arange(6)
    assert _references_described(footer([[0, 5, 2], [1, 1, 3]]), "module", described)
    assert not _references_described(footer([[0, 5, 2], [1, 6, 3]]), "module", described)  # 6: none
    assert not _references_described(footer([[0, -1, 2]]), "module", described)  # a marker's -1
    assert not _references_described(footer([[0, 5, 2]]), "module", np.array([0, 1, 2, 4, 5]))  # 3 lost
    assert _references_described(footer([[2, 4, 3]]), "module", np.array([0, 2, 3, 4]))
    assert not _references_described(footer([[0, 5, 2]], statistics=False), "module", described)


def _events_without_their_stack(run_dir: Path) -> None:
    """One event of the run's first events part names a stack the run does not hold."""

    def change(table: pa.Table) -> pa.Table:
        ids = table["stack_id"].to_pylist()
        ids[0] = 12345
        index = table.schema.get_field_index("stack_id")
        return table.set_column(index, table.schema.field(index), pa.array(ids, pa.uint64()))

    _rewrite_as_capture(run_dir / "events-000001.parquet", "events", change)


def _rewrite_as_capture(part: Path, table_name: str, change) -> None:
    """The part rewritten with `change`, with the capture's write options (page checksums)."""
    from support.synthetic import write_part

    write_part(part.parent, table_name, int(part.stem.rsplit("-", 1)[1]), change(pq.read_table(part)))


def test_a_run_read_without_frames_brings_its_stacks_when_the_one_before_fails(
    tmp_path, good_run, symbol_cache
) -> None:
    """The run that was to bring in the stacks fails as it loads (its events name a stack it does not
    hold): the next one, read without its frames as its stacks were to come first, is read whole
    and brings them in itself."""
    runs = tmp_path / "runs"
    _events_without_their_stack(_copy(good_run, runs, "a-fails"))
    _copy(good_run, runs, "b-whole")
    db = tmp_path / "t.duckdb"
    hooks, read = _frames_read()
    one_reader = IngestLimits(read_threads=1)  # a-fails is looked at first
    summary = ingest(db, runs, cache=symbol_cache, hooks=hooks, limits=one_reader)
    assert [outcome.path.name for outcome in summary.quarantined] == ["a-fails"]
    assert read == ["a-fails", "b-whole"], "b-whole was read without its frames first"
    assert summary.ingested == 1 and summary.new_stacks > 0
    alone = tmp_path / "alone.duckdb"
    assert ingest(alone, _copy(good_run, tmp_path / "alone", "b-whole"), cache=symbol_cache).ingested == 1
    assert {k: v for k, v in _content(db).items() if k != "runs"} == {
        k: v for k, v in _content(alone).items() if k != "runs"
    }


def test_a_written_stack_hash_unlike_its_frames_quarantines_the_run(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"

    def wrong(table: pa.Table) -> pa.Table:
        hashes = table["stack_hash"].to_pylist()
        hashes[-1] ^= 1
        index = table.schema.get_field_index("stack_hash")
        return table.set_column(index, table.schema.field(index), pa.array(hashes, pa.uint64()))

    _rewrite_as_capture(_copy(good_run, runs, "wrong") / "stacks-000001.parquet", "stacks", wrong)
    summary = ingest(tmp_path / "t.duckdb", runs, cache=symbol_cache)
    (outcome,) = summary.quarantined
    assert "1 stacks' stack_hash differs from the hash of their frames" in outcome.reason


def test_the_next_transaction_loading_beside_changes_nothing_stored(tmp_path, symbol_cache) -> None:
    """While a transaction inserts its stacks and sites and commits, the next one's events load on a
    second connection, which cannot see the first one's rows (it began before they were committed):
    the site counts of stacks the run before brought in, the event names and modules it added, the
    ids given after its own must still come out as when every run is ingested alone. A transaction
    per run, so that there is a next one for each run."""
    runs = tmp_path / "runs"
    _synthetic_night(runs, 7)
    threads = []
    hooks = IngestHooks(loading_events=lambda _ids: threads.append(threading.current_thread().name))
    db = tmp_path / "together.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=1, hooks=hooks)
    assert summary.ok and summary.ingested == 7
    # Every run's events load on the events thread: the first one's beside the layout, every later
    # one's beside the run before.
    assert [name.startswith("tbpipe-events") for name in threads] == [True] * 7
    _stored_alike(db, _ingested_one_by_one(tmp_path, runs, symbol_cache))
    assert rows(db, "SELECT count(*) FROM site_counts WHERE site_id IS NULL") == [(0,)]


def test_site_counts_counted_in_memory_equal_the_sql_definition(tmp_path, symbol_cache) -> None:
    """A transaction counts its runs' sites in memory, from their event counts and the sites of
    their stacks: stored before its batch, brought in by the transactions before it (which it cannot
    see), or by itself. `count_sites` (SQL) is the definition: counting every run again with it must
    give the same rows, where a site's stacks show it at several files and lines too."""
    from tbpipe.pipeline.db.ingest.siting import count_sites
    from tbpipe.pipeline.db.ingest.tables import IngestDb

    runs = tmp_path / "runs"
    _synthetic_night(runs, 7)
    db = tmp_path / "night.duckdb"
    run_dirs = find_run_dirs([runs])
    for chosen in (run_dirs[:3], run_dirs[3:]):  # the second ingest's runs use stored stacks too
        assert ingest(db, *chosen, cache=symbol_cache).ingested == len(chosen)
    query = (
        "SELECT run_number, name_id, site_id, events, site_file, site_line, site_is_user FROM site_counts ORDER BY ALL"
    )
    counted = rows(db, query)
    assert len(counted) > 50
    con = open_database(db)
    try:
        con.execute("DELETE FROM site_counts")
        count_sites(IngestDb(con), None)
    finally:
        con.close()
    assert rows(db, query) == counted


def test_site_counts_in_memory_place_a_site_as_the_sql_does(tmp_path) -> None:
    """Where a run's stacks show one site at several files and lines, the site is placed at the file
    and line of its stack with the most events (ties to the greater file, then line), each taken
    only from stacks that have one; stacks without a site and events without a stack count under
    no site."""
    from tbpipe.pipeline.db.ingest.siting import count_sites, insert_site_counts
    from tbpipe.pipeline.db.ingest.tables import IngestDb

    con = open_database(tmp_path / "sites.duckdb")
    db = IngestDb(con)
    stack_sites = pa.table(
        {
            "stack_id": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
            "site_id": pa.array([10, 10, 10, None, 11, 11], pa.int64()),
            "site_file": pa.array(["a.py", "b.py", None, None, "c.py", "c.py"]),
            "site_line": pa.array([5, 3, 7, None, None, 2], pa.int32()),
            "site_is_user": [True, True, False, False, False, False],
        }
    )
    counts = pa.table(
        {
            "run_number": pa.array([1, 1, 1, 1, 1, 1, 1, 2, 2, 2], pa.int32()),
            "name_id": pa.array([1, 1, 1, 1, 1, 1, 1, 1, 2, 2], pa.int32()),
            "stack_id": pa.array([1, 2, 3, None, 4, 5, 99, 1, 5, 6], pa.int64()),
            "events": pa.array([5, 5, 9, 4, 2, 8, 3, 1, 6, 6], pa.int64()),
        }
    )
    try:
        db.insert("INSERT INTO stack_sites BY NAME SELECT * FROM {}", stack_sites)
        db.insert("INSERT INTO event_counts BY NAME SELECT * FROM {}", counts)
        query = "SELECT run_number, name_id, site_id, events, site_file, site_line, site_is_user FROM site_counts"
        count_sites(db, [1, 2])
        by_sql = sorted(query_rows(con, query), key=str)
        con.execute("DELETE FROM site_counts")
        insert_site_counts(db, counts, stack_sites)
        in_memory = query_rows(con, query)
    finally:
        con.close()
    assert sorted(in_memory, key=str) == by_sql
    assert (1, 1, 10, 19, "b.py", 7, True) in by_sql  # file from the 5/5 tie, line from the 9 without a file
    assert (1, 1, None, 9, None, None, False) in by_sql  # no stack (4), no site (2), a stack not stored (3)
    assert (2, 2, 11, 12, "c.py", 2, False) in by_sql
    # Rows in the order of `site_counts_by_site`: by site, those without one last.
    assert [row[2] for row in in_memory] == sorted((row[2] for row in in_memory), key=lambda s: (s is None, s or 0))


def _load_more_modules(run_dir: Path, *build_ids: str) -> None:
    """The run loaded more modules than its stacks use (each still gets its row in `modules`)."""

    def more(table: pa.Table) -> pa.Table:
        extra = []
        for k, build_id in enumerate(build_ids):
            row = table.slice(0, 1)
            for name, value in (
                ("module_index", pc.max(table["module_index"]).as_py() + 1 + k),
                ("path", f"/opt/extra/lib{build_id}.so"),
                ("build_id", build_id),
            ):
                index = row.schema.get_field_index(name)
                row = row.set_column(index, row.schema.field(name), pa.array([value], row.schema.field(name).type))
            extra.append(row)
        return pa.concat_tables([table, *extra])

    (part,) = run_dir.glob("modules-*.parquet")
    _rewrite(part, more)


def test_a_module_the_transaction_before_added_unseen_gets_one_row(tmp_path, good_run, symbol_cache) -> None:
    """The next run's transaction begins before the one before it commits, so it cannot see the
    `modules` row that one adds: a module both runs loaded first still gets one row, as does the
    module the later run adds."""
    runs = tmp_path / "runs"
    _copy(good_run, runs, "a")
    _load_more_modules(_copy(good_run, runs, "b"), "e0e0e0e0e0e0e0e001")
    _load_more_modules(_copy(good_run, runs, "c"), "e0e0e0e0e0e0e0e001", "e0e0e0e0e0e0e0e002")
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.ingested == 3
    assert rows(
        db, "SELECT module_key, count(*) FROM modules WHERE path LIKE '/opt/extra/%' GROUP BY ALL ORDER BY 1"
    ) == [
        ("e0e0e0e0e0e0e0e001", 1),
        ("e0e0e0e0e0e0e0e002", 1),
    ]
    _stored_alike(db, _ingested_one_by_one(tmp_path, runs, symbol_cache))


def test_a_run_failing_while_the_next_one_loads_beside_it(tmp_path, symbol_cache) -> None:
    """A transaction fails at its end, after the next one began beside it on the other connection:
    that one is rolled back with it, laid out again without the failed run, and loaded; the database
    is the one the other runs make alone."""
    from tbpipe.pipeline.db.ingest.tables import QuarantineRun

    runs = tmp_path / "runs"
    _synthetic_night(runs, 5)
    victim = find_run_dirs([runs])[1]
    victim_id = json.loads((victim / "manifest.json").read_text())["run_id"]

    def before_commit(run_id: str) -> None:
        if run_id == victim_id:
            raise QuarantineRun("failed at the commit")

    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, hooks=IngestHooks(before_commit=before_commit))
    assert [o.path.name for o in summary.quarantined] == [victim.name]
    assert "failed at the commit" in summary.quarantined[0].reason
    assert summary.ingested == 4
    _stored_alike(db, _ingested_one_by_one(tmp_path, runs, symbol_cache, skip=(victim.name,)))


def test_cli_loads_runs_together_on_request(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        _copy(good_run, runs, name)
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="300")
    db = tmp_path / "t.duckdb"
    command = [*TBPIPE, "ingest", str(runs), "--db", str(db), "--runs-per-transaction"]
    refused = subprocess.run([*command, "0"], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "--runs-per-transaction" in _words(refused.stderr), refused.stderr
    assert not db.exists()
    result = subprocess.run([*command, "2"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((good_run / "manifest.json").read_text())
    threads = {int(k): v for k, v in manifest["threads"].items()}
    # The runs rows, built as the lake builds them: times, labels and thread names as the manifest says.
    assert rows(
        db,
        "SELECT run_id, labels, threads, started_at = CAST(? AS TIMESTAMPTZ) FROM runs ORDER BY 1",
        [manifest["started_at"]],
    ) == [(run_id, {"suite": "good"}, threads, True) for run_id in _run_ids(runs)]


def _rename_events(run_dir: Path, name: str) -> None:
    for part in run_dir.glob("events-*.parquet"):
        _rewrite(
            part,
            lambda t: t.set_column(
                t.schema.get_field_index("name"), t.schema.field("name"), pa.array([name] * t.num_rows, pa.string())
            ),
        )


def test_runs_loaded_together_number_what_they_add_as_one_by_one(tmp_path, good_run, symbol_cache) -> None:
    """Runs, events and event names numbered as if loaded one by one, whichever runs share a
    transaction: a run loaded again (incomplete before) keeps its number, so the runs of a
    transaction need not be numbered in a row, and new runs beside it get numbers and event ids
    after the ones it held."""
    runs = tmp_path / "runs"
    grouped, alone = tmp_path / "grouped.duckdb", tmp_path / "alone.duckdb"

    def ingest_both(statuses: list[str]) -> None:
        summary = ingest(grouped, runs, cache=symbol_cache, runs_per_transaction=4)
        assert [o.status for o in summary.outcomes] == statuses
        ingest(alone, runs, cache=symbol_cache, runs_per_transaction=1)
        assert snapshot(grouped, exclude_ingest_times=True) == snapshot(alone, exclude_ingest_times=True)

    for name in ("a", "c"):
        _copy(good_run, runs, name)
    _manifest(runs / "c", complete=False)
    ingest_both(["ingested", "ingested"])
    # A new run before the one loaded again (which holds the highest event ids), and one after it;
    # both bring event names of their own.
    _manifest(runs / "c", complete=True)
    _rename_events(_copy(good_run, runs, "b"), "zzz-new-in-b")
    _rename_events(_copy(good_run, runs, "d"), "aaa-new-in-d")
    _manifest(runs / "d", complete=False)
    ingest_both(["present", "ingested", "updated", "ingested"])
    new_names = "SELECT name FROM event_names WHERE name LIKE '%-new-in-%' GROUP BY name ORDER BY min(name_id)"
    assert rows(grouped, new_names) == [("zzz-new-in-b",), ("aaa-new-in-d",)]
    # The run loaded again first in its transaction, holding the highest run number.
    _manifest(runs / "d", complete=True)
    _copy(good_run, runs, "e")
    ingest_both(["present", "present", "present", "updated", "ingested"])
    run_id = dict(zip("abcde", _run_ids(runs)))
    assert rows(grouped, "SELECT run_id, run_number FROM runs ORDER BY run_number") == [
        (run_id[name], number) for name, number in (("a", 1), ("c", 2), ("b", 3), ("d", 4), ("e", 5))
    ]
    assert rows(grouped, "SELECT count(DISTINCT event_id) = count(*) FROM event_rows") == [(True,)]


def test_a_transactions_share_of_its_batch_is_the_rows_of_its_runs() -> None:
    """`ByRun` gives each transaction the rows of its runs (one run, or several in a row), in the
    batch's order, as a scan of the whole batch would: rows and table rows alike, for runs in any
    order of the rows, runs without rows, and indices past the last run."""
    import numpy as np

    from tbpipe.pipeline.db.ingest.lay_out import ByRun

    generator = np.random.default_rng(7)
    run_of_row = generator.integers(0, 9, 500)
    run_of_row[run_of_row == 4] = 3  # run 4 has no rows
    table = pa.table({"row": np.arange(len(run_of_row)), "run": run_of_row})
    grouped = ByRun(run_of_row)
    for runs in [range(i, i + 1) for i in range(10)] + [range(0, 3), range(2, 6), range(5, 9), range(0, 9)]:
        expected = np.flatnonzero((run_of_row >= runs.start) & (run_of_row < runs.stop))
        assert grouped.rows_of(runs).tolist() == expected.tolist(), runs
        in_run_order = grouped.in_run_order(table)
        assert grouped.table_of(table, in_run_order, runs)["row"].to_pylist() == expected.tolist(), runs
    assert grouped.rows_of(range(4, 5)).tolist() == []


def _thread_id_past_int64(run_dir: Path) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    _manifest(run_dir, threads={**manifest.get("threads", {}), "9999999999999999999": "huge"})


def test_a_run_that_fails_inside_a_shared_transaction_is_quarantined_alone(tmp_path, good_run, symbol_cache) -> None:
    """A shared transaction whose data fails is loaded again run by run: the run at fault is
    quarantined for its own reason, the others of its transaction go in, as they would alone."""
    runs = tmp_path / "runs"
    _copy(good_run, runs, "a-good")
    DAMAGE["attrs"][0](_copy(good_run, runs, "b-attrs"))
    _copy(good_run, runs, "c-good")
    _thread_id_past_int64(_copy(good_run, runs, "d-threads"))
    _copy(good_run, runs, "e-good")
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=5)
    alone = _ingested_alone(tmp_path, runs, symbol_cache)
    reasons = {o.path.name: o.reason for o in summary.quarantined}
    assert sorted(reasons) == ["b-attrs", "d-threads"]
    assert "attributes that are not JSON" in reasons["b-attrs"]
    assert "d-threads" in reasons["d-threads"] and "manifest values cannot be stored" in reasons["d-threads"]
    assert summary.ingested == 3
    assert snapshot(db, exclude_ingest_times=True) == snapshot(alone, exclude_ingest_times=True)
    assert rows(db, "SELECT list(run_number ORDER BY run_number) FROM runs") == [([1, 2, 3],)]
    assert rows(db, "SELECT count(*) FROM run_modules ANTI JOIN modules USING (module_key)") == [(0,)]


def test_concurrent_ingests_wait_or_fail_clearly(tmp_path, good_run, symbol_cache) -> None:
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    _copy(good_run, one, "one")
    _copy(good_run, two, "two")
    _copy(good_run, three, "three")
    db = tmp_path / "t.duckdb"
    # A narrow terminal: the messages wrap, and the checks must not depend on where.
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="50")
    holder = PausingIngest(tmp_path, one, db, symbol_cache, _run_ids(one)[0])
    patient_err = tmp_path / "patient.err"
    try:
        impatient = subprocess.run(
            [*TBPIPE, "ingest", str(three), "--db", str(db), "--wait", "0"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        with open(patient_err, "w") as err:
            patient = subprocess.Popen(
                [*TBPIPE, "ingest", str(two), "--db", str(db), "--wait", "240"],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        # The holder keeps the database until the patient one says that it waits.
        deadline = time.monotonic() + 240
        while "waiting for another ingest" not in _words(patient_err.read_text()):
            assert patient.poll() is None, f"the second ingest did not wait: {patient_err.read_text()}"
            assert time.monotonic() < deadline, "the second ingest never said that it waits"
            time.sleep(0.02)
    finally:
        _out, holder_err = holder.release()
    patient.communicate(timeout=240)
    assert holder.process.returncode == 0, holder_err
    assert impatient.returncode == 2, impatient.stderr
    assert f"another ingest (pid {holder.pid}) is writing it" in _words(impatient.stderr)
    assert "Traceback" not in impatient.stderr
    assert patient.returncode == 0, patient_err.read_text()
    assert f"waiting for another ingest (pid {holder.pid})" in _words(patient_err.read_text())
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted(_run_ids(one) + _run_ids(two))


def test_readers_are_refused_while_an_ingest_writes(tmp_path, good_run, symbol_cache) -> None:
    from tbpipe.pipeline.db import DatabaseBusyError

    runs = tmp_path / "runs"
    _copy(good_run, runs, "only")
    db = tmp_path / "t.duckdb"
    ingest(db, tmp_path / "runs", cache=symbol_cache)  # the file exists before the writer holds it
    _copy(good_run, runs, "more")
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, "20260101T000000-1-more")
    try:
        with pytest.raises(DatabaseBusyError, match="another process is writing the database"):
            open_database(db, read_only=True)
    finally:
        _out, err = holder.release()
    assert holder.process.returncode == 0, err
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted(_run_ids(runs))


# ------------------------------------------------------------------------------ better debug info later

LIB_C = """int helper(int x) { return x * 3 + 1; }
int entry(int x) {
    return helper(x) + 2;
}
"""


@pytest.mark.skipif(not all(shutil.which(t) for t in ("gcc", "objcopy", "strip")), reason="needs gcc and binutils")
def test_better_debug_info_later_improves_stored_stacks(tmp_path) -> None:
    from elftools.elf.elffile import ELFFile
    from support.synthetic import manifest_for, write_run

    from tbpipe.pipeline.symbols.elf import inspect_elf
    from tbpipe.schemas import raw

    for folder in ("full", "debug", "stripped"):
        (tmp_path / folder).mkdir()
    (tmp_path / "lib.c").write_text(LIB_C)
    full, debug, stripped = (
        tmp_path / "full/libdemo.so",
        tmp_path / "debug/libdemo.debug",
        tmp_path / "stripped/libdemo.so",
    )
    subprocess.run(
        ["gcc", "-O0", "-g", "-shared", "-fPIC", "-Wl,--build-id", str(tmp_path / "lib.c"), "-o", str(full)], check=True
    )
    subprocess.run(["objcopy", "--only-keep-debug", str(full), str(debug)], check=True)
    subprocess.run(["strip", "--strip-all", str(full), "-o", str(stripped)], check=True)
    build_id = inspect_elf(str(stripped)).build_id
    with open(full, "rb") as handle:
        entry = ELFFile(handle).get_section_by_name(".symtab").get_symbol_by_name("entry")[0]["st_value"]

    stacks = pa.table(
        {
            "stack_id": pa.array([1], pa.uint64()),
            "thread_id": pa.array([1], pa.int64()),
            "status": pa.array([raw.STACK_NO_PYTHON], pa.uint32()),
            "native": pa.array(
                [[{"module": 0, "offset": entry + 4, "flags": raw.NATIVE_FRAME_EXACT_PC}]],
                raw.stacks_schema().field("native").type,
            ),
            "python": pa.array([[]], raw.stacks_schema().field("python").type),
        }
    )
    modules = pa.table(
        {
            "module_index": pa.array([0], pa.int32()),
            "path": [str(stripped)],
            "build_id": [build_id],
            "load_bias": pa.array([0], pa.uint64()),
            "exec_ranges": pa.array([[]], raw.modules_schema().field("exec_ranges").type),
            "eval_ranges": pa.array([[]], raw.modules_schema().field("eval_ranges").type),
        }
    )
    events = pa.table(
        {
            "ts": pa.array([1_700_000_000_000_000_000], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
            "thread_id": pa.array([1], pa.int64()),
            "kind": ["kernel_launch"],
            "name": ["native_only"],
            "stack_id": pa.array([1], pa.uint64()),
            "attrs": pa.nulls(1, pa.string()),
        }
    )
    runs = tmp_path / "runs"
    write_run(
        runs / "r",
        manifest_for("20260101T000000-1-native"),
        {"events": events, "stacks": stacks, "modules": modules, "code": raw.code_schema().empty_table()},
    )
    db, cache = tmp_path / "t.duckdb", tmp_path / "symbols"

    ingest(db, runs, cache=cache)
    assert rows(db, "SELECT quality FROM modules") == [("symbols",)]
    assert rows(db, "SELECT function, file, line FROM stack_frames") == [("entry", None, None)]
    assert rows(db, "SELECT site_function, site_file, site_line FROM call_sites") == [("entry", None, None)]

    # The debug file turns up later: the next ingest redoes the stored frames, and the call site.
    summary = ingest(db, cache=cache, debug_dirs=[tmp_path / "debug"])
    assert summary.refreshed_modules == [build_id]
    assert rows(db, "SELECT quality FROM modules") == [("dwarf",)]
    ((function, file, line),) = rows(db, "SELECT function, file, line FROM stack_frames")
    assert (function, file.endswith("lib.c"), line) == ("entry", True, 2)  # entry+4: its prologue
    assert rows(db, "SELECT site_function, site_line, events FROM call_sites") == [("entry", 2, 1)]


def test_one_run_in_two_folders_goes_in_once(tmp_path, good_run, symbol_cache) -> None:
    """A run copied to two folders goes in once, the copy found present: in one batch (the copy
    waits for the next batch, after its twin is loaded) or in batches of one run (the copy was
    prepared ahead, on the preparing thread, before its twin was loaded). Two loads of one run id
    used to fail the whole ingest on the runs table's key."""
    for batch_runs in (64, 1):
        runs = tmp_path / f"runs{batch_runs}"
        first = _copy(good_run, runs, "a")
        shutil.copytree(first, runs / "b")
        db = tmp_path / f"t{batch_runs}.duckdb"
        summary = ingest(db, runs, cache=symbol_cache, limits=IngestLimits(batch_runs=batch_runs))
        assert sorted(o.status for o in summary.outcomes) == ["ingested", "present"]
        assert rows(db, "SELECT count(*), min(run_number) FROM runs") == [(1, 1)]
        assert rows(db, "SELECT count(*) FROM events") == [(read_run(good_run).tables["events"].num_rows,)]


def test_a_failed_load_stops_the_thread_preparing_runs(tmp_path, good_run, symbol_cache) -> None:
    """The ingest fails on a database error; the thread that prepares runs ahead ends with it rather
    than waiting, with prepared runs in memory, for a loader that is gone (as in a long-lived service)."""
    import threading

    from tbpipe.pipeline.db.connection import DatabaseError

    runs = tmp_path / "runs"
    for name in ("a", "b", "c", "d"):
        _copy(good_run, runs, name)

    def fail(_run_ids):
        raise DatabaseError("the disk is full")

    with pytest.raises(DatabaseError, match="the disk is full"):
        ingest(
            tmp_path / "t.duckdb",
            runs,
            cache=symbol_cache,
            hooks=IngestHooks(finishing=fail),
            limits=IngestLimits(batch_runs=1),
        )
    assert not [t for t in threading.enumerate() if t.name == "tbpipe-prepare"]


def _blocks(db: Path) -> tuple[int, int]:
    """(blocks in the file, free blocks among them)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        total, free = con.execute("SELECT total_blocks, free_blocks FROM pragma_database_size()").fetchone()
    finally:
        con.close()
    return total, free


def test_runs_of_many_events_leave_no_free_blocks_and_a_reloaded_run_its_space_back(tmp_path, symbol_cache) -> None:
    """Runs past a row group of events each (122,880 rows) end in a partial row group; DuckDB's
    vacuum would merge those at the closing checkpoint and leave the blocks they were in free in
    the file. The ingest pauses it, unless it deleted rows: a run loaded again gets its old rows'
    space back (the file does not grow by the rows it replaced)."""
    from support.synthetic import SyntheticConfig, generate

    runs = tmp_path / "runs"
    generate(
        runs,
        SyntheticConfig(
            runs=3, events=390_000, unique_stacks=300, native_addresses=500, code_objects=100, max_modules=4
        ),
    )
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.events == 390_000
    total, free = _blocks(db)
    assert free == 0, f"{free} of {total} blocks free after a fresh ingest"
    assert rows(
        db, "SELECT count(DISTINCT row_group_id) > 390_000 // 122_880 FROM pragma_storage_info('event_rows')"
    ) == [(True,)]  # the partial row groups were kept, not merged

    # One run, loaded while incomplete, is loaded again once complete: its rows are deleted and
    # inserted again, and the closing checkpoint vacuums (the deleted rows' blocks are reused).
    first = sorted(p for p in runs.iterdir() if p.is_dir())[0]
    manifest = json.loads((first / "manifest.json").read_text())
    (first / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    db2 = tmp_path / "t2.duckdb"
    assert ingest(db2, runs, cache=symbol_cache).ok
    before, _free = _blocks(db2)
    (first / "manifest.json").write_text(json.dumps(manifest))
    summary = ingest(db2, runs, cache=symbol_cache)
    assert summary.ok and [o.status for o in summary.outcomes].count("updated") == 1
    assert rows(db2, "SELECT count(*) FROM event_rows") == [(390_000,)]
    after, free = _blocks(db2)
    # The replaced rows left in place would add the run's share, about a third of the blocks; how
    # DuckDB's threads split the inserts moves the count by a few blocks either way.
    assert after - free <= before * 1.15, (before, after, free)
