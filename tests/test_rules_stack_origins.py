"""Which `code_origins` row a generated line takes (pipeline/stacks/origins.py), and how frames read
as text (pipeline/stacks/render.py): exact range edges, the innermost range when ranges nest, the last
row written when two have the same range; against a plain definition on random ranges. Also the
combined order's default (a native walk taken) and native frames without a module."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.stacks import focus, order, origins, render
from tbpipe.schemas.raw import NATIVE_FRAME_EVAL_LOOP, PYTHON_FRAME_ENTRY


def ranges(*rows: tuple[str, int, int]):
    table = pa.table({"file": [r[0] for r in rows], "line_lo": [r[1] for r in rows], "line_hi": [r[2] for r in rows]})
    return origins._ranges_by_file(table)


def test_a_line_takes_the_row_whose_range_holds_it_edges_included() -> None:
    by_file = ranges(("g.py", 10, 19), ("g.py", 20, 29), ("h.py", 1, 5))
    found = {line: origins._row_for(by_file["g.py"], line) for line in (9, 10, 19, 20, 29, 30)}
    assert found == {9: -1, 10: 0, 19: 0, 20: 1, 29: 1, 30: -1}
    assert origins._row_for(by_file["h.py"], 5) == 2


def test_of_nested_ranges_the_one_starting_last_holds_the_line_and_a_repeated_range_keeps_its_last_row() -> None:
    by_file = ranges(("g.py", 1, 100), ("g.py", 40, 50), ("g.py", 40, 50))
    assert [origins._row_for(by_file["g.py"], line) for line in (39, 40, 50, 51)] == [0, 2, 2, 0]


RANGE = st.tuples(st.integers(0, 30), st.integers(0, 30)).map(sorted)


@settings(max_examples=200, deadline=None, database=None)
@given(rows=st.lists(RANGE, min_size=1, max_size=8), line=st.integers(-1, 32))
def test_row_for_is_its_definition(rows, line) -> None:
    by_file = ranges(*(("g.py", lo, hi) for lo, hi in rows))
    last_of = {(lo, hi): row for row, (lo, hi) in enumerate(rows)}
    holding = [(lo, hi) for (lo, hi) in last_of if lo <= line <= hi]
    # The range starting last; of those starting together the one ending last (the search walks back
    # over the ranges sorted by (start, end) from the last that starts at or before the line).
    expected = last_of[max(holding)] if holding else -1
    assert origins._row_for(by_file["g.py"], line) == expected


def test_frames_read_as_file_line_function_with_their_marks() -> None:
    frames = [
        render.frame("python", "step", "/app/train.py", 12, None),
        render.frame("native", "gemm", None, None, "/usr/lib/libcublas.so.12", inlined=True),
        render.frame("native", "??", None, 7, None),
        render.frame("marker", "<native walk stopped>", None, None, None),
        render.frame("python", "call", "/tmp/gen.py", 3, None, generated=True),
    ]
    assert render.format_frames(frames) == "\n".join(
        [
            "/app/train.py:12:step",
            "libcublas.so.12:?:gemm [inlined]",
            "??:7:??",
            "<native walk stopped>",
            "/tmp/gen.py:3:call [generated]",
        ]
    )
    assert "generated" not in render.frame("python", "f", "a.py", 1, None)


def test_the_combined_order_takes_the_native_walk_as_captured_unless_told() -> None:
    native, python = [0, NATIVE_FRAME_EVAL_LOOP], [PYTHON_FRAME_ENTRY]
    assert order.combined_order(native, python).slots == [("native", 0), ("python", 0)]
    assert order.combined_order(native, python, native_captured=False).slots == [("python", 0)]


def test_a_native_frame_without_a_module_is_the_programs_unless_its_function_is_machinery() -> None:
    assert not focus.is_recording_machinery("gemm", None)
    assert focus.is_recording_machinery("at::RecordFunction::before", None)
    assert focus.FrameRules().classify("native", "gemm", None, None) == focus.NATIVE
