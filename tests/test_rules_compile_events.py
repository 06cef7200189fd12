"""torch.compile's events as the capture records them (capture/torch_compile.py), from Dynamo's
structured trace records handed in as Dynamo hands them: a frame's compile with its metrics, its
backward and its recompile; a graph break at the user's line (an event carried by a line of its own
whose `code_origins` row names the traced frames) or, without frames, where it was recorded; the
compile callbacks' timed compiles; the frames of traced graphs and the wrappers' compiles."""

from __future__ import annotations

import json
import logging
import sys
import types

import pyarrow.parquet as pq
import pytest

from tbpipe import capture
from tbpipe.capture import torch_compile as tc

META = {"frame_id": 3, "frame_compile_id": 1}


@pytest.fixture
def state(monkeypatch):
    """A fresh recording state (the module's is per process)."""
    fresh = tc._State()
    monkeypatch.setattr(tc, "_state", fresh)
    return fresh


def recorded(tmp_path, *calls) -> list[tuple[str, str, dict]]:
    """(kind, name, attrs) of the events that `calls` record in a capture session."""
    with capture.session(tmp_path / "runs"):
        for call in calls:
            call()
    parts = sorted((tmp_path / "runs").rglob("events-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part, columns=["kind", "name", "attrs"]).to_pylist()]
    return [(r["kind"], r["name"], json.loads(r["attrs"] or "{}")) for r in rows if r["kind"] != "session"]


def test_a_compile_event_carries_the_metrics_dynamo_gives(state, tmp_path) -> None:
    metrics = {
        "co_name": "forward",
        "compile_id": "0/1",
        "entire_frame_compile_time_s": 1.23456789,
        "co_filename": "/app/model.py",
        "co_firstlineno": 10,
        "graph_op_count": 7,
        "num_graph_breaks": 2,
        "fail_type": "Unsupported",
        "fail_reason": "",
        "recompile_reason": "size of x changed",
    }
    events = recorded(tmp_path, lambda: tc._compiled(META, metrics, backward=False))
    attrs = {
        "compile_id": "0/1",
        "seconds": 1.234568,
        "file": "/app/model.py",
        "first_line": 10,
        "ops": 7,
        "graph_breaks": 2,
        "fail_type": "Unsupported",
        "fail_reason": "",
    }
    assert events == [
        ("compile", "forward", attrs),
        (
            "recompile",
            "forward",
            {"reason": "size of x changed", "compile_id": "0/1", "file": "/app/model.py", "first_line": 10},
        ),
    ]


def test_a_backward_compile_is_named_after_its_forward_and_has_no_recompile(state, tmp_path) -> None:
    forward = {"co_name": "forward", "duration_us": 2500000}
    backward = {"duration_us": 500, "recompile_reason": "ignored for a backward"}
    events = recorded(
        tmp_path,
        lambda: tc._compiled(META, forward, backward=False),
        lambda: tc._compiled(META, backward, backward=True),
        lambda: tc._compiled({"frame_id": 9}, {}, backward=True),
        lambda: tc._compiled(META, "not metrics", backward=False),
    )
    assert events == [
        ("compile", "forward", {"compile_id": "3/1", "seconds": 2.5}),
        ("compile", "forward (backward)", {"compile_id": "3/1", "seconds": 0.0005}),
        ("compile", "<unknown frame> (backward)", {"compile_id": "9/None"}),
    ]
    assert state.compiles[(None, 3, 1)].function == "forward"
    # Compiled autograd's graphs are compiles of their own.
    recorded(tmp_path / "again", lambda: tc._compiled({"compiled_autograd_id": 5, **META}, {"co_name": "g"}, False))
    assert state.compiles[(5, 3, 1)].function == "g" and state.compiles[(None, 3, 1)].function == "forward"


def test_a_recompile_without_a_file_says_its_reason_and_id(state, tmp_path) -> None:
    events = recorded(tmp_path, lambda: tc._compiled(META, {"co_name": "f", "recompile_reason": "guard"}, False))
    assert events[1] == ("recompile", "f", {"reason": "guard", "compile_id": "3/1"})


BREAK = (
    "Graph break in user code at /app/model.py:12\n"
    "Graph Break Reason: Unsupported: builtin print\n"
    "\n\nUser code traceback:\n"
    '  File "/app/train.py", line 40, in main\n'
    "    model(x)\n"
    '  File "/app/model.py", line 12, in forward\n'
    "    print(x)\n"
)


def test_a_graph_break_is_carried_to_the_traced_frames_by_a_line_of_its_own(state, tmp_path) -> None:
    events = recorded(tmp_path, lambda: tc._graph_break(META, BREAK), lambda: tc._graph_break(META, BREAK))
    attrs = {"reason": "Unsupported: builtin print", "compile_id": "3/1", "file": "/app/model.py", "line": 12}
    assert events == [("graph_break", "Unsupported: builtin print", attrs)] * 2
    # One carrier line for the one origin, whose row names the frames innermost first.
    assert [(row["file"], row["line_lo"], row["line_hi"]) for row in state.rows] == [(tc.EVENT_CARRIER_FILE, 2, 2)]
    assert [(f["filename"], f["line"]) for f in state.rows[0]["origin"]] == [
        ("/app/model.py", 12),
        ("/app/train.py", 40),
    ]
    other = BREAK.replace("line 40", "line 41")
    recorded(tmp_path / "again", lambda: tc._graph_break(META, other))
    assert [row["line_lo"] for row in state.rows] == [2, 3]
    # The events' stacks run the carrier's line that the row names.
    assert carrier_lines(tmp_path) == [2, 2] and carrier_lines(tmp_path / "again") == [3]


def carrier_lines(tmp_path) -> list[int]:
    """The lines of the carrier frames in the stacks of a session's events."""
    code = pq.read_table(next((tmp_path / "runs").rglob("code-*.parquet"))).to_pylist()
    carriers = {row["code_id"] for row in code if row["filename"] == tc.EVENT_CARRIER_FILE}
    stacks = {
        row["stack_id"]: row for row in pq.read_table(next((tmp_path / "runs").rglob("stacks-*.parquet"))).to_pylist()
    }
    # Only the columns read: a nanosecond timestamp becomes a Python value only with pandas installed.
    events = pq.read_table(
        next((tmp_path / "runs").rglob("events-*.parquet")), columns=["kind", "stack_id"]
    ).to_pylist()
    return [
        frame["line"]
        for event in events
        if event["kind"] == "graph_break"
        for frame in stacks[event["stack_id"]]["python"]
        if frame["code_id"] in carriers
    ]


def test_a_graph_break_without_frames_is_carried_to_its_line_or_recorded_where_it_happened(state, tmp_path) -> None:
    only_line = "Graph break in user code at /app/model.py:12\nGraph Break Reason: data-dependent\n"
    events = recorded(
        tmp_path,
        lambda: tc._graph_break(META, only_line),
        lambda: tc._graph_break(META, "Graph Break Reason: plain\n"),
        lambda: tc._graph_break(META, None),
        lambda: tc._graph_break(META, "Graph Break Reason: \n"),
    )
    assert events == [
        (
            "graph_break",
            "data-dependent",
            {"reason": "data-dependent", "compile_id": "3/1", "file": "/app/model.py", "line": 12},
        ),
        ("graph_break", "plain", {"reason": "plain", "compile_id": "3/1"}),
        ("graph_break", "graph break", {"reason": "", "compile_id": "3/1"}),
    ]
    assert [[(f["filename"], f["line"], f["qualname"]) for f in row["origin"]] for row in state.rows] == [
        [("/app/model.py", 12, "<unknown>")]
    ]


def test_frames_on_the_stack_now_are_not_the_traced_ones(state, tmp_path) -> None:
    def payload(*on_stack) -> str:  # frames running now (outermost first), then two traced frames
        now = "".join(
            f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}\n    x\n' for f in on_stack
        )
        return (
            "Graph Break Reason: first line\n  second line\n  third line\n\n\nUser code traceback:\n"
            + now
            + '  File "/app/model.py", line 12, in forward\n    inner(x)\n'
            + '  File "/app/model.py", line 20, in inner\n    print(x)\n'
        )

    def caller(outer) -> None:  # the frame that calls in, and the test's frame further out
        tc._graph_break(META, payload(outer, sys._getframe()))

    def caller_alone() -> None:  # one frame on the stack ahead of the traced ones
        tc._graph_break(META, payload(sys._getframe()))

    events = recorded(tmp_path, lambda: caller(sys._getframe(1)), caller_alone)
    traced = [("/app/model.py", 20), ("/app/model.py", 12)]
    # One row: both breaks traced the same frames, so they share a carrier.
    assert [[(f["filename"], f["line"]) for f in row["origin"]] for row in state.rows] == [traced]
    assert [(kind, name) for kind, name, _attrs in events] == [("graph_break", "first line")] * 2


def test_the_compile_callbacks_time_the_compiles_that_have_no_metrics_of_their_own(
    state, tmp_path, monkeypatch
) -> None:
    clock = iter([10.0, 10.12345678, 20.0, 21.0, 30.0, 30.5])
    monkeypatch.setattr(tc.time, "perf_counter", lambda: next(clock))

    def args(trigger: str, compile_id) -> types.SimpleNamespace:
        return types.SimpleNamespace(callback_trigger=types.SimpleNamespace(name=trigger), compile_id=compile_id)

    events = recorded(
        tmp_path,
        lambda: tc._on_compile_start(args("COMPILED_AUTOGRAD", 4)),
        lambda: tc._on_compile_end(args("COMPILED_AUTOGRAD", 4)),
        lambda: tc._on_compile_start(args("DYNAMO", 5)),
        lambda: tc._on_compile_end(args("DYNAMO", 5)),
        lambda: tc._on_compile_start(args("LAZY_BACKWARD", 6)),
        lambda: tc._on_compile_end(args("LAZY_BACKWARD", 6)),
        lambda: tc._on_compile_end(args("COMPILED_AUTOGRAD", 7)),  # no start seen
    )
    assert events == [("compile", "compiled autograd", {"seconds": 0.123457, "compile_id": "4"})]
    assert tc.counters()["compile_callbacks"] == 7 and state.started == {} and tc.notes() == []


def test_a_callback_trigger_without_a_name_or_arguments_without_an_id_are_still_timed(state, tmp_path) -> None:
    bare = types.SimpleNamespace()
    named_by_text = types.SimpleNamespace(callback_trigger="COMPILED_AUTOGRAD", compile_id=2)
    events = recorded(
        tmp_path,
        lambda: tc._on_compile_start(bare),
        lambda: tc._on_compile_end(bare),
        lambda: tc._on_compile_start(named_by_text),
        lambda: tc._on_compile_end(named_by_text),
    )
    assert [(kind, name, attrs["compile_id"]) for kind, name, attrs in events] == [
        ("compile", "none", "None"),
        ("compile", "compiled autograd", "2"),
    ]
    assert tc.notes() == []


def record(metadata: dict, payload=None) -> logging.LogRecord:
    entry = logging.LogRecord("torch.__trace", logging.DEBUG, __file__, 1, "", None, None)
    entry.metadata, entry.payload = metadata, payload
    return entry


def test_trace_records_are_read_by_their_kind(state, tmp_path) -> None:
    handler = tc._TraceHandler()
    graph = "    # File: /app/model.py:12 in forward, code: y = x + 1\n    add = x + 1\n"
    events = recorded(
        tmp_path,
        lambda: handler.emit(record({"artifact": {"name": "dynamo_graph_break_reason"}, **META}, BREAK)),
        lambda: handler.emit(record({"artifact": {"name": "other"}}, BREAK.replace("print", "input"))),
        lambda: handler.emit(record({"dynamo_output_graph": {}, **META}, graph)),
        lambda: handler.emit(record({"inductor_output_code": {"filename": "/tmp/w.py"}, **META})),
        lambda: handler.emit(record({"compilation_metrics": {"co_name": "f"}, **META})),
        lambda: handler.emit(record({"bwd_compilation_metrics": {}, **META})),
        lambda: handler.emit(record("not a dict")),
    )
    assert [(kind, name) for kind, name, _ in events] == [
        ("graph_break", "Unsupported: builtin print"),
        ("compile", "f"),
        ("compile", "f (backward)"),
    ]
    assert state.traced == {(None, 3, 1): {("/app/model.py", 12, "forward", "y = x + 1")}}
    assert state.wrapper_compiles == {"/tmp/w.py": (None, 3, 1)}
    assert state.calls["trace_records"] == 7 and tc.notes() == []


def test_a_record_not_understood_is_said_once_and_never_raised(state, capsys) -> None:
    handler = tc._TraceHandler()
    handler.emit(record({"compilation_metrics": {"co_name": "f", "entire_frame_compile_time_s": "soon"}}))
    assert len(tc.notes()) == 1
    assert tc.notes()[0].startswith("torch.compile: a structured trace record was not understood (ValueError: ")
    handler.emit(record({"dynamo_output_graph": {}}, None))
    handler.emit(record({"inductor_output_code": "no dict"}))
    assert state.traced == {} and state.wrapper_compiles == {}
    # Records without metadata or without a payload are passed over quietly.
    handler.emit(logging.LogRecord("torch.__trace", logging.DEBUG, __file__, 1, "", None, None))
    for metadata in ({"artifact": {"name": "dynamo_graph_break_reason"}}, {"dynamo_output_graph": {}}):
        entry = record(metadata)
        del entry.payload
        handler.emit(entry)
    assert len(tc.notes()) == 1 and state.traced == {} and state.calls["trace_records"] == 6


class _BrokenTrigger:
    @property
    def name(self) -> str:
        raise ValueError("no name")


def test_a_compile_end_callback_that_fails_is_said_once_and_never_raised(state) -> None:
    broken = types.SimpleNamespace(callback_trigger=_BrokenTrigger(), compile_id=1)
    tc._on_compile_start(broken)
    tc._on_compile_end(broken)
    assert tc.notes() == ["torch.compile: compile-end callback failed (ValueError: no name)"]
