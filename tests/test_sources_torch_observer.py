"""The torch-ops source's RecordFunction observer on real PyTorch (CPU), compared with torch.profiler.

The observer is built against the installed torch (`make install` builds it; otherwise the first
test that needs it does, into the usual cache). PyTorch is only installable for some Python
versions on these machines (torch 2.13 CPU for CPython 3.11); elsewhere these tests skip with that
reason. The dispatch-mode fallback has its own tests in test_sources_torch_ops.py.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.compute as pc
import pytest
from conftest import run_python
from support.runs import read_runs, rewrite_as_raw_version

from tbpipe import _native, capture
from tbpipe.schemas.op_attributes import event_attrs_text

torch = pytest.importorskip(
    "torch", reason=f"PyTorch is not installed for this Python ({sys.version.split()[0]}); the torch-ops tests need it"
)
from torch import nn  # noqa: E402

from tbpipe.capture import torch_observer, torch_ops  # noqa: E402

OBSERVER_STATUS = "recording (RecordFunction observer)"
HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    """The line of this file that carries `# <marker>`, read from the source text."""
    lines = HERE.read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}")]
    return number


def op_events(run) -> list[dict]:
    """The run's op events, each with its attributes as the database keeps them (a dict)."""
    events = run.tables["events"].drop_columns(["ts"])
    rows = events.filter(pc.equal(events["kind"], "op")).to_pylist()
    for row in rows:
        row["attrs"] = json.loads(event_attrs_text(row) or "{}")
    return rows


def python_frames(run, stack_id: int) -> list[tuple[str, str, int]]:
    """(filename, qualname, line) of each Python frame of a stack, innermost first."""
    code = {c["code_id"]: c for c in run.tables["code"].to_pylist()}
    stacks = {s["stack_id"]: s for s in run.tables["stacks"].to_pylist()}
    return [
        (code[f["code_id"]]["filename"], code[f["code_id"]]["qualname"], f["line"]) for f in stacks[stack_id]["python"]
    ]


def innermost_here(run, stack_id: int) -> tuple[str, int] | None:
    """(qualname, line) of the innermost Python frame of this test file in a stack."""
    for filename, qualname, line in python_frames(run, stack_id):
        if filename == str(HERE):
            return qualname, line
    return None


@pytest.fixture(scope="module", autouse=True)
def observer_built() -> None:
    """The observer for this torch, built once if the cache does not have it (about 10 s of CPU)."""
    torch_observer.library(torch, quiet=True)


@pytest.fixture(autouse=True)
def default_hook(monkeypatch) -> None:
    monkeypatch.delenv(torch_ops.HOOK_ENV, raising=False)


def make_conv_adam():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    return step


def profiler_entries(step) -> list:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return list(profile.events())


def observed_entries(step, out_dir: Path) -> list[dict]:
    with capture.session(out_dir, sources=["torch-ops"]):
        step()
    (run,) = read_runs(out_dir)
    assert run.manifest["source_status"] == {"torch-ops": OBSERVER_STATUS}
    return op_events(run)


def test_every_op_the_profiler_sees_is_recorded_with_the_same_names_and_counts(out_dir: Path) -> None:
    step = make_conv_adam()
    step()  # Adam makes its state on the first step: both sides see steady-state steps
    profiled = collections.Counter(entry.name for entry in profiler_entries(step))
    observed = collections.Counter(event["name"] for event in observed_entries(step, out_dir))
    # Nothing excluded on either side: the profiler's CPU activity lists exactly the RecordFunction
    # ranges of the step (ops, autograd nodes, the engine's ranges, the optimizer's user scopes).
    assert observed == profiled
    assert observed["aten::convolution"] == 1 and observed["ConvolutionBackward0"] == 1
    assert observed["Optimizer.step#Adam.step"] == 1
    assert sum(observed.values()) > 100


def test_ops_nest_as_the_profiler_nests_them(out_dir: Path) -> None:
    step = make_conv_adam()
    step()
    profiled = collections.Counter(
        (entry.cpu_parent.name if entry.cpu_parent is not None else None, entry.name)
        for entry in profiler_entries(step)
    )
    events = observed_entries(step, out_dir)
    by_id = {(e["thread_id"], e["attrs"]["id"]): e for e in events}
    observed = collections.Counter(
        (by_id[(e["thread_id"], e["attrs"]["parent"])]["name"] if "parent" in e["attrs"] else None, e["name"])
        for e in events
    )
    assert observed == profiled
    for event in events:
        parent = by_id.get((event["thread_id"], event["attrs"].get("parent")))
        expected_depth = 0 if parent is None else parent["attrs"]["depth"] + 1
        assert event["attrs"]["depth"] == expected_depth


def python_function_inside_an_op(x):
    return torch.sin(x) * 2  # INSIDE CUSTOM FUNCTION


class CallsPythonInside(torch.autograd.Function):
    """Ops called from Python inside another op's range (the Function's own): their Python frames
    go further than the enclosing op's."""

    @staticmethod
    def forward(ctx, x):
        return python_function_inside_an_op(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_ops_inside_ops_have_the_same_stacks_as_a_full_walk_gives(out_dir: Path) -> None:
    # Ops nested in an op take the outer part of their stack from the enclosing op's event instead
    # of walking it again; the stacks (content hashes of every frame) must not change.
    step = make_conv_adam()
    step()
    x = torch.randn(3, requires_grad=True)

    def workload() -> None:
        step()
        CallsPythonInside.apply(x).sum().backward()

    workload()  # x.grad is made on the first backward and added to after: run the same ops each time
    recorded = {}
    try:
        for splicing in (False, True):
            _native._set_splicing(splicing)
            before = _native._spliced_walks()
            with capture.session(out_dir / str(splicing), sources=["torch-ops"]):
                workload()
            spliced = _native._spliced_walks() - before
            (run,) = read_runs(out_dir / str(splicing))
            recorded[splicing] = (collections.Counter((e["name"], e["stack_id"]) for e in op_events(run)), run)
            assert (spliced > 100) == splicing, spliced
    finally:
        _native._set_splicing(True)
    assert recorded[True][0] == recorded[False][0]
    run = recorded[True][1]
    (sin,) = [e for e in op_events(run) if e["name"] == "aten::sin"]
    assert innermost_here(run, sin["stack_id"]) == ("python_function_inside_an_op", line_of("INSIDE CUSTOM FUNCTION"))


def leaf_op(x):
    return torch.relu(x)  # LEAF OP


def through_first(x):
    return leaf_op(x)  # FIRST CALLER


def through_second(x):
    return leaf_op(x)  # SECOND CALLER


class BackwardInPython(torch.autograd.Function):
    """A node whose backward is Python: autograd's engine runs it between its C++ nodes."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return through_second(grad) + through_first(grad)


CALLERS = [through_first, through_second, through_second, through_first]


def changing_stack_workload():
    """Inside one C call the Python stack changes between ops: map() calls Python that calls the
    same op through two functions in turn (leaf_op's frame lies where it lay before, its caller
    another), and autograd's engine runs a Python backward between C++ nodes. The first layer's
    backward computes no input gradient, the second's does: one C++ function calls aten::mm from
    other lines, at the same place among the ops of nodes of one name and stack."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)

    def workload(times: int) -> None:
        for _ in range(times):
            list(map(lambda call: call(x), CALLERS))
            BackwardInPython.apply(torch.sin(x)).sum().backward()
            model(x.detach()).sum().backward()

    return workload


def walked_and_reused(out_dir: Path, workload, times: int, **options) -> dict:
    """The runs of `workload(times)` with every stack walked (False) and with stacks reused (True),
    recorded from the same line."""
    runs = {}
    try:
        for reuse in (False, True):
            _native._set_stack_reuse(reuse)
            with capture.session(out_dir / str(reuse), sources=["torch-ops"], **options):
                workload(times)
            (runs[reuse],) = read_runs(out_dir / str(reuse))
    finally:
        _native._set_stack_reuse(True)
    return runs


def test_reused_stacks_are_the_stacks_a_walk_gives(out_dir: Path) -> None:
    workload = changing_stack_workload()

    # Gradients are made on the first backward and added to after; CPython specializes the calls
    # it runs often, which changes the C frames under them: run until all that has happened.
    workload(100)
    runs = walked_and_reused(out_dir, workload, 8)
    walked, reused = ([(e["name"], e["stack_id"]) for e in op_events(runs[r])] for r in (False, True))
    assert reused == walked
    counters = runs[True].manifest["counters"]
    assert counters["stacks_reused"] > len(reused) // 2
    assert counters["stacks_reuse_mismatched"] >= 1  # the place that holds two stacks was met
    assert runs[False].manifest["counters"]["stacks_reused"] == 0
    # The leaf's stacks name the caller each op had, in the order the calls came.
    first_map = [e for e in op_events(runs[True]) if e["name"] == "aten::relu"][: len(CALLERS)]
    assert [python_frames(runs[True], e["stack_id"])[1][1:] for e in first_map] == [
        (call.__name__, line_of("FIRST CALLER" if call is through_first else "SECOND CALLER")) for call in CALLERS
    ]


def test_reused_stacks_at_a_sample_rate_below_1_are_stacks_a_walk_gives(out_dir: Path) -> None:
    # With torch drawing the ops, the ops recorded inside an op are a random few of those it calls:
    # their order among them is not part of their place, and the place that holds two stacks
    # (aten::mm from two lines of one C++ function) must still give each op its own.
    workload = changing_stack_workload()

    workload(100)
    # At the same rate: torch runs a drawn op's callbacks from other frames than at rate 1.
    runs = walked_and_reused(out_dir, workload, 40, sample_rate=0.5)
    walked, drawn = runs[False], runs[True]
    every_walk = {(e["name"], e["stack_id"]) for e in op_events(walked)}
    recorded = [(e["name"], e["stack_id"]) for e in op_events(drawn)]
    # Each op recorded has a stack that a walk gave an op of its name: every aten::mm (the place of
    # two stacks), and all but the odd op whose stack is rare enough to be drawn in one run only (two
    # walks differ by a few aten::empty stacks).
    unknown = [event for event in recorded if event not in every_walk]
    assert len(unknown) <= len(recorded) // 100, unknown
    assert [event for event in unknown if event[0] == "aten::mm"] == []
    assert sum(name == "aten::mm" for name, _ in recorded) > 20
    counters = drawn.manifest["counters"]
    assert counters["stacks_reused"] > len(recorded) // 2, counters


def linear_layer_step(layer, x):
    return layer(x).sum()  # LINEAR CALL


def test_composite_ops_contain_the_ops_they_call_at_the_users_line(out_dir: Path) -> None:
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with capture.session(out_dir, sources=["torch-ops"]):
        linear_layer_step(layer, x)
    (run,) = read_runs(out_dir)
    events = op_events(run)
    (linear,) = [e for e in events if e["name"] == "aten::linear"]
    children = [e["name"] for e in events if e["attrs"].get("parent") == linear["attrs"]["id"]]
    assert children == ["aten::t", "aten::addmm"]  # as called: the composite op, then its decomposition
    assert linear["attrs"]["depth"] == 0
    for event in [linear] + [e for e in events if e["attrs"].get("parent") == linear["attrs"]["id"]]:
        assert innermost_here(run, event["stack_id"]) == ("linear_layer_step", line_of("LINEAR CALL"))
    # The stack leaves out the observer's own callback frames: innermost is torch's RecordFunction.
    modules = {m["module_index"]: m["path"] for m in run.tables["modules"].to_pylist()}
    stack = next(s for s in run.tables["stacks"].to_pylist() if s["stack_id"] == linear["stack_id"])
    assert "_tbpipe_torch_observer" not in modules[stack["native"][0]["module"]]


def test_outermost_op_stacks_give_nested_ops_their_enclosing_ops_stack_where_no_python_ran(out_dir: Path) -> None:
    layer = nn.Linear(4, 3)
    x, y = torch.randn(2, 4), torch.randn(3, requires_grad=True)

    def workload() -> None:
        linear_layer_step(layer, x)
        CallsPythonInside.apply(y)

    workload()
    runs = {}
    for op_stacks in ("own", "outermost"):
        with capture.session(out_dir / op_stacks, sources=["torch-ops"], op_stacks=op_stacks):
            workload()
        (runs[op_stacks],) = read_runs(out_dir / op_stacks)
    own, outermost = runs["own"], runs["outermost"]
    assert outermost.manifest["capture"]["op_stacks"] == "outermost"
    # The same ops, nested the same way.
    own_events, outer_events = op_events(own), op_events(outermost)
    assert [(e["name"], e["attrs"]["depth"]) for e in outer_events] == [
        (e["name"], e["attrs"]["depth"]) for e in own_events
    ]
    (linear,) = [e for e in outer_events if e["name"] == "aten::linear"]
    inside_linear = [e for e in outer_events if e["attrs"].get("parent") == linear["attrs"]["id"]]
    assert [e["name"] for e in inside_linear] == ["aten::t", "aten::addmm"]
    # Nested in aten::linear with no Python between: its stack, where it was called from.
    assert {e["stack_id"] for e in inside_linear} == {linear["stack_id"]}
    (own_linear,) = [e for e in own_events if e["name"] == "aten::linear"]
    assert all(
        e["stack_id"] != own_linear["stack_id"]
        for e in own_events
        if e["attrs"].get("parent") == own_linear["attrs"]["id"]
    )
    # Called from Python inside the Function's range: a stack of its own, at its own line.
    (sin,) = [e for e in outer_events if e["name"] == "aten::sin"]
    assert innermost_here(outermost, sin["stack_id"]) == (
        "python_function_inside_an_op",
        line_of("INSIDE CUSTOM FUNCTION"),
    )
    # Every op at the same line of this file either way, with fewer stacks gathered.
    for own_event, outer_event in zip(own_events, outer_events):
        assert innermost_here(outermost, outer_event["stack_id"]) == innermost_here(own, own_event["stack_id"])
    outer_stacks = {e["stack_id"] for e in outer_events}
    assert len(outer_stacks) < len({e["stack_id"] for e in own_events})
    assert outer_stacks <= set(outermost.tables["stacks"]["stack_id"].to_pylist())


def test_outermost_op_stacks_gather_every_stack_without_the_python_half(out_dir: Path) -> None:
    # Without Python frames the recorder cannot tell whether Python ran between two ops: it walks.
    layer, x = nn.Linear(4, 3), torch.randn(2, 4)
    with capture.session(out_dir, sources=["torch-ops"], op_stacks="outermost", python=False):
        linear_layer_step(layer, x)
    (run,) = read_runs(out_dir)
    events = op_events(run)
    (linear,) = [e for e in events if e["name"] == "aten::linear"]
    inside = [e for e in events if e["attrs"].get("parent") == linear["attrs"]["id"]]
    assert [e["name"] for e in inside] == ["aten::t", "aten::addmm"]
    assert all(e["stack_id"] != linear["stack_id"] for e in inside)


def test_op_stacks_must_be_a_known_setting(out_dir: Path) -> None:
    with pytest.raises(capture.SessionError, match="op_stacks must be one of own, outermost, not 'inner'"):
        capture.Session(out_dir, sources=["torch-ops"], op_stacks="inner")


def test_ops_on_fake_tensors_are_not_recorded(out_dir: Path) -> None:
    # torch.compile traces a model's ops on fake tensors; that is not work of the program's.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with capture.session(out_dir, sources=["torch-ops"]):
        with FakeTensorMode():
            torch.ones(2, 3).relu().sum()
        torch.ones(2).neg()
    (run,) = read_runs(out_dir)
    events = op_events(run)
    assert [e["name"] for e in events if e["attrs"]["depth"] == 0] == ["aten::ones", "aten::neg"]
    assert "aten::relu" not in {e["name"] for e in events}


def worker_ops(ready: threading.Event, go: threading.Event) -> None:
    ready.set()
    go.wait(30)
    torch.arange(6).reshape(2, 3).sum()  # WORKER OPS


def test_ops_on_a_thread_started_before_the_source(out_dir: Path) -> None:
    ready, go = threading.Event(), threading.Event()
    thread = threading.Thread(target=worker_ops, args=(ready, go))
    thread.start()
    assert ready.wait(30)
    with capture.session(out_dir, sources=["torch-ops"]):
        go.set()
        thread.join(30)
    (run,) = read_runs(out_dir)
    events = [e for e in op_events(run) if e["thread_id"] == thread.native_id]
    outermost = [e["name"] for e in events if e["attrs"]["depth"] == 0]
    assert outermost == ["aten::arange", "aten::reshape", "aten::sum"]
    assert len(events) > len(outermost)  # and what those called, nested
    for event in events:
        assert innermost_here(run, event["stack_id"]) == ("worker_ops", line_of("WORKER OPS"))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x):
        hidden = torch.relu(self.first(x))  # FIRST LAYER
        return self.second(hidden)  # SECOND LAYER


def two_layer_training_step(model, x, y) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # BACKWARD CALL


def test_backward_ops_link_to_their_forward_op_by_sequence_number_and_thread(out_dir: Path) -> None:
    torch.manual_seed(0)
    model, x, y = TwoLayers(), torch.randn(4, 6), torch.randn(4, 3)
    with capture.session(out_dir, sources=["torch-ops"]):
        two_layer_training_step(model, x, y)
    (run,) = read_runs(out_dir)
    events = op_events(run)
    forward = {}
    for event in events:  # the last op recorded with a number made the node
        if "seq" in event["attrs"]:
            forward[(event["attrs"]["seq_thread"], event["attrs"]["seq"])] = event
    nodes = [e for e in events if e["attrs"].get("scope") == "backward" and "bwd_seq" in e["attrs"]]
    addmm_nodes = [n for n in nodes if n["name"] == "AddmmBackward0"]
    assert len(addmm_nodes) == 2
    lines = set()
    for node in addmm_nodes:
        made_by = forward[(node["attrs"]["fwd_thread"], node["attrs"]["bwd_seq"])]
        assert made_by["name"] == "aten::addmm"
        lines.add(innermost_here(run, made_by["stack_id"]))
        inside = [e for e in events if e["attrs"].get("parent") == node["attrs"]["id"]]
        assert {e["name"] for e in inside} >= {"aten::mm"}
        assert all(e["attrs"]["bwd_seq"] == node["attrs"]["bwd_seq"] for e in inside)
        assert all(e["attrs"]["bwd_node"] == "AddmmBackward0" for e in inside)
    assert lines == {("TwoLayers.forward", line_of("FIRST LAYER")), ("TwoLayers.forward", line_of("SECOND LAYER"))}


def test_sampled_backward_ops_keep_their_forward_op(out_dir: Path) -> None:
    """At a sample rate below 1 (torch drawing the ops), the drawn ops carry no nesting, and those
    inside a backward node still name it and its forward op, though the node itself was not drawn."""
    torch.manual_seed(0)
    model, x, y = TwoLayers(), torch.randn(4, 6), torch.randn(4, 3)
    with capture.session(out_dir, sources=["torch-ops"], sample_rate=0.3):
        for _ in range(200):
            two_layer_training_step(model, x, y)
    (run,) = read_runs(out_dir)
    events = op_events(run)
    assert events and not any("depth" in e["attrs"] or "parent" in e["attrs"] for e in events)
    mm_in_backward = [e for e in events if e["name"] == "aten::mm" and e["attrs"].get("bwd_node") == "AddmmBackward0"]
    # Two AddmmBackward0 nodes a step, each running aten::mm (one or two): about 0.3 of 400+ drawn.
    assert len(mm_in_backward) >= 60, len(mm_in_backward)
    forward = {(e["attrs"]["seq_thread"], e["attrs"]["seq"]): e for e in events if "seq" in e["attrs"]}
    linked = [forward.get((e["attrs"]["fwd_thread"], e["attrs"]["bwd_seq"])) for e in mm_in_backward]
    # The forward op drawn too (about 0.3 of them) is the addmm that made the node.
    assert {f["name"] for f in linked if f is not None} == {"aten::addmm"}


def ingest(out_dir: Path, tmp_path: Path) -> Path:
    """The runs under `out_dir` ingested into a new database."""
    from tbpipe.pipeline.db import IngestOptions, ingest_runs

    db = tmp_path / f"{out_dir.name}.duckdb"
    summary = ingest_runs([out_dir], IngestOptions(db_path=db, cache_dir=tmp_path / "symbols", progress=False))
    assert summary.ok
    return db


def query(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    from tbpipe.pipeline.db import open_database

    con = open_database(db, read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def two_layer_step_database(out_dir: Path, tmp_path: Path, op_stacks: str = "own") -> Path:
    """One training step of TwoLayers recorded and ingested."""
    torch.manual_seed(0)
    model, x, y = TwoLayers(), torch.randn(4, 6), torch.randn(4, 3)
    with capture.session(out_dir, sources=["torch-ops"], op_stacks=op_stacks):
        two_layer_training_step(model, x, y)
    return ingest(out_dir, tmp_path)


@pytest.mark.parametrize("op_stacks", ["own", "outermost"])
def test_backward_ops_are_sited_at_the_forward_line_in_the_database(
    out_dir: Path, tmp_path: Path, op_stacks: str
) -> None:
    db = two_layer_step_database(out_dir, tmp_path, op_stacks)
    rows = query(
        db,
        """
        SELECT name, bwd_node, site_file, site_line, forward_name, forward_site_function, forward_site_file,
               forward_site_line
        FROM backward_op_sites
        WHERE name IN ('aten::mm', 'aten::threshold_backward')
        ORDER BY forward_site_line, name
        """,
    )
    counted = query(
        db,
        """
        SELECT forward_site_line, sum(events) FROM backward_call_sites
        WHERE kind = 'op' AND name = 'aten::mm' GROUP BY ALL ORDER BY ALL
        """,
    )
    first, second, backward = line_of("FIRST LAYER"), line_of("SECOND LAYER"), line_of("BACKWARD CALL")
    # Each backward op: its own site where backward() ran, its forward site where its layer ran.
    # The first layer's input needs no gradient: one mm (its weight's); the second layer two.
    here = str(HERE)
    assert rows == [
        ("aten::mm", "AddmmBackward0", here, backward, "aten::addmm", "TwoLayers.forward", here, first),
        ("aten::threshold_backward", "ReluBackward0", here, backward, "aten::relu", "TwoLayers.forward", here, first),
        ("aten::mm", "AddmmBackward0", here, backward, "aten::addmm", "TwoLayers.forward", here, second),
        ("aten::mm", "AddmmBackward0", here, backward, "aten::addmm", "TwoLayers.forward", here, second),
    ]
    assert counted == [(first, 1), (second, 2)]


def test_op_attributes_load_alike_from_raw_schema_4_and_5(out_dir: Path, tmp_path: Path) -> None:
    # Raw schema 5 keeps an op's attributes in columns of their own, 4 and older as JSON text. A run
    # ingested as it was written, and a copy of it rewritten as version 4 ingested beside another
    # run of version 5 (parts of both versions in one load): the same attributes in the same text.
    torch.manual_seed(0)
    model, x, y = TwoLayers(), torch.randn(4, 6), torch.randn(4, 3)
    for name in ("written", "other"):
        with capture.session(out_dir / name, sources=["torch-ops"]):
            two_layer_training_step(model, x, y)
    (written,) = read_runs(out_dir / "written")
    assert written.tables["events"]["attrs"].null_count == written.tables["events"].num_rows
    old = out_dir / "mixed" / written.path.name
    shutil.copytree(written.path, old)
    rewrite_as_raw_version(old, 4)
    (other,) = read_runs(out_dir / "other")
    shutil.copytree(other.path, out_dir / "mixed" / other.path.name)
    sql = "SELECT attrs FROM events WHERE run_id = ? ORDER BY event_id"
    as_written = query(ingest(out_dir / "written", tmp_path), sql, [written.run_id])
    as_version_4 = query(ingest(out_dir / "mixed", tmp_path), sql, [written.run_id])
    assert len(as_written) > 50 and as_version_4 == as_written
    # The observer's keys, in its order, absent ones left out.
    mm = [json.loads(text) for (text,) in as_written if '"bwd_node":"AddmmBackward0"' in text]
    assert mm and all(list(attrs)[:3] == ["id", "depth", "parent"] and "seq" not in attrs for attrs in mm)


@pytest.mark.parametrize("op_stacks", ["own", "outermost"])
def test_show_says_whose_stack_an_op_called_by_an_op_has(out_dir: Path, tmp_path: Path, op_stacks: str) -> None:
    from typer.testing import CliRunner

    from tbpipe.pipeline import cli

    layer, x, y = nn.Linear(4, 3), torch.randn(2, 4), torch.randn(3, requires_grad=True)
    with capture.session(out_dir, sources=["torch-ops"], op_stacks=op_stacks):
        linear_layer_step(layer, x)
        CallsPythonInside.apply(y)
    db = ingest(out_dir, tmp_path)
    names = ("aten::linear", "aten::addmm", "aten::sin", "CallsPythonInside")
    events = dict(query(db, "SELECT name, event_id FROM events WHERE list_contains(?, name)", [list(names)]))
    assert set(events) == set(names)
    shown = {
        name: CliRunner().invoke(cli.app, ["show", "--db", str(db), "--event", str(event_id)], env={"COLUMNS": "250"})
        for name, event_id in events.items()
    }
    assert all(result.exit_code == 0 for result in shown.values()), shown
    shared, own_stack = "it has that op's stack", "so it has a stack of its own"
    # Called from Python: no calling op.
    assert "# called by op" not in shown["aten::linear"].output
    assert "# called by op" not in shown["CallsPythonInside"].output
    # Inside aten::linear with no Python between: with outermost, linear's stack, and show says so.
    linear = f"(event {events['aten::linear']}, aten::linear)"
    assert (linear in shown["aten::addmm"].output and shared in shown["aten::addmm"].output) == (
        op_stacks == "outermost"
    )
    assert own_stack not in shown["aten::addmm"].output
    # Called from Python inside the Function's range: its own stack either way.
    function = f"(event {events['CallsPythonInside']}, CallsPythonInside)"
    assert (function in shown["aten::sin"].output and own_stack in shown["aten::sin"].output) == (
        op_stacks == "outermost"
    )
    assert shared not in shown["aten::sin"].output
    assert f"{HERE}:{line_of('LINEAR CALL')}:linear_layer_step" in shown["aten::addmm"].output
    assert f"{HERE}:{line_of('INSIDE CUSTOM FUNCTION')}:python_function_inside_an_op" in shown["aten::sin"].output
    if op_stacks == "outermost":  # the service's event API says the same
        import httpx
        from support.serve import Server, environment

        with Server(db, env=environment(tmp_path / "symbols")) as server:
            calling = {
                name: httpx.get(f"{server.url}/api/events/{events[name]}", timeout=60).json()["calling_op"]
                for name in ("aten::linear", "aten::addmm", "aten::sin")
            }
        assert calling["aten::linear"] is None
        assert calling["aten::addmm"]["event_id"] == events["aten::linear"]
        assert calling["aten::addmm"]["name"] == "aten::linear" and calling["aten::addmm"]["shares_stack"] is True
        assert calling["aten::sin"]["event_id"] == events["CallsPythonInside"]
        assert calling["aten::sin"]["shares_stack"] is False


def test_show_prints_the_forward_ops_traceback_of_a_backward_op(out_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tbpipe.pipeline import cli

    db = two_layer_step_database(out_dir, tmp_path)
    ((mm_event, forward_event),) = query(
        db,
        "SELECT event_id, forward_event_id FROM backward_op_sites WHERE name = 'aten::mm' AND forward_site_line = ?",
        [line_of("FIRST LAYER")],
    )
    ((addmm_event,),) = query(db, "SELECT min(event_id) FROM events WHERE name = 'aten::addmm'")

    def show(*args: str):
        return CliRunner().invoke(cli.app, ["show", "--db", str(db), *args], env={"COLUMNS": "250"})

    first = f"{HERE}:{line_of('FIRST LAYER')}:TwoLayers.forward"
    forward = show("--event", str(mm_event), "--site-of", "forward")
    assert forward.exit_code == 0, forward.output
    head = forward.stdout.splitlines()
    assert head[0] == f"# event {mm_event}: op aten::mm"
    assert head[1].startswith("# ran in the backward of AddmmBackward0 (sequence number ")
    assert head[1].endswith(f"sited at its forward op, event {forward_event} aten::addmm, at {first}")
    assert first in head[3:]  # the forward op's traceback
    own = show("--event", str(mm_event))
    assert own.exit_code == 0, own.output
    assert first not in own.stdout
    assert f"{HERE}:{line_of('BACKWARD CALL')}:two_layer_training_step" in own.stdout.splitlines()
    not_backward = show("--event", str(addmm_event), "--site-of", "forward")
    assert not_backward.exit_code != 0
    assert "did not run in autograd's backward" in str(not_backward.exception)


def test_report_counts_backward_work_at_the_forward_line_on_request(out_dir: Path, tmp_path: Path) -> None:
    from tbpipe.pipeline.db import open_database
    from tbpipe.pipeline.reports.regression import ReportRequest, compare

    torch.manual_seed(0)
    model, x, y = TwoLayers(), torch.randn(4, 6), torch.randn(4, 3)
    for steps in (1, 2):  # the candidate does twice the baseline's work
        with capture.session(out_dir, labels={"steps": str(steps)}, sources=["torch-ops"]):
            for _ in range(steps):
                two_layer_training_step(model, x, y)
    baseline, candidate = sorted(read_runs(out_dir), key=lambda run: run.manifest["labels"]["steps"])
    db = ingest(out_dir, tmp_path)
    con = open_database(db, read_only=True)
    try:
        reports = {
            site_of: compare(
                con,
                ReportRequest(
                    candidate=candidate.manifest["run_id"],
                    baseline=baseline.manifest["run_id"],
                    kinds=("op",),
                    site_of=site_of,
                    tracebacks=1000,  # every flagged site's (every op doubled)
                ),
            )
            for site_of in ("own", "forward")
        }
    finally:
        con.close()

    def mm_sites(report) -> dict:
        return {
            (s.site_function, s.site_line): (s.baseline_events, s.candidate_events, s.change)
            for s in report.sites
            if s.name == "aten::mm"
        }

    first, second, backward = line_of("FIRST LAYER"), line_of("SECOND LAYER"), line_of("BACKWARD CALL")
    assert mm_sites(reports["own"]) == {("two_layer_training_step", backward): (3.0, 6.0, "increased")}
    assert mm_sites(reports["forward"]) == {
        ("TwoLayers.forward", first): (1.0, 2.0, "increased"),
        ("TwoLayers.forward", second): (2.0, 4.0, "increased"),
    }
    # Forward ops are where they are either way; the flagged backward site's traceback is its forward op's.
    (addmm,) = [s for s in reports["forward"].sites if s.name == "aten::addmm" and s.site_line == first]
    assert (addmm.baseline_events, addmm.candidate_events) == (1.0, 2.0)
    (mm_first,) = [s for s in reports["forward"].sites if s.name == "aten::mm" and s.site_line == first]
    assert mm_first.flagged
    assert any(f.file == str(HERE) and f.line == first for f in mm_first.traceback)
    assert reports["forward"].to_json()["site_of"] == "forward"


class ScaleWithLaunch(torch.autograd.Function):
    """A Python autograd function whose backward records a `kernel_launch` through the C API, as a
    native source records one from the thread running the backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        from tbpipe import _native_test

        _native_test.record_with_gil_released("kernel_launch", "fake_scale_backward_kernel", '{"grid": [1, 1, 1]}')
        return grad * 2


def scaled_forward(x):
    return ScaleWithLaunch.apply(x).sum()  # SCALE FORWARD


def test_a_launch_inside_a_backward_op_is_sited_at_its_forward_line(out_dir: Path, tmp_path: Path) -> None:
    x = torch.randn(3, requires_grad=True)
    with capture.session(out_dir, sources=["torch-ops"]):
        scaled_forward(x).backward()
    rows = query(
        ingest(out_dir, tmp_path),
        """
        SELECT b.kind, b.name, b.bwd_node, o.name, b.forward_name, b.forward_site_function, b.forward_site_line
        FROM backward_op_sites b JOIN events o ON o.event_id = b.op_event_id
        WHERE b.kind = 'kernel_launch'
        """,
    )
    assert rows == [
        (
            "kernel_launch",
            "fake_scale_backward_kernel",
            "ScaleWithLaunchBackward",
            "ScaleWithLaunchBackward",
            "ScaleWithLaunch",
            "scaled_forward",
            line_of("SCALE FORWARD"),
        )
    ]


def test_session_stop_removes_the_callback_and_a_new_session_adds_it_again(out_dir: Path) -> None:
    observer = torch_observer.load(torch)
    with capture.session(out_dir / "first", sources=["torch-ops"]):
        assert observer.registered()
        torch.ones(2).relu()
    assert not observer.registered()
    torch.ones(2).relu()  # after the session: no callback runs
    with capture.session(out_dir / "plain"):
        torch.ones(2).relu()  # a session without the source records no ops
    with capture.session(out_dir / "second", sources=["torch-ops"]):
        assert observer.registered()
        torch.zeros(2).neg()
    assert not observer.registered()
    (first,) = read_runs(out_dir / "first")
    (plain,) = read_runs(out_dir / "plain")
    (second,) = read_runs(out_dir / "second")
    assert [e["name"] for e in op_events(first) if e["attrs"]["depth"] == 0] == ["aten::ones", "aten::relu"]
    assert plain.tables["events"].num_rows == 0
    assert [e["name"] for e in op_events(second) if e["attrs"]["depth"] == 0] == ["aten::zeros", "aten::neg"]


def test_an_op_that_raises_still_raises_and_nesting_recovers(out_dir: Path) -> None:
    a = torch.ones(2, 3)
    with capture.session(out_dir, sources=["torch-ops"]):
        with pytest.raises(RuntimeError):
            a @ a
        b = (a * 2).sum()
    assert b.item() == 12.0
    (run,) = read_runs(out_dir)
    outermost = [e["name"] for e in op_events(run) if e["attrs"]["depth"] == 0]
    assert outermost == ["aten::matmul", "aten::mul", "aten::sum"]


def test_sampling_and_the_per_stack_limit_apply_to_observed_ops(out_dir: Path) -> None:
    a = torch.ones(2)

    def ops() -> None:
        for _ in range(300):
            a.add_(1)

    with capture.session(out_dir / "all", sources=["torch-ops"]):
        ops()
    (everything,) = read_runs(out_dir / "all")
    total = everything.manifest["counters"]["events_recorded"]
    assert total >= 300 and everything.manifest["counters"]["events_sampled_out"] == 0

    with capture.session(out_dir / "sampled", sources=["torch-ops"], sample_rate=0.25):
        ops()
    (sampled,) = read_runs(out_dir / "sampled")
    counters = sampled.manifest["counters"]
    # Torch's sampler draws the ops: those left out never reach the observer, nor its counters.
    assert counters["events_sampled_out"] == 0
    assert 0.15 * total <= counters["events_recorded"] <= 0.35 * total, counters
    assert "ops drawn by torch at rate 0.25" in sampled.manifest["source_status"]["torch-ops"]

    with capture.session(out_dir / "limited", sources=["torch-ops"], max_events_per_stack_per_s=3):
        ops()
    (limited,) = read_runs(out_dir / "limited")
    counters = limited.manifest["counters"]
    stacks = len({e["stack_id"] for e in op_events(everything)})
    assert counters["events_recorded"] + counters["events_rate_limited"] == total
    assert counters["events_recorded"] <= 3 * stacks * 2  # at most two one-second windows in this test


FORK_SCRIPT = """
import json, os, sys, time
import torch
from tbpipe import capture
with capture.session(sys.argv[1], sources=["torch-ops"]):
    torch.ones(2).relu()
    pid = os.fork()
    if pid == 0:
        torch.ones(3).mul(2)
        os._exit(0)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise SystemExit("the forked child hung")
        time.sleep(0.02)
    torch.zeros(2).neg()
"""


def test_a_forked_child_records_its_ops_with_the_observer(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    runs = read_runs(out)
    (parent,) = [r for r in runs if r.manifest["parent_run_id"] is None]
    (child,) = [r for r in runs if r.manifest["parent_run_id"] is not None]
    for run in (parent, child):
        assert run.complete and run.manifest["source_status"] == {"torch-ops": OBSERVER_STATUS}
    assert [e["name"] for e in op_events(parent) if e["attrs"]["depth"] == 0] == [
        "aten::ones",
        "aten::relu",
        "aten::zeros",
        "aten::neg",
    ]
    assert [e["name"] for e in op_events(child) if e["attrs"]["depth"] == 0] == ["aten::ones", "aten::mul"]


def test_a_forked_child_without_a_session_records_nothing(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    script = tmp_path / "fork_stop.py"
    script.write_text(FORK_SCRIPT.replace('sources=["torch-ops"]', 'sources=["torch-ops"], on_fork="stop"'))
    result = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    (parent,) = read_runs(out)  # the child made no run of its own
    assert [e["name"] for e in op_events(parent) if e["attrs"]["depth"] == 0] == [
        "aten::ones",
        "aten::relu",
        "aten::zeros",
        "aten::neg",
    ]


TRAIN_SCRIPT = """
import json, sys
import torch
from tbpipe import capture
model = torch.nn.Linear(4, 2)
with capture.session(sys.argv[1], sources=["torch-ops"]) as session:
    model(torch.randn(3, 4)).sum().backward()
print(json.dumps(session._writer.manifest["source_status"]))
"""


def run_training_script(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / f"runs-{len(list(tmp_path.glob('runs-*')))}"
    result = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return result, read_runs(out)


def test_falls_back_to_the_dispatch_mode_when_the_observer_cannot_be_built(tmp_path: Path) -> None:
    # An empty cache (nothing built yet) and a compiler that does not exist.
    env = {"TBPIPE_CACHE_DIR": str(tmp_path / "cache"), "CXX": "/nonexistent/g++"}
    result, (run,) = run_training_script(tmp_path, env)
    status = "recording (dispatch mode: no C++ compiler to build the observer: CXX=/nonexistent/g++ not found)"
    assert run.manifest["source_status"] == {"torch-ops": status}
    assert "tbpipe: torch-ops: using the dispatch mode (slower): no C++ compiler" in result.stderr
    names = [e["name"] for e in op_events(run)]
    assert "aten::addmm" in names and "aten::linear" not in names  # the dispatch mode sees linear decomposed
    assert not (tmp_path / "cache" / "torch-observer").exists() or not list(
        (tmp_path / "cache" / "torch-observer").glob("*/_tbpipe_torch_observer*")
    )


def test_first_use_builds_the_observer_into_the_cache_with_a_message(tmp_path: Path) -> None:
    env = {"TBPIPE_CACHE_DIR": str(tmp_path / "cache")}
    first, (run,) = run_training_script(tmp_path, env)
    assert "tbpipe: building the torch-ops observer for torch" in first.stderr
    assert run.manifest["source_status"] == {"torch-ops": OBSERVER_STATUS}
    assert "aten::linear" in [e["name"] for e in op_events(run)]
    (library,) = (tmp_path / "cache" / "torch-observer").glob("torch-*/_tbpipe_torch_observer*")
    log = (library.parent / "build.log").read_text()
    assert "exit status 0" in log
    assert "warning:" not in log  # built with -Wall -Wextra: our code compiles clean
    again, (second,) = run_training_script(tmp_path, env)
    assert "building" not in again.stderr  # cached
    assert second.manifest["source_status"] == {"torch-ops": OBSERVER_STATUS}


def test_a_failed_build_is_reported_once_and_not_retried(tmp_path: Path) -> None:
    # A "compiler" that exists but fails, as a broken toolchain would.
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'broken-c++: cannot compile' >&2\nexit 3\n")
    compiler.chmod(0o755)
    env = {"TBPIPE_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(compiler)}
    first, (run,) = run_training_script(tmp_path, env)
    status = run.manifest["source_status"]["torch-ops"]
    assert status.startswith("recording (dispatch mode: the observer did not compile with ")
    assert "exit status 3" in status
    (log,) = (tmp_path / "cache" / "torch-observer").glob("torch-*/build.log")
    assert "broken-c++: cannot compile" in log.read_text()
    again, (second,) = run_training_script(tmp_path, env)
    assert "an earlier build; remove" in second.manifest["source_status"]["torch-ops"]


def test_status_while_waiting_for_the_programs_import_of_torch(tmp_path: Path) -> None:
    code = f"""
import json, sys
from tbpipe import capture
with capture.session({str(tmp_path / "runs")!r}, sources=["torch-ops"]) as session:
    print(json.dumps(session._writer.manifest["source_status"]), flush=True)
    import torch
    torch.ones(2).relu()
"""
    result = run_python(code, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[0]) == {"torch-ops": "recording (from `import torch` on)"}
    (run,) = read_runs(tmp_path / "runs")
    # Once the import happened the status says how ops are recorded.
    assert run.manifest["source_status"] == {"torch-ops": "recording (RecordFunction observer, from `import torch` on)"}
    assert [e["name"] for e in op_events(run) if e["attrs"]["depth"] == 0] == ["aten::ones", "aten::relu"]


def test_the_capi_capsule_the_observer_uses_is_the_extensions() -> None:
    # The observer refuses anything but tbpipe._native's C API table.
    observer = torch_observer.load(torch)
    with pytest.raises(ValueError):
        observer.start(object())
    assert not observer.registered()
    assert _native._C_API is not None
