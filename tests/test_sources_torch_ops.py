"""The torch-ops source's dispatch mode on real PyTorch (CPU): every aten op, forward and backward, sited
at the user's lines.

The dispatch mode is the fallback when the RecordFunction observer cannot be built; these tests
ask for it with TBPIPE_TORCH_OPS_HOOK=dispatch (the observer's tests are in
test_sources_torch_observer.py). PyTorch is only installable for some Python versions on these
machines (torch 2.13 CPU for CPython 3.11); elsewhere these tests skip with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.compute as pc
import pytest
from support.runs import read_runs

from tbpipe import capture

torch = pytest.importorskip(
    "torch", reason=f"PyTorch is not installed for this Python ({sys.version.split()[0]}); the torch-ops tests need it"
)

SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
x = torch.randn(5, 8)
out = model(x)
loss = out.square().mean()
loss.backward()
print("trained", flush=True)
"""
MODEL_LINE = SCRIPT.splitlines().index("out = model(x)") + 1
DISPATCH = {"TBPIPE_TORCH_OPS_HOOK": "dispatch"}
DISPATCH_STATUS = "recording (dispatch mode: TBPIPE_TORCH_OPS_HOOK=dispatch)"


@pytest.fixture(autouse=True)
def dispatch_hook(monkeypatch) -> None:
    monkeypatch.setenv("TBPIPE_TORCH_OPS_HOOK", "dispatch")


BACKWARD_LINE = SCRIPT.splitlines().index("loss.backward()") + 1


def events_of(run, kind: str | None = None) -> list[dict]:
    events = run.tables["events"].drop_columns(["ts"])
    if kind is not None:
        events = events.filter(pc.equal(events["kind"], kind))
    return events.to_pylist()


def innermost_frame_in(run, stack_id: int, filename: str) -> tuple[str, int] | None:
    """(qualname, line) of the innermost Python frame of `stack_id` in `filename`."""
    code = {c["code_id"]: c for c in run.tables["code"].to_pylist()}
    stacks = {s["stack_id"]: s for s in run.tables["stacks"].to_pylist()}
    for frame in stacks[stack_id]["python"]:
        info = code.get(frame["code_id"])
        if info is not None and info["filename"] == filename:
            return info["qualname"], frame["line"]
    return None


@pytest.fixture(scope="module")
def captured_script(tmp_path_factory) -> tuple[Path, Path]:
    """The acceptance workload run under `tbpipe run --source torch-ops` (torch.compile not used)."""
    work = tmp_path_factory.mktemp("torch_ops")
    script = work / "train.py"
    script.write_text(SCRIPT)
    out = work / "runs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tbpipe.pipeline",
            "run",
            "--out",
            str(out),
            "--source",
            "torch-ops",
            "--",
            sys.executable,
            str(script),
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **DISPATCH},
    )
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout
    return script, out


def test_addmm_and_backward_mm_are_sited_at_the_user_lines(captured_script) -> None:
    script, out = captured_script
    (run,) = read_runs(out)
    assert run.complete
    assert run.manifest["source_status"] == {
        "torch-ops": "recording (dispatch mode: TBPIPE_TORCH_OPS_HOOK=dispatch, from `import torch` on)"
    }
    ops = events_of(run, "op")
    addmm = [e for e in ops if e["name"] == "aten::addmm"]
    mm = [e for e in ops if e["name"] == "aten::mm"]
    assert len(addmm) == 2 and len(mm) == 3  # two Linear forwards; backward: grad_input of fc2, grad_weight of both
    for event in addmm:
        assert innermost_frame_in(run, event["stack_id"], str(script)) == ("<module>", MODEL_LINE)
    for event in mm:
        assert innermost_frame_in(run, event["stack_id"], str(script)) == ("<module>", BACKWARD_LINE)


def test_backward_ops_link_to_the_forward_op_that_made_their_node(captured_script) -> None:
    script, out = captured_script
    (run,) = read_runs(out)
    ops = events_of(run, "op")
    by_seq = {}
    for event in ops:
        attrs = json.loads(event["attrs"] or "{}")
        if "seq" in attrs:
            assert attrs["seq"] not in by_seq, "one forward op per autograd node"
            by_seq[attrs["seq"]] = event
    backward_mm = [json.loads(e["attrs"]) for e in ops if e["name"] == "aten::mm"]
    # Every backward mm links to a forward op: the two Linear layers' addmm, each its own autograd node.
    assert len(backward_mm) == 3
    addmm_seqs = {seq for seq, event in by_seq.items() if event["name"] == "aten::addmm"}
    assert len(addmm_seqs) == 2
    assert {attrs["bwd_seq"] for attrs in backward_mm} == addmm_seqs
    for attrs in backward_mm:
        assert attrs["bwd_node"] == "AddmmBackward0"
        forward = by_seq[attrs["bwd_seq"]]
        assert forward["name"] == "aten::addmm"
        # What a query does for a CUDA backward (no Python frames on the worker): site it at the forward op.
        assert innermost_frame_in(run, forward["stack_id"], str(script)) == ("<module>", MODEL_LINE)


def test_ops_carry_shapes_dtype_and_device(captured_script) -> None:
    _, out = captured_script
    (run,) = read_runs(out)
    first_addmm = next(e for e in events_of(run, "op") if e["name"] == "aten::addmm")
    attrs = json.loads(first_addmm["attrs"])
    assert attrs["shapes"] == [[16], [5, 8], [8, 16]]
    assert attrs["dtype"] == "float32" and attrs["device"] == "cpu"


def test_call_sites_view_sites_the_ops_at_the_user_lines(captured_script, tmp_path) -> None:
    from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database

    script, out = captured_script
    db = tmp_path / "sites.duckdb"
    summary = ingest_runs([out], IngestOptions(db_path=db, cache_dir=tmp_path / "symbols", progress=False))
    assert summary.ok
    con = open_database(db, read_only=True)
    try:
        rows = con.execute(
            "SELECT name, site_file, site_line, sum(events) FROM call_sites "
            "WHERE kind = 'op' AND name IN ('aten::addmm', 'aten::mm') GROUP BY ALL ORDER BY name"
        ).fetchall()
    finally:
        con.close()
    assert rows == [("aten::addmm", str(script), MODEL_LINE, 2), ("aten::mm", str(script), BACKWARD_LINE, 3)]


class CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A plain Python mode pushed above tbpipe's: it sees each op first and passes it down to ours."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def train_step(model, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()


def test_every_dispatched_op_is_recorded(out_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with capture.session(out_dir, sources=["torch-ops"]):
        with CountingMode() as counting:
            train_step(model, optimizer, x, y)
    (run,) = read_runs(out_dir)
    recorded = [e["name"] for e in events_of(run, "op")]
    assert recorded == counting.names
    assert {"aten::addmm", "aten::mm", "aten::threshold_backward", "aten::add_"} <= set(recorded)


def test_mode_leaves_with_the_session_and_ops_still_work(out_dir: Path) -> None:
    before = torch._C._len_torch_dispatch_stack()
    with capture.session(out_dir, sources=["torch-ops"]):
        assert torch._C._len_torch_dispatch_stack() == before + 1
        a = torch.ones(2, 3)
        with pytest.raises(RuntimeError):
            a @ a  # an op that raises still raises, with the mode in the way
        b = (a * 2).sum()
    assert torch._C._len_torch_dispatch_stack() == before
    assert b.item() == 12.0
    (run,) = read_runs(out_dir)
    names = [e["name"] for e in events_of(run, "op")]
    assert names == ["aten::ones", "aten::mm", "aten::mul", "aten::sum"]
    # After the session nothing is recorded and no mode is in the way.
    with capture.session(out_dir / "after"):
        torch.ones(3).relu()
    (after,) = read_runs(out_dir / "after")
    assert after.tables["events"].num_rows == 0


def test_ops_on_threads_started_during_the_session(out_dir: Path) -> None:
    def worker() -> None:
        torch.arange(6).reshape(2, 3).sum()

    with capture.session(out_dir, sources=["torch-ops"]):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    (run,) = read_runs(out_dir)
    events = events_of(run, "op")
    assert [e["name"] for e in events] == ["aten::arange", "aten::view", "aten::sum"]
    assert {e["thread_id"] for e in events} == {thread.native_id}
    assert innermost_frame_in(run, events[0]["stack_id"], __file__)[0].endswith("worker")


def test_higher_order_operator_passes_through_as_one_event(out_dir: Path) -> None:
    x = torch.randn(4)
    with capture.session(out_dir, sources=["torch-ops"]):
        result = torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))
    expected = x.sin() if x.sum() > 0 else x.cos()
    assert torch.allclose(result, expected)
    (run,) = read_runs(out_dir)
    assert "higher_order::cond" in [e["name"] for e in events_of(run, "op")]


def test_sampling_keeps_a_share_of_the_ops(out_dir: Path) -> None:
    with capture.session(out_dir, sources=["torch-ops"], sample_rate=0.25):
        for _ in range(400):
            torch.ones(2).add_(1)
    (run,) = read_runs(out_dir)
    counters = run.manifest["counters"]
    recorded, sampled_out = counters["events_recorded"], counters["events_sampled_out"]
    assert recorded + sampled_out == 800
    assert 120 <= recorded <= 290, recorded  # 200 expected; binomial sd ~12


LATE_THREAD = """
import sys, threading, time
import torch
from tbpipe import capture
done = threading.Event()
def work():
    torch.ones(3).mul(2)
    done.set()
    time.sleep(0.2)  # still running when the main thread is done: it ends while Python shuts down
session = capture.session(sys.argv[1], sources=["torch-ops"]).start()
threading.Thread(target=work).start()
done.wait(60)
session.close()
"""


def test_threads_that_end_while_python_shuts_down_do_not_abort_the_process(tmp_path: Path) -> None:
    # The mode pushed on a thread (the program's, or tbpipe's flusher) used to leave its stack in a
    # C++ thread-exit destructor that needs the GIL: during shutdown that aborted some of the runs
    # ("terminate called without an active exception").
    script = tmp_path / "late_thread.py"
    script.write_text(LATE_THREAD)
    runs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"runs{i}")],
            cwd=tmp_path,
            env={**os.environ, **DISPATCH},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    outcomes = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    assert all(code == 0 for code, _ in outcomes), outcomes
    (run,) = read_runs(tmp_path / "runs0")
    assert run.manifest["source_status"] == {"torch-ops": DISPATCH_STATUS}
    assert [e["name"] for e in events_of(run, "op")] == ["aten::ones", "aten::mul"]
