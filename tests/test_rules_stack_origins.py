"""Which `code_origins` row a generated line takes (pipeline/stacks/origins.py), and how frames read
as text (pipeline/stacks/render.py): exact range edges, the innermost range when ranges nest, the last
row written when two have the same range; against a plain definition on random ranges. Also the
combined order's default (a native walk taken) and native frames without a module."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.stacks import focus, order, origins, render
from tbpipe.schemas import raw
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


# splice_origins on small hand-made tables: each Python frame of a generated line with a row gets the
# row's origin frames placed right inside it (before it in the innermost-first list), innermost first.
# Code ids are hashes: above 2**53, where ids a float would mix up differ (and below 2**63, where
# numpy would take them for int64 unless told).
GEN, GEN_CODE, USER_CODE = "/tmp/torchinductor/gen.py", 2**62 + 7, 2**62 + 8


def run_tables(python_stacks, code_rows, origin_rows, stack_ids=None):
    """A run's stacks, code and code_origins tables; a Python frame is (code_id, line, offset, flags)."""
    frame = lambda c, line, offset=5, flags=0: {"code_id": c, "offset": offset, "line": line, "flags": flags}  # noqa: E731
    stacks = pa.table(
        {
            "stack_id": pa.array(stack_ids or list(range(1, len(python_stacks) + 1)), pa.uint64()),
            "thread_id": pa.array([1] * len(python_stacks), pa.int64()),
            "status": pa.array([0] * len(python_stacks), pa.uint32()),
            "native": pa.array([[] for _ in python_stacks], pa.list_(raw.NATIVE_FRAME)),
            "python": pa.array([[frame(*f) for f in s] for s in python_stacks], pa.list_(raw.PYTHON_FRAME)),
            "stack_hash": pa.array([None] * len(python_stacks), pa.uint64()),
        },
        schema=raw.stacks_schema(),
    )
    code = pa.table(
        {k: [r[i] for r in code_rows] for i, k in enumerate(("code_id", "filename", "qualname", "first_line"))},
        schema=raw.code_schema(),
    )
    origin = lambda f, q, first, line: {"filename": f, "qualname": q, "first_line": first, "line": line}  # noqa: E731
    code_origins = pa.table(
        {
            "file": [r[0] for r in origin_rows],
            "line_lo": [r[1] for r in origin_rows],
            "line_hi": [r[2] for r in origin_rows],
            "origin": [[origin(*o) for o in r[3]] for r in origin_rows],
        },
        schema=raw.code_origins_schema(),
    )
    return {"stacks": stacks, "code": code, "code_origins": code_origins}


CODE = [(GEN_CODE, GEN, "call", 1), (USER_CODE, "/app/train.py", "main", 1)]
ROWS = [
    (GEN, 10, 12, [("/app/model.py", "Block.forward", 20, 24), ("/app/model.py", "Net.forward", 40, 41)]),
    (GEN, 13, 13, [("/app/model.py", "Block.forward", 20, 27)]),
]
BASE = origins._ORIGIN_CODE_BASE


def spliced_python(tables):
    out = origins.splice_origins(tables)
    return out, [
        [(f["code_id"], f["line"], f["offset"], f["flags"]) for f in s] for s in out["stacks"]["python"].to_pylist()
    ]


def test_origin_frames_go_inside_the_generated_frame_innermost_first() -> None:
    tables = run_tables([[(GEN_CODE, 11, 30, 1), (USER_CODE, 5)], [(GEN_CODE, 13), (GEN_CODE, 9)]], CODE, ROWS)
    out, python = spliced_python(tables)
    block, net = BASE, BASE + 1  # distinct functions in the order the rows name them
    flag = origins.ORIGIN_FLAG
    assert python == [
        [(block, 24, -1, flag), (net, 41, -1, flag), (GEN_CODE, 11, 30, 1), (USER_CODE, 5, 5, 0)],
        [(block, 27, -1, flag), (GEN_CODE, 13, 5, 0), (GEN_CODE, 9, 5, 0)],
    ]
    assert out["code"].to_pylist()[2:] == [
        {"code_id": block, "filename": "/app/model.py", "qualname": "Block.forward", "first_line": 20},
        {"code_id": net, "filename": "/app/model.py", "qualname": "Net.forward", "first_line": 40},
    ]
    assert out["code"].slice(0, 2).equals(tables["code"])
    assert out["stacks"].schema == tables["stacks"].schema
    assert out["stacks"].drop(["python"]).equals(tables["stacks"].drop(["python"]))
    assert out["code_origins"] is tables["code_origins"]


def test_range_edges_decide_which_lines_take_origins() -> None:
    lines = [9, 10, 12, 13, 14]
    tables = run_tables([[(GEN_CODE, line)] for line in lines], CODE, ROWS)
    _, python = spliced_python(tables)
    assert [len(s) for s in python] == [1, 3, 3, 2, 1]


def test_origin_code_ids_skip_the_ids_the_run_already_uses() -> None:
    code = CODE + [(BASE, "/app/x.py", "x", 1), (BASE + 2, "/app/y.py", "y", 1)]
    tables = run_tables([[(GEN_CODE, 10)]], code, ROWS)
    out, python = spliced_python(tables)
    assert [f[0] for f in python[0]] == [BASE + 1, BASE + 3, GEN_CODE]
    assert out["code"]["code_id"].to_pylist()[4:] == [BASE + 1, BASE + 3]


def test_a_file_other_than_the_generated_ones_and_lines_outside_every_range_change_nothing() -> None:
    outside = run_tables([[(GEN_CODE, 9), (USER_CODE, 11)]], CODE, ROWS)
    assert origins.splice_origins(outside) is outside
    no_rows = run_tables([[(GEN_CODE, 11)]], CODE, [])
    assert origins.splice_origins(no_rows) is no_rows
    no_frames = run_tables([[], []], CODE, ROWS)
    assert origins.splice_origins(no_frames) is no_frames
    other_file = run_tables([[(GEN_CODE, 11)]], CODE, [("/tmp/other.py", 1, 100, ROWS[0][3])])
    assert origins.splice_origins(other_file) is other_file
    no_code = run_tables([[(GEN_CODE, 11)]], [], ROWS)
    assert origins.splice_origins(no_code) is no_code
    assert origins.splice_origins({"stacks": None, "code": None}) == {"stacks": None, "code": None}


def test_a_run_with_one_code_object_gets_its_origins_too() -> None:
    tables = run_tables([[(GEN_CODE, 13)]], CODE[:1], ROWS)
    _, python = spliced_python(tables)
    assert python == [[(BASE, 27, -1, origins.ORIGIN_FLAG), (GEN_CODE, 13, 5, 0)]]


def test_a_sliced_stacks_table_keeps_its_own_stacks() -> None:
    tables = run_tables([[(USER_CODE, 1)], [(USER_CODE, 2), (GEN_CODE, 13)], [(GEN_CODE, 11)]], CODE, ROWS)
    tables["stacks"] = tables["stacks"].slice(1)
    _, python = spliced_python(tables)
    flag = origins.ORIGIN_FLAG
    assert python == [
        [(USER_CODE, 2, 5, 0), (BASE, 27, -1, flag), (GEN_CODE, 13, 5, 0)],
        [(BASE, 24, -1, flag), (BASE + 1, 41, -1, flag), (GEN_CODE, 11, 5, 0)],
    ]


FRAME = st.tuples(st.sampled_from([GEN_CODE, USER_CODE]), st.integers(8, 15))
ORIGIN = st.tuples(
    st.sampled_from(["/a.py", "/b.py"]), st.sampled_from(["f", "g"]), st.integers(1, 2), st.integers(1, 99)
)
ROW = st.tuples(st.just(GEN), st.integers(8, 15), st.integers(0, 3), st.lists(ORIGIN, min_size=1, max_size=3)).map(
    lambda r: (r[0], r[1], r[1] + r[2], r[3])
)


@settings(max_examples=80, deadline=None, database=None)
@given(stacks=st.lists(st.lists(FRAME, max_size=4), min_size=1, max_size=4), rows=st.lists(ROW, max_size=4))
def test_splice_origins_is_its_definition(stacks, rows) -> None:
    tables = run_tables(stacks, CODE, rows)
    out, python = spliced_python(tables)
    # The definition: distinct origin functions numbered from the base in the order the rows name them;
    # a frame of the generated file whose line a row's range holds (the one starting last; of equal
    # ranges the last row) gets that row's frames first.
    ids = {}
    for row in rows:
        for f, q, first, _line in row[3]:
            ids.setdefault((f, q, first), BASE + len(ids))
    expected = []
    for stack in stacks:
        frames = []
        for code_id, line in stack:
            holding = [(lo, hi, i) for i, (_f, lo, hi, _o) in enumerate(rows) if lo <= line <= hi]
            if code_id == GEN_CODE and holding:
                best = max(holding)[:2]
                row = max(i for lo, hi, i in holding if (lo, hi) == best)
                frames += [(ids[(f, q, first)], line_, -1, origins.ORIGIN_FLAG) for f, q, first, line_ in rows[row][3]]
            frames.append((code_id, line, 5, 0))
        expected.append(frames)
    assert python == expected
    if any(len(s) != len(e) for s, e in zip(stacks, expected)):
        assert out["code"]["code_id"].to_pylist()[2:] == list(ids.values())


def test_interpreter_frames_right_outside_the_innermost_python_frame_fold_in_program_mode() -> None:
    classes = [focus.PY, focus.INTERPRETER, focus.NATIVE, focus.PY]
    assert focus.focus_reference(classes, "program") == focus.Focus([0, 2, 3], 0)
