"""Forked children record into runs of their own, and their events reach those runs on every exit
Python lets a process hook: multiprocessing's exit routine (DataLoader workers), `os._exit`,
SystemExit through a `with capture.session()` block; a SIGKILLed child keeps what was flushed.

The DataLoader tests need PyTorch, which is only installed for some Python versions on these
machines (torch 2.13 CPU for CPython 3.11); elsewhere they skip with that reason.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TBPIPE, run_python
from support.runs import read_runs


def _runs_by_role(out_dir: Path):
    runs = read_runs(out_dir)
    parents = [r for r in runs if r.manifest["parent_run_id"] is None]
    assert len(parents) == 1, [r.manifest for r in runs]
    children = [r for r in runs if r.manifest["parent_run_id"] is not None]
    return parents[0], children


def _names(run) -> list[str]:
    events = run.tables.get("events")
    return [] if events is None else events["name"].to_pylist()


def _outermost_names(run) -> list[str]:
    """Names of the ops the program called itself: the observer also records the ops those call,
    with a `parent` attribute."""
    events = run.tables.get("events")
    if events is None:
        return []
    # The observer writes an op's attributes as op_* columns (raw schema 5 on); the dispatch mode,
    # and older parts, as JSON text in `attrs` (schemas/op_attributes.py: event_attrs_text).
    columns = [c for c in ("name", "attrs", "op_id", "op_parent") if c in events.column_names]
    return [
        r["name"]
        for r in events.select(columns).to_pylist()
        if (r["op_parent"] if r.get("op_id") is not None else json.loads(r["attrs"] or "{}").get("parent")) is None
    ]


# -- plain os.fork() -----------------------------------------------------------------------------


def test_child_ending_with_os_exit_before_any_flush_keeps_its_events(tmp_path: Path) -> None:
    # The flush interval is far longer than the child lives: only the exit can write its events.
    out_dir = tmp_path / "runs"
    code = f"""
import os
from tbpipe import capture
with capture.session({str(out_dir)!r}, flush_interval_s=60):
    capture.record("user", "parent-before")
    pid = os.fork()
    if pid == 0:
        for i in range(50):
            capture.record("user", "child", i=i)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    capture.record("user", "parent-after")
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    parent, (child,) = _runs_by_role(out_dir)
    assert child.manifest["parent_run_id"] == parent.run_id
    assert _names(child) == ["child"] * 50
    assert child.manifest["counters"]["events_written"] == 50
    assert child.complete  # os._exit is hooked: the child's run was closed cleanly
    assert sorted(_names(parent)) == ["parent-after", "parent-before"]
    assert parent.complete


def test_child_killed_after_a_flush_interval_keeps_what_was_flushed(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    code = f"""
import os, signal, time
from tbpipe import capture
with capture.session({str(out_dir)!r}, flush_interval_s=0.2):
    pid = os.fork()
    if pid == 0:
        for i in range(40):
            capture.record("user", "child", i=i)
        # Killed once a flush has written them (the first flush also loads the writer's libraries).
        run_dir = capture.active_session().run_dir
        deadline = time.monotonic() + 30
        while not list(run_dir.glob("events-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and a few flushes more
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    capture.record("user", "parent")
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    parent, (child,) = _runs_by_role(out_dir)
    assert _names(child) == ["child"] * 40
    assert not child.complete  # killed: nothing could close it
    assert not list(child.path.glob(".*.tmp"))
    assert _names(parent) == ["parent"] and parent.complete


def test_child_leaving_the_session_block_closes_its_own_run_not_the_parents(tmp_path: Path) -> None:
    # SystemExit in the child unwinds through the parent's `with` block: that must end the
    # child's run, and never write the child's events into the parent's run folder.
    out_dir = tmp_path / "runs"
    code = f"""
import os, sys, time
from tbpipe import capture
with capture.session({str(out_dir)!r}, flush_interval_s=0.1):
    capture.record("user", "parent-before")
    pid = os.fork()
    if pid == 0:
        capture.record("user", "child")
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    time.sleep(0.3)  # a few flushes of the parent after the child is gone
    capture.record("user", "parent-after")
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    parent, (child,) = _runs_by_role(out_dir)
    assert _names(child) == ["child"] and child.complete
    assert sorted(_names(parent)) == ["parent-after", "parent-before"] and parent.complete
    assert parent.manifest["counters"]["events_written"] == 2


def test_fork_while_other_threads_hold_tbpipe_locks(tmp_path: Path) -> None:
    # The child starts its run in the fork hook; the locks below are held by a parent thread
    # that does not exist in the child, which therefore must never wait for them.
    out_dir = tmp_path / "runs"
    code = f"""
import importlib, os, threading, time
from tbpipe import capture
session_module = importlib.import_module("tbpipe.capture.sessions")
torch_ops = importlib.import_module("tbpipe.capture.torch_ops")
with capture.session({str(out_dir)!r}, flush_interval_s=60) as s:
    held, release = threading.Event(), threading.Event()
    def hold():
        with session_module._active_lock, torch_ops._state.lock, s._writer._lock:
            held.set()
            release.wait()
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        capture.record("user", "child")
        os._exit(0)
    release.set()
    holder.join()
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise SystemExit("the forked child hung")
        time.sleep(0.02)
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    _, (child,) = _runs_by_role(out_dir)
    assert _names(child) == ["child"] and child.complete


def test_child_whose_last_write_is_stuck_still_exits(tmp_path: Path) -> None:
    # A child's flush thread that never gets its lock (here held on purpose; for real, a lock
    # left locked by the fork) must not keep the child from exiting: the wait is bounded.
    out_dir = tmp_path / "runs"
    code = f"""
import importlib, os, threading, time
from tbpipe import capture
session_module = importlib.import_module("tbpipe.capture.sessions")
session_module.FORKED_CLOSE_TIMEOUT_S = 0.5
with capture.session({str(out_dir)!r}, flush_interval_s=60):
    pid = os.fork()
    if pid == 0:
        capture.record("user", "child")
        threading.Thread(target=capture.active_session()._writer._lock.acquire, daemon=True).start()
        time.sleep(0.1)
        os._exit(7)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise SystemExit("the forked child hung")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 7, status
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "the last write did not finish within 0.5 s; the run stays incomplete" in result.stderr
    parent, (child,) = _runs_by_role(out_dir)
    assert not child.complete and _names(child) == []
    assert parent.complete


def test_multiprocessing_fork_workers_close_their_runs(tmp_path: Path) -> None:
    # What DataLoader workers are underneath, without torch: multiprocessing fork children,
    # which end with multiprocessing's exit routine and then os._exit.
    out_dir = tmp_path / "runs"
    code = f"""
import multiprocessing
from tbpipe import capture

def work(n):
    for i in range(n):
        capture.record("user", "work", n=n)

if __name__ == "__main__":
    with capture.session({str(out_dir)!r}, flush_interval_s=60):
        context = multiprocessing.get_context("fork")
        workers = [context.Process(target=work, args=(n,)) for n in (3, 5)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0, worker.exitcode
"""
    result = run_python(code, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    parent, children = _runs_by_role(out_dir)
    assert sorted(len(_names(c)) for c in children) == [3, 5]
    assert all(set(_names(c)) == {"work"} and c.complete for c in children)
    assert _names(parent) == [] and parent.complete


# -- torch DataLoader workers (multiprocessing fork children) -------------------------------------

DATALOADER_PROGRAM = """\
import sys
import torch
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __init__(self):
        self.data = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]  # aten::select, in whichever process loads the item


loader = DataLoader(Rows(), batch_size=4, num_workers=int(sys.argv[1]))  # default collate: torch.stack
for epoch in range(2):
    total = sum(float(batch.sum()) for batch in loader)
print("total", total, flush=True)
"""
BATCHES = 2 * 5  # two epochs of five batches
ITEMS = 2 * 20


def _torch():
    return pytest.importorskip(
        "torch",
        reason=f"PyTorch is not installed for this Python ({sys.version.split()[0]}); the torch tests need it",
    )


def _run_program(tmp_path: Path, num_workers: int) -> Path:
    script = tmp_path / "loader.py"
    script.write_text(DATALOADER_PROGRAM)
    out = tmp_path / f"runs-{num_workers}"
    result = subprocess.run(
        [
            *TBPIPE,
            "run",
            "--out",
            str(out),
            "--source",
            "torch-ops",
            "--",
            sys.executable,
            str(script),
            str(num_workers),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "total 1770.0" in result.stdout
    return out


def test_dataloader_workers_record_their_collate_ops(tmp_path: Path) -> None:
    _torch()
    (inline,) = read_runs(_run_program(tmp_path, 0))
    inline_ops = collections.Counter(_names(inline))
    # The yardstick: without workers the main process loads and collates every batch itself.
    assert inline_ops["aten::stack"] == BATCHES
    assert inline_ops["aten::select"] == ITEMS

    main, workers = _runs_by_role(_run_program(tmp_path, 2))
    # One run per worker per epoch (workers are not persistent), each linked to the main run.
    assert len(workers) == 2 * 2
    assert all(w.manifest["parent_run_id"] == main.run_id for w in workers)
    # Every worker left through multiprocessing's exit routine and os._exit: its run was closed.
    assert all(w.complete for w in workers), [w.manifest for w in workers]
    worker_ops = collections.Counter()
    for worker in workers:
        worker_ops.update(_names(worker))
        assert worker.manifest["counters"]["events_written"] == worker.tables["events"].num_rows
    # Each batch is collated exactly once, in exactly one worker: the counts are deterministic.
    assert worker_ops["aten::stack"] == inline_ops["aten::stack"]
    assert worker_ops["aten::select"] == inline_ops["aten::select"]
    main_ops = collections.Counter(_names(main))
    assert main_ops["aten::stack"] == 0 and main_ops["aten::select"] == 0


def test_fork_with_torch_ops_while_another_thread_holds_the_source_lock(tmp_path: Path) -> None:
    _torch()
    out_dir = tmp_path / "runs"
    code = f"""
import importlib, os, threading, time
import torch
from tbpipe import capture
torch_ops = importlib.import_module("tbpipe.capture.torch_ops")
with capture.session({str(out_dir)!r}, sources=["torch-ops"], flush_interval_s=60):
    held, release = threading.Event(), threading.Event()
    def hold():
        with torch_ops._state.lock:
            held.set()
            release.wait()
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        torch.ones(3).mul(2)
        os._exit(0)
    release.set()
    holder.join()
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise SystemExit("the forked child hung")
        time.sleep(0.02)
"""
    result = run_python(code, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    _, (child,) = _runs_by_role(out_dir)
    assert _outermost_names(child) == ["aten::ones", "aten::mul"] and child.complete
