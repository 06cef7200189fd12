"""What counts as generated code and where its lines came from (capture/torch_compile.py), rule by rule:
the folders the manifest names, Dynamo's graph-break payloads, FX stack traces and Inductor's line
maps turned into `code_origins` rows, and user functions named as their code objects name them."""

from __future__ import annotations

import os
import sys

import pytest

from tbpipe.capture import torch_compile as tc

# ------------------------------------------------------------------------------------------ folders


def test_generated_code_folders_come_from_the_cache_variables_made_absolute(monkeypatch, tmp_path) -> None:
    # Triton's own setting reads the same variable; without Triton imported only the variable can say it.
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "inductor-cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", "triton-cache")
    assert tc.generated_code_dirs() == {
        "inductor": str(tmp_path / "inductor-cache"),
        "triton": str(tmp_path / "triton-cache"),
    }


def test_without_the_variables_only_imported_modules_name_folders(monkeypatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delitem(sys.modules, "torch._inductor.runtime.cache_dir_utils", raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert tc.generated_code_dirs() == {}


def test_inductors_default_folder_when_the_program_imported_inductor(monkeypatch) -> None:
    utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/srv/triton")
    assert tc.generated_code_dirs() == {"inductor": os.path.abspath(utils.default_cache_dir()), "triton": "/srv/triton"}


def test_tritons_folder_when_the_program_imported_triton_and_set_no_variable(monkeypatch) -> None:
    triton = pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert tc.generated_code_dirs()["triton"] == os.path.abspath(triton.knobs.cache.dir)


# ------------------------------------------------------------------------------------------ graph breaks

BREAK = (
    "Graph break in user code at /app/model.py:12\n"
    "Graph Break Reason: Encountered graph break when attempting to trace CALL: a call to print:\n\n"
    "  Unsupported: builtin print\n"
    "\n\nUser code traceback:\n"
    '  File "/app/train.py", line 40, in main\n'
    "    model(x)\n"
    '  File "/app/model.py", line 12, in forward\n'
    "    print(x)\n"
    "\n\nStack variable source attribution: nothing"
)


def test_a_graph_break_payload_gives_its_line_dynamos_reason_and_the_user_frames() -> None:
    assert tc.parse_graph_break(BREAK) == (
        "/app/model.py",
        12,
        "Unsupported: builtin print",
        [("/app/train.py", 40, "main"), ("/app/model.py", 12, "forward")],
    )


def test_a_reason_stops_at_whichever_section_comes_first() -> None:
    attribution_first = BREAK.replace("\n\nUser code traceback:\n", "\n\nStack variable source attribution: x\n")
    assert tc.parse_graph_break(attribution_first)[2] == "Unsupported: builtin print"
    assert tc.parse_graph_break("Graph Break Reason: plain")[:3] == (None, None, "plain")


def test_only_the_first_reason_and_traceback_count_and_a_traceback_ends_at_its_blank_line() -> None:
    later = BREAK.replace(
        "Stack variable source attribution: nothing",
        'Stack variable source attribution:\n  File "/app/other.py", line 1, in g\n\nGraph Break Reason: again',
    )
    assert tc.parse_graph_break(later)[2:] == tc.parse_graph_break(BREAK)[2:]
    # A traceback whose last frame has no source line, the payload starting with it.
    bare = '\nUser code traceback:\n  File "/app/model.py", line 12, in forward\n\nmore'
    assert tc.parse_graph_break(bare)[3] == [("/app/model.py", 12, "forward")]


def test_a_payload_of_another_shape_is_its_own_reason() -> None:
    assert tc.parse_graph_break("  something else  ") == (None, None, "something else", [])


@pytest.mark.parametrize(
    ("reason", "explained"),
    [
        ("Encountered graph break when attempting to trace CALL: x:\n\nthe reason\n", "the reason"),
        # A head of more than one line is not Dynamo's context line: the reason stays whole.
        ("first\nsecond:\n\nrest", "first\nsecond:\n\nrest"),
        ("  no context  ", "no context"),
        # Only the first blank line ends the context line.
        ("context:\n\nreason part:\n\nmore", "reason part:\n\nmore"),
    ],
)
def test_explain_reason_drops_only_dynamos_one_line_context(reason, explained) -> None:
    assert tc.explain_reason(reason) == explained


# ------------------------------------------------------------------------------------------ line maps

TRACE = (
    'File "/app/train.py", line 40, in main\n'
    "    model(x)\n"
    '  File "/app/model.py", line 12, in forward\n'
    "    return self.lin(x) + 1"
)


def test_stack_trace_frames_keep_each_frames_code_line() -> None:
    assert tc.stack_trace_frames(TRACE) == [
        ("/app/train.py", 40, "main", "model(x)"),
        ("/app/model.py", 12, "forward", "return self.lin(x) + 1"),
    ]
    # A last frame without its source line has no code.
    assert tc.stack_trace_frames('File "/a.py", line 3, in f') == [("/a.py", 3, "f", "")]


def test_line_map_runs_end_before_the_next_start_and_the_last_never_ends() -> None:
    # Frames whose source is not on this machine cannot be checked against it and are kept as given.
    trace = 'File "/nowhere/m.py", line 7, in forward\n'
    rows = tc.rows_of_line_map("/gen/w.py", [(5, 9, 9, 12), (trace, trace, None, trace)])
    assert [(r["line_lo"], r["line_hi"]) for r in rows] == [(5, 8), (12, 2**31 - 1)]
    assert rows[0]["file"] == "/gen/w.py"
    assert rows[0]["origin"] == [{"filename": "/nowhere/m.py", "qualname": "forward", "first_line": -1, "line": 7}]


def test_every_run_but_the_last_ends_at_the_next_start_a_one_line_run_included() -> None:
    trace = 'File "/nowhere/m.py", line 7, in forward\n'
    rows = tc.rows_of_line_map("/gen/w.py", [(5, 6, 9, 12), (trace, trace, trace, trace)])
    assert [(r["line_lo"], r["line_hi"]) for r in rows] == [(5, 5), (6, 8), (9, 11), (12, 2**31 - 1)]


def test_a_run_whose_frames_cannot_be_trusted_is_left_out_and_the_next_still_counts(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    good = f'File "{path}", line 7, in inner\n    return y + 1\n'
    untraced = f'File "{path}", line 9, in outer\n    return inner(x)\n'
    traced = {(str(path), 7, "inner", "return y + 1")}
    rows = tc.rows_of_line_map("/gen/w.py", [(1, 5), (untraced, good)], traced)
    assert [(r["line_lo"], r["origin"][0]["line"]) for r in rows] == [(5, 7)]


def test_line_maps_of_another_shape_give_no_rows() -> None:
    assert tc.rows_of_line_map("/gen/w.py", None) == []
    assert tc.rows_of_line_map("/gen/w.py", [(1,)]) == []
    assert tc.rows_of_line_map("/gen/w.py", [(1,), (7,)]) == []  # a trace that is not text


SOURCE = """\
import functools


@functools.cache
def outer(x):
    def inner(y):
        return y + 1

    return inner(x)


class Model:
    def forward(self, x):
        y = x + 1
        return y * 2
"""


def test_origin_frames_are_named_by_qualified_name_and_first_line(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    trace = (
        f'File "{path}", line 9, in outer\n    return inner(x)\n  File "{path}", line 7, in inner\n    return y + 1\n'
    )
    [row] = tc.rows_of_line_map("/gen/w.py", [(3,), (trace,)])
    qualified = sys.version_info >= (3, 11)
    assert row["origin"] == [
        {
            "filename": str(path),
            "qualname": "outer.<locals>.inner" if qualified else "inner",
            "first_line": 6,
            "line": 7,
        },
        {"filename": str(path), "qualname": "outer", "first_line": 4, "line": 9},  # the decorator's line
    ]


def test_a_moved_outer_line_is_found_by_its_text_and_a_lost_one_drops_the_row(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    moved = (
        f'File "{path}", line 14, in forward\n    return y * 2\n  File "{path}", line 7, in inner\n    return y + 1\n'
    )
    [row] = tc.rows_of_line_map("/gen/w.py", [(1,), (moved,)])
    assert [(o["line"], o["first_line"]) for o in row["origin"]] == [(7, 6), (15, 13)]
    lost = moved.replace("return y * 2", "return y * 3")
    assert tc.rows_of_line_map("/gen/w.py", [(1,), (lost,)]) == []


def test_the_innermost_frame_must_be_one_dynamo_traced_else_the_nearest_of_its_text(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    frames = [(str(path), 7, "inner", "return y + 1")]
    assert tc.current_frames(frames, {frames[0]}) == frames
    elsewhere = {(str(path), 30, "inner", "return y + 1"), (str(path), 9, "inner", "return y + 1")}
    assert tc.current_frames(frames, elsewhere) == [(str(path), 9, "inner", "return y + 1")]
    other_file = {("/other.py", 7, "inner", "return y + 1"), (str(path), 20, "inner", "return y + 1")}
    assert tc.current_frames(frames, other_file) == [(str(path), 20, "inner", "return y + 1")]
    assert tc.current_frames(frames, {(str(path), 7, "inner", "return y - 1")}) is None
    assert tc.current_frames([], None) is None


MOVED = """\
x = 1
y = x * 2


def other(y):
    return y * 2


def forward(x):
    y = x + 1
    if x:
        return y * 2
    z = 0
    return y * 2
"""


def test_a_moved_line_is_the_nearest_line_of_its_text_in_its_own_function(tmp_path) -> None:
    path = tmp_path / "moved.py"
    path.write_text(MOVED)
    assert tc._line_with_text(str(path), "forward", "return y * 2", 10) == 12
    assert tc._line_with_text(str(path), "forward", "return y * 2", 14) == 14
    assert tc._line_with_text(str(path), "forward", "y = x * 2", 10) is None  # only outside the function
    assert tc._line_with_text(str(path), "other", "return y * 2", 12) == 6


def test_code_after_a_graph_break_is_named_as_the_user_function_it_resumes(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    resumed = tc.origin_frame(str(path), 15, "torch_dynamo_resume_in_forward_at_14")
    assert (resumed["qualname"], resumed["first_line"]) == (
        "Model.forward" if sys.version_info >= (3, 11) else "forward",
        13,
    )
    assert tc.origin_frame(str(path), 1, "<module>")["first_line"] == 1
    assert tc.origin_frame(str(path), 2, "gone")["first_line"] == -1
    lost = tc.origin_frame(str(path), 2, "torch_dynamo_resume_in_gone_at_2")  # no function holds line 2
    assert (lost["qualname"], lost["first_line"]) == ("torch_dynamo_resume_in_gone_at_2", -1)
