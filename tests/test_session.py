"""Sessions, the run format on disk, and misuse."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pyarrow.compute as pc
import pytest
from conftest import run_python
from support.runs import read_runs

from tbpipe import _native, capture
from tbpipe.capture import SessionError, SourceError
from tbpipe.schemas import raw


def launch(kind: str, name: str, **attrs) -> None:
    capture.record(kind, name, **attrs)


def test_record_without_session_is_a_noop(out_dir: Path) -> None:
    assert capture.active_session() is None
    assert capture.record("user", "nothing") is None
    assert not out_dir.exists()


def test_session_writes_a_complete_run(out_dir: Path) -> None:
    with capture.session(out_dir, labels={"suite": "unit", "commit": "abc"}) as session:
        for i in range(100):
            launch("kernel_launch", "gemm", grid=i)
        launch("user", "marker")
    (run,) = read_runs(out_dir)
    assert run.run_id == session.run_id
    assert run.complete
    assert run.manifest["labels"] == {"suite": "unit", "commit": "abc"}
    assert run.manifest["pid"] == os.getpid()
    assert run.manifest["counters"]["events_recorded"] == 101
    events = run.tables["events"]
    assert events.num_rows == 101
    gemm = events.filter(pc.equal(events["name"], "gemm"))
    assert gemm.num_rows == 100
    assert sorted(json.loads(a)["grid"] for a in gemm["attrs"].to_pylist()) == list(range(100))
    # The hundred launches share one stack; the marker has its own.
    assert set(gemm["stack_id"].to_pylist()) <= set(run.tables["stacks"]["stack_id"].to_pylist())
    assert len(set(gemm["stack_id"].to_pylist())) == 1
    assert run.tables["stacks"].num_rows == 2
    # Every referenced code object and module is described.
    code_ids = {f["code_id"] for s in run.tables["stacks"]["python"].to_pylist() for f in s}
    assert code_ids <= set(run.tables["code"]["code_id"].to_pylist())
    modules = {f["module"] for s in run.tables["stacks"]["native"].to_pylist() for f in s} - {-1}
    assert modules <= set(run.tables["modules"]["module_index"].to_pylist())
    names = set(run.tables["code"]["qualname"].to_pylist())
    assert {"launch", "test_session_writes_a_complete_run"} <= names


def test_each_stack_is_written_with_the_hash_the_ingest_gives_it(out_dir: Path) -> None:
    """`stack_hash` (raw schema 4) is the portable hash the ingest computes from the stack's frames,
    modules and code objects: a stack of a later flush hashes with the modules and code written by
    an earlier one."""
    import numpy as np

    from tbpipe.pipeline.stacks.flatten import flatten_run

    def nested(depth: int, name: str) -> None:
        if depth:
            nested(depth - 1, name)
        else:
            launch("kernel_launch", name)

    # A caller of its own per flush: each flush writes new stacks, through `nested` written before.
    callers = [
        lambda depth: nested(depth, "first"),
        lambda depth: nested(depth, "second"),
        lambda depth: nested(depth, "third"),
    ]
    with capture.session(out_dir) as session:
        for caller in callers:
            for depth in range(4):
                caller(depth)
            session.flush()
        worker = threading.Thread(target=nested, args=(2, "from_thread"))
        worker.start()
        worker.join()
    (run,) = read_runs(out_dir)
    assert len(run.manifest["files"]["stacks"]) >= 3 and len(run.manifest["files"]["code"]) >= 1
    stacks = run.tables["stacks"]
    assert stacks.num_rows >= 5 and stacks["stack_hash"].null_count == 0
    flat = flatten_run(run.tables)
    ingest_hashes = flat.hashes[np.searchsorted(flat.raw_ids, stacks["stack_id"].to_numpy())]
    assert stacks["stack_hash"].to_pylist() == ingest_hashes.tolist()
    assert len(set(ingest_hashes.tolist())) == stacks.num_rows  # different stacks, different hashes


def test_python_lines_are_resolved_at_flush(out_dir: Path) -> None:
    with capture.session(out_dir):
        capture.record("user", "here"); line = _line()  # noqa: E702 - same line on purpose  # fmt: skip
    (run,) = read_runs(out_dir)
    (stack,) = run.tables["stacks"]["python"].to_pylist()
    assert stack[0]["line"] == line
    code = {r["code_id"]: r for r in run.tables["code"].to_pylist()}
    assert code[stack[0]["code_id"]]["qualname"] == "test_python_lines_are_resolved_at_flush"
    assert code[stack[0]["code_id"]]["filename"] == __file__


def _line() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno


def test_files_carry_schema_name_and_version(out_dir: Path) -> None:
    import pyarrow.parquet as pq

    with capture.session(out_dir):
        launch("user", "x")
    run_dir = next(out_dir.iterdir())
    for table in ("events", "stacks", "code", "modules"):
        (part,) = sorted(run_dir.glob(f"{table}-*.parquet"))
        metadata = pq.read_schema(part).metadata
        assert metadata[raw.SCHEMA_KEY] == table.encode()
        assert metadata[raw.VERSION_KEY] == str(raw.RAW_SCHEMA_VERSION).encode()
        assert pq.ParquetFile(part).metadata.row_group(0).column(0).compression == "ZSTD"


def test_many_threads_lose_nothing(out_dir: Path) -> None:
    threads, per_thread = 8, 3000
    start, halfway, resume = (threading.Barrier(threads + 1) for _ in range(3))

    def worker(index: int) -> None:
        start.wait()
        for i in range(per_thread):
            if i == per_thread // 2:
                halfway.wait()  # the main thread flushes here, while every worker is mid-way
                resume.wait()
            capture.record("user", f"t{index}", i=i)

    with capture.session(out_dir, flush_interval_s=0.05) as session:
        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for t in pool:
            t.start()
        start.wait()
        halfway.wait()
        session.flush()
        resume.wait()
        for t in pool:
            t.join()
    (run,) = read_runs(out_dir)
    events = run.tables["events"]
    assert events.num_rows == threads * per_thread
    assert run.manifest["counters"]["events_dropped"] == 0
    for n in range(threads):
        mine = events.filter(pc.equal(events["name"], f"t{n}"))
        assert sorted(json.loads(a)["i"] for a in mine["attrs"].to_pylist()) == list(range(per_thread))
        assert len(set(mine["thread_id"].to_pylist())) == 1
    assert len(set(events["thread_id"].to_pylist())) == threads
    # Events were written before and after the flush in the middle: at least two events parts.
    assert len(run.manifest["files"]["events"]) >= 2


def test_session_inside_session_is_refused(out_dir: Path) -> None:
    with capture.session(out_dir):
        with pytest.raises(SessionError, match="already active"):
            capture.session(out_dir).start()
    # The outer session closed normally and a new one can start.
    with capture.session(out_dir):
        pass
    runs = read_runs(out_dir)
    assert len(runs) == 2 and all(r.complete for r in runs)


def test_unwritable_out_dir_is_refused(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(SessionError, match="file"):
        capture.session(blocked / "runs").start()
    assert capture.active_session() is None


def test_read_only_out_dir_is_refused() -> None:
    # /proc refuses new folders even to root, who ignores permission bits.
    with pytest.raises(SessionError, match="/proc"):
        capture.session("/proc/tbpipe-runs").start()


def test_unknown_source_is_refused(out_dir: Path) -> None:
    with pytest.raises(SourceError, match="unknown event source 'no-such-source'"):
        capture.session(out_dir, sources=["no-such-source"])


def test_bad_labels_are_refused(out_dir: Path) -> None:
    with pytest.raises(SessionError, match="label key"):
        capture.session(out_dir, labels={"a=b": "c"})


def test_native_frames_off_still_records_python(out_dir: Path) -> None:
    with capture.session(out_dir, native=False):
        launch("user", "py-only")
    (run,) = read_runs(out_dir)
    (stack,) = run.tables["stacks"].to_pylist()
    assert stack["native"] == []
    assert stack["status"] & raw.STACK_NO_NATIVE
    assert len(stack["python"]) >= 2


def test_sigkilled_process_keeps_flushed_events(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    code = f"""
import os, signal, time
from tbpipe import _native, capture
s = capture.session({str(out_dir)!r}, flush_interval_s=0.2).start()
for i in range(500):
    capture.record("user", "before", i=i)
# Killed once a flush has written them (the first flush also loads the writer's libraries).
deadline = time.monotonic() + 30
while not list(s.run_dir.glob("events-*.parquet")) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)           # and a few flushes more
print("flushed", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == -9, result.stderr
    (run,) = read_runs(out_dir)
    assert not run.complete
    assert run.tables["events"].num_rows == 500
    assert run.tables["stacks"].num_rows >= 1
    assert not list(run.path.glob(".*.tmp")), "no half-written file is left visible"


def test_recording_imports_no_pandas(tmp_path: Path) -> None:
    """A recorded program that does not use pandas never has it imported by the capture (pyarrow's
    `array`, `scalar` and `to_numpy` would import it to look for its types): every import asked for
    is watched, so this holds whether pandas is installed or not."""
    out_dir = tmp_path / "runs"
    code = f"""
import sys, threading
asked = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        asked.append((name, threading.current_thread().name))
sys.meta_path.insert(0, Watch())
from tbpipe import capture
with capture.session({str(out_dir)!r}, flush_interval_s=0.05) as session:
    for i in range(300):
        capture.record("user", "step", i=i, text="é" * (i % 3))
        capture.record("user", "plain")
    session.flush()
print(sorted({{name for name, _ in asked if name.split(".")[0] == "pandas"}}))
"""
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
    (run,) = read_runs(out_dir)
    events = run.tables["events"]
    assert events.num_rows == 600
    attrs = events["attrs"].to_pylist()
    assert attrs.count(None) == 300  # an event without attributes has none, not "{}" or ""
    assert sorted(json.loads(a)["i"] for a in attrs if a) == list(range(300))
    assert {json.loads(a)["text"] for a in attrs if a} == {"", "é", "éé"}
    assert run.tables["modules"].num_rows and run.tables["code"].num_rows


def test_an_idle_session_leaves_its_run_folder_untouched(out_dir: Path) -> None:
    import time

    def folder_state(run_dir: Path) -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}

    with capture.session(out_dir, flush_interval_s=0.05) as s:
        capture.record("user", "first")
        time.sleep(0.4)  # the event flushed, then several flushes with nothing new
        settled = folder_state(s.run_dir)
        time.sleep(0.4)
        assert folder_state(s.run_dir) == settled, "flushes with nothing new rewrote the run folder"
        capture.record("user", "second")
        time.sleep(0.4)
        grown = folder_state(s.run_dir)
        assert grown["manifest.json"] != settled["manifest.json"] and len(grown) > len(settled)
    (run,) = read_runs(out_dir)
    assert run.complete and run.tables["events"].num_rows == 2


def test_fork_child_continues_into_its_own_run(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    code = f"""
import os
from tbpipe import _native, capture
with capture.session({str(out_dir)!r}, flush_interval_s=0.1) as s:
    capture.record("user", "parent-before")
    pid = os.fork()
    if pid == 0:
        capture.record("user", "child")
        capture.active_session().close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    capture.record("user", "parent-after")
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    runs = {r.manifest["pid"]: r for r in read_runs(out_dir)}
    assert len(runs) == 2
    parent = next(r for r in runs.values() if r.manifest["parent_run_id"] is None)
    child = next(r for r in runs.values() if r.manifest["parent_run_id"] is not None)
    assert child.manifest["parent_run_id"] == parent.run_id
    assert sorted(parent.tables["events"]["name"].to_pylist()) == ["parent-after", "parent-before"]
    assert child.tables["events"]["name"].to_pylist() == ["child"]
    assert parent.complete and child.complete


def test_fork_child_can_stop_recording(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    code = f"""
import os
from tbpipe import _native, capture
with capture.session({str(out_dir)!r}, on_fork="stop"):
    pid = os.fork()
    if pid == 0:
        capture.record("user", "child")  # not recorded
        assert capture.active_session() is None
        os._exit(0)
    os.waitpid(pid, 0)
    capture.record("user", "parent")
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(out_dir)
    assert run.tables["events"]["name"].to_pylist() == ["parent"]


def test_native_record_path_without_gil(out_dir: Path) -> None:
    from tbpipe import _native_test

    def launch_site():
        _native_test.record_with_gil_released("kernel_launch", "void gemm<float>(float*)", '{"grid": [2, 1, 1]}')

    with capture.session(out_dir):
        launch_site()
        _native_test.record_with_gil_released("kernel_launch", "plain", "")
    (run,) = read_runs(out_dir)
    rows = run.tables["events"].drop_columns(["ts"]).to_pylist()
    assert [(r["name"], r["attrs"]) for r in rows] == [
        ("void gemm<float>(float*)", '{"grid": [2, 1, 1]}'),
        ("plain", None),
    ]
    stacks = {s["stack_id"]: s for s in run.tables["stacks"].to_pylist()}
    code = {c["code_id"]: c["qualname"] for c in run.tables["code"].to_pylist()}
    first = stacks[rows[0]["stack_id"]]
    assert code[first["python"][0]["code_id"]].endswith("launch_site")


def test_drained_columns_are_arrays_that_own_their_values(out_dir: Path) -> None:
    """A drain hands its columns over as numpy arrays that keep the drained values themselves (no
    copy into bytes): later events and drains, and the arrays of another drain going away, leave
    them as they were."""
    import numpy as np

    from tbpipe import _native_test

    with capture.session(out_dir, flush_interval_s=1e9):
        _native.drain()  # whatever the session's start recorded
        for i in range(500):
            _native_test.record_with_gil_released("kernel_launch", "first", f'{{"i": {i}}}')
        first = _native.drain()
        kept = {key: bytes(column) for key, column in first.items() if isinstance(column, np.ndarray)}
        for _ in range(700):
            _native_test.record_with_gil_released("kernel_launch", "second", '{"i": -1}')
        second = _native.drain()
        assert len(second["ts_ns"]) == 700
        del second
    assert first["ts_ns"].dtype == np.int64 and first["name_id"].dtype == np.uint32
    assert len(first["ts_ns"]) == 500 and len(first["attr_offsets"]) == 501
    assert all(bytes(first[key]) == value for key, value in kept.items())
    text, offsets = bytes(first["attr_text"]), first["attr_offsets"]
    assert [json.loads(text[offsets[i] : offsets[i + 1]])["i"] for i in range(500)] == list(range(500))
    assert len(set(first["name_id"].tolist())) == 1 and (np.diff(first["ts_ns"]) >= 0).all()


def test_dict_and_json_attributes_mixed_in_one_flush(out_dir: Path) -> None:
    from tbpipe import _native_test

    with capture.session(out_dir, flush_interval_s=3600):
        capture.record("user", "dict", step=1, tag="a")
        _native_test.record_with_gil_released("kernel_launch", "json", '{"grid": [1, 2, 3]}')
        capture.record("user", "none")
        _native_test.record_interned_with_gil_released("op", "json-interned", '{"id": 7, "name": "\\u00e9"}')
        capture.record("user", "dict-again", value=None)
        _native_test.record_with_gil_released("kernel_launch", "no-json", "")
    (run,) = read_runs(out_dir)
    rows = run.tables["events"].select(["name", "attrs"]).to_pylist()
    assert [(r["name"], json.loads(r["attrs"]) if r["attrs"] else None) for r in rows] == [
        ("dict", {"step": 1, "tag": "a"}),
        ("json", {"grid": [1, 2, 3]}),
        ("none", None),
        ("json-interned", {"id": 7, "name": "\u00e9"}),
        ("dict-again", {"value": None}),
        ("no-json", None),
    ]


def python_between_ops() -> None:
    from tbpipe import _native_test

    _native_test.record_op_nested("called-from-python")  # PYTHON BETWEEN OPS


@pytest.mark.parametrize("op_stacks", ["own", "outermost"])
def test_nested_events_take_the_enclosing_stack_only_with_outermost_and_no_python_between(
    out_dir: Path, op_stacks: str
) -> None:
    # The C API's nested flag, as the torch-ops observer uses it, on every Python version: with
    # op_stacks="outermost" an event inside an open scope takes its stack without a walk (no spliced
    # walk is counted), unless Python code ran in between.
    from tbpipe import _native_test

    with capture.session(out_dir, op_stacks=op_stacks):
        before = _native._spliced_walks()
        _native_test.record_ops_nested("outer", ["inner-1", "inner-2"])
        walked = _native._spliced_walks() - before
        _native_test.record_ops_nested("outer-2", [], python_between_ops)
    assert walked == (0 if op_stacks == "outermost" else 2)
    (run,) = read_runs(out_dir)
    events = {e["name"]: e["stack_id"] for e in run.tables["events"].drop_columns(["ts"]).to_pylist()}
    assert events["inner-1"] == events["inner-2"] == events["outer"]  # one stack either way here
    # Python ran between: its own stack, with the Python function that called it innermost.
    assert events["called-from-python"] != events["outer-2"]
    code = {c["code_id"]: c for c in run.tables["code"].to_pylist()}
    stack = next(s for s in run.tables["stacks"].to_pylist() if s["stack_id"] == events["called-from-python"])
    innermost = stack["python"][0]
    assert code[innermost["code_id"]]["qualname"] == "python_between_ops"
    lines = Path(__file__).read_text().splitlines()
    assert lines[innermost["line"] - 1].rstrip().endswith("# PYTHON BETWEEN OPS")


def test_native_record_interned_path_and_no_session(out_dir: Path) -> None:
    from tbpipe import _native_test

    # Without a session both C API record paths are no-ops, as capi.h promises.
    assert not _native_test.capi_active()
    _native_test.record_with_gil_released("kernel_launch", "before", "")
    _native_test.record_interned_with_gil_released("op", "before", "")
    with capture.session(out_dir):
        assert _native_test.capi_active()
        for _ in range(2):
            _native_test.record_interned_with_gil_released("op", "aten::mm", '{"id": 1}')
        _native_test.record_interned_with_gil_released("op", "aten::add", "")
    assert not _native_test.capi_active()
    recorded = _native.counters()["recorded"]
    _native_test.record_with_gil_released("kernel_launch", "after", "")
    _native_test.record_interned_with_gil_released("op", "after", "")
    assert _native.counters()["recorded"] == recorded  # nothing buffered for nobody
    (run,) = read_runs(out_dir)
    rows = run.tables["events"].drop_columns(["ts"]).to_pylist()
    assert [(r["kind"], r["name"], r["attrs"]) for r in rows] == [
        ("op", "aten::mm", '{"id": 1}'),
        ("op", "aten::mm", '{"id": 1}'),
        ("op", "aten::add", None),
    ]
    # The caller's own frames (the test extension's) are left out, as tbpipe's are; the ones of
    # the module that called it (libpython, running this test) are kept.
    modules = {m["module_index"]: m["path"] for m in run.tables["modules"].to_pylist()}
    stacks = {s["stack_id"]: s for s in run.tables["stacks"].to_pylist()}
    innermost = stacks[rows[0]["stack_id"]]["native"][0]
    assert Path(modules[innermost["module"]]).name != Path(_native_test.__file__).name
    assert all(
        Path(modules[f["module"]]).name != Path(_native_test.__file__).name
        for f in stacks[rows[0]["stack_id"]]["native"][:3]
    )


def test_full_buffer_drops_events_but_never_their_stacks(out_dir: Path) -> None:
    def site_a():
        capture.record("user", "a")

    def site_b():
        capture.record("user", "b")

    # A long flush interval: only the explicit flush() below drains the buffer.
    with capture.session(out_dir, max_buffered_events=5, flush_interval_s=3600) as session:
        for _ in range(8):
            site_a()  # 5 kept, 3 dropped
        site_b()  # dropped, but its new stack must still be written
        session.flush()
        site_b()  # kept: refers to the stack written above
    (run,) = read_runs(out_dir)
    counters = run.manifest["counters"]
    assert counters["events_dropped"] == 4
    assert counters["events_recorded"] == 6
    events = run.tables["events"]
    assert events["name"].to_pylist() == ["a"] * 5 + ["b"]
    assert set(events["stack_id"].to_pylist()) <= set(run.tables["stacks"]["stack_id"].to_pylist())
