"""The stack stage (`tbpipe.pipeline.stacks`) held to one definition.

The combined order is computed three ways: per stack (`order.combined_order`, the definition), over
whole runs with numpy (`layout.combined_slots`, the ingest) and through raw tables and a symbolizer
(`render.symbolize_stacks`, the in-process path). Each hand-written case below states the order a
person expects, and all three must produce exactly it. Also here: the constants that the schemas
and the extension share, the stack hash's MD5 against DuckDB's, and the module key's two encoders.
"""

from __future__ import annotations

import random

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from tbpipe import _native
from tbpipe.pipeline.stacks import identity, layout, order, render
from tbpipe.pipeline.symbols.model import SymbolizedFrame
from tbpipe.pipeline.symbols.modulekey import KeyKind, ModuleKey, module_key_column
from tbpipe.schemas import raw

E = raw.NATIVE_FRAME_EVAL_LOOP
M = raw.NATIVE_FRAME_MARKER
ENTRY = raw.PYTHON_FRAME_ENTRY

# (name, native frame flags, Python frame flags, stack status, expected slots innermost first, problem)
# Slots are "nI" (native frame I) and "pJ" (Python frame J).
CASES = [
    ("no native frames asked for", [], [0, ENTRY], raw.STACK_NO_NATIVE, ["p0", "p1"], None),
    ("one eval frame, one Python frame", [0, E, 0], [ENTRY], 0, ["n0", "p0", "n2"], None),
    (
        "3.11+: one eval frame runs several Python frames",
        [0, E, 0, E, 0],
        [0, 0, ENTRY, 0, ENTRY],
        0,
        ["n0", "p0", "p1", "p2", "n2", "p3", "p4", "n4"],
        None,
    ),
    ("eval frames beyond the last group stay native", [E, E, E], [ENTRY], 0, ["p0", "n1", "n2"], None),
    ("no Python frames: eval frames stay native", [0, E, 0], [], 0, ["n0", "n1", "n2"], None),
    ("a last group without an entry frame runs to the end", [E, 0], [0, 0], 0, ["p0", "p1", "n1"], None),
    (
        "walk cut short: leftover Python frames follow the marker",
        [0, E, M],
        [ENTRY, 0, ENTRY],
        raw.STACK_NATIVE_TRUNCATED,
        ["n0", "p0", "n2", "p1", "p2"],
        "native walk stopped early; 2 outer Python frames follow it",
    ),
    (
        "a marker never counts as an eval frame",
        [0, M | E],
        [ENTRY],
        raw.STACK_NATIVE_TRUNCATED,
        ["n0", "n1", "p0"],
        "native walk stopped early; 1 outer Python frames follow it",
    ),
    (
        "walk cut short: several leftover groups follow the marker, innermost first",
        [E, M],
        [ENTRY, 0, ENTRY, ENTRY],
        raw.STACK_NATIVE_TRUNCATED,
        ["p0", "n1", "p1", "p2", "p3"],
        "native walk stopped early; 3 outer Python frames follow it",
    ),
    (
        "walk cut short: a leftover group without an entry frame follows the marker too",
        [0, E, 0, M],
        [0, ENTRY, 0, 0],
        raw.STACK_NATIVE_TRUNCATED,
        ["n0", "p0", "p1", "n2", "n3", "p2", "p3"],
        "native walk stopped early; 2 outer Python frames follow it",
    ),
    (
        "walk cut short after every group was claimed: nothing to explain",
        [0, E, 0, M],
        [0, ENTRY],
        raw.STACK_NATIVE_TRUNCATED,
        ["n0", "p0", "p1", "n2", "n3"],
        None,
    ),
    ("walk cut short without Python frames", [0, M], [], raw.STACK_NATIVE_TRUNCATED, ["n0", "n1"], None),
    ("eval frames innermost and outermost", [E, 0, E], [ENTRY, 0, ENTRY], 0, ["p0", "n1", "p1", "p2"], None),
    ("a native walk that found nothing: the Python stack alone", [], [0, ENTRY], 0, ["p0", "p1"], None),
    ("native frames not asked for are ignored", [0, E, 0], [ENTRY], raw.STACK_NO_NATIVE, ["p0"], None),
    ("nothing at all", [], [], 0, [], None),
    (
        "walks that disagree: the Python stack alone",
        [0, E],
        [ENTRY, ENTRY],
        0,
        ["p0", "p1"],
        "1 Python frames had no eval-loop frame to match; showing the Python stack alone",
    ),
]


def _by_reference(native: list[int], python: list[int], status: int) -> tuple[list[str], str | None]:
    result = order.combined_order(native, python, native_captured=not status & raw.STACK_NO_NATIVE)
    return [f"{kind[0]}{index}" for kind, index in result.slots], result.problem


def _by_layout(cases: list[tuple]) -> list[tuple[list[str], str | None]]:
    """All cases at once through the ingest's columnar path (Python line and native address = index)."""
    natives = [case[1] for case in cases]
    pythons = [case[2] for case in cases]
    modules = (
        raw.modules_schema()
        .empty_table()
        .rename_columns(["module_index", "path", "module_key", "load_bias", "exec_ranges", "eval_ranges"])
    )
    slots, shapes = layout.combined_slots(
        stack_ids=np.arange(1, len(cases) + 1, dtype=np.int64),
        status=np.array([case[3] for case in cases], dtype=np.uint32),
        native_lengths=np.array([len(n) for n in natives], dtype=np.int64),
        python_lengths=np.array([len(p) for p in pythons], dtype=np.int64),
        native_ref=np.full(sum(map(len, natives)), -1, dtype=np.int64),
        native_address=np.array([i for n in natives for i in range(len(n))], dtype=np.uint64),
        native_flags=np.array([f for n in natives for f in n], dtype=np.uint32),
        python_ref=np.full(sum(map(len, pythons)), -1, dtype=np.int64),
        python_line=np.array([j for p in pythons for j in range(len(p))], dtype=np.int32),
        python_flags=np.array([f for p in pythons for f in p], dtype=np.uint32),
        modules=modules,
        code=raw.code_schema().empty_table(),
    )
    out: list[list[str]] = [[] for _ in cases]
    for stack, kind, address, line in zip(slots.stack_id, slots.kind, slots.address, slots.line):
        out[stack - 1].append(f"p{line}" if kind == layout.PYTHON else f"n{address}")
    return list(zip(out, shapes.problem.to_pylist()))


class _NamesByAddress:
    """Stand-in symbolizer for order tests: names each native frame by its address ("n3"), one frame each."""

    def symbolize_many(self, requests):
        return {ref: [[SymbolizedFrame(f"n{a}")] for a in addresses] for ref, (addresses, _exact) in requests.items()}


def _by_render(native: list[int], python: list[int], status: int) -> tuple[list[str], str | None]:
    """One case through raw tables, as the in-process symbolize sees them."""
    stacks = pa.Table.from_pylist(
        [
            {
                "stack_id": 1,
                "thread_id": 1,
                "status": status,
                "native": [
                    {"module": -1 if f & M else 0, "offset": raw.STOP_DEPTH_LIMIT if f & M else i, "flags": f}
                    for i, f in enumerate(native)
                ],
                "python": [{"code_id": j, "offset": 0, "line": 1, "flags": f} for j, f in enumerate(python)],
            }
        ],
        schema=raw.stacks_schema(),
    )
    modules = pa.Table.from_pylist(
        [{"module_index": 0, "path": "/lib/x.so", "build_id": "ab" * 20, "load_bias": 0}], schema=raw.modules_schema()
    )
    code = pa.Table.from_pylist(
        [{"code_id": j, "filename": "f.py", "qualname": f"p{j}", "first_line": 1} for j in range(len(python))],
        schema=raw.code_schema(),
    )
    (frames,) = render.symbolize_stacks(stacks, modules, code, _NamesByAddress())
    problem = None
    if frames and frames[-1]["kind"] == "marker" and not frames[-1]["name"].startswith("<native walk stopped:"):
        problem = frames.pop()["name"][1:-1]
    # A marker is always the walk's last native frame.
    return [f"n{len(native) - 1}" if f["kind"] == "marker" else f["name"] for f in frames], problem


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_combined_order_definition(case) -> None:
    _name, native, python, status, expected, problem = case
    assert _by_reference(native, python, status) == (expected, problem)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_in_process_order_is_the_definition(case) -> None:
    _name, native, python, status, expected, problem = case
    assert _by_render(native, python, status) == (expected, problem)


def test_ingest_layout_is_the_definition_for_every_case_at_once() -> None:
    assert _by_layout(CASES) == [(case[4], case[5]) for case in CASES]


def test_ingest_layout_agrees_with_the_definition_on_random_stacks() -> None:
    rng = random.Random(7)
    cases = []
    for _ in range(400):
        native = [rng.choice([0, 0, E]) for _ in range(rng.randrange(0, 9))]
        if native and rng.random() < 0.2:
            native[-1] = M
        python = [rng.choice([0, ENTRY]) for _ in range(rng.randrange(0, 7))]
        status = (raw.STACK_NATIVE_TRUNCATED if native and native[-1] & M else 0) | (
            raw.STACK_NO_NATIVE if rng.random() < 0.05 else 0
        )
        cases.append(("random", native, python, status, None, None))
    expected = [_by_reference(native, python, status) for _n, native, python, status, _e, _p in cases]
    assert _by_layout(cases) == expected


# ------------------------------------------------------------------------------------------ one source of truth


def _shared_constant_names(module) -> set[str]:
    prefixes = ("NATIVE_FRAME_", "PYTHON_FRAME_", "STACK_", "STOP_")
    return {
        name
        for name in dir(module)
        if name.startswith(prefixes) and isinstance(getattr(module, name), int) or name == "MAX_NATIVE_FRAMES"
    }


def test_every_raw_format_constant_is_the_extensions() -> None:
    ours, theirs = _shared_constant_names(raw), _shared_constant_names(_native)
    assert ours == theirs
    assert len(ours) >= 18
    assert {name: getattr(raw, name) for name in ours} == {name: getattr(_native, name) for name in ours}
    assert set(raw.STOP_REASONS) == {getattr(raw, name) for name in ours if name.startswith("STOP_")}


def test_the_version_is_defined_once() -> None:
    from importlib.metadata import version

    from tbpipe import capture

    assert capture.__version__ == version("tbpipe")


def test_md5_low64_is_duckdbs_md5_number_lower() -> None:
    texts = ["", "abc", "/usr/lib/libc.so.6\x1fmalloc\x1f12", "é/ü/\u2603", "x" * 1000]
    con = duckdb.connect()
    theirs = [con.execute("SELECT md5_number_lower(?)", [t]).fetchone()[0] for t in texts]
    assert identity.md5_low64(texts).tolist() == theirs


# ------------------------------------------------------------------------------------------ module keys

KEY_CASES = [
    ("AB" * 20, "/lib/a.so", KeyKind.BUILD_ID, "ab" * 20),
    (" 0x" + "cd" * 8 + " ", "/lib/b.so", KeyKind.BUILD_ID, "cd" * 8),
    (None, "/lib/c.so", KeyKind.PATH, "path:/lib/c.so"),
    ("", "/lib/d.so", KeyKind.PATH, "path:/lib/d.so"),
    ("not hex", "/lib/e.so", KeyKind.INVALID, "invalid:not hex"),
    ("abc", "/lib/f.so", KeyKind.INVALID, "invalid:abc"),  # odd number of digits
    ("z" * 300, "/lib/g.so", KeyKind.INVALID, "invalid:" + "z" * 200),
    (None, "", KeyKind.INVALID, "invalid:"),
]


@pytest.mark.parametrize("build_id,path,kind,encoded", KEY_CASES)
def test_module_key_one_encoding(build_id, path, kind, encoded) -> None:
    key = ModuleKey.of(build_id, path)
    assert (key.kind, str(key)) == (kind, encoded)
    assert ModuleKey.parse(encoded) == key
    assert key.build_id == (key.value if kind is KeyKind.BUILD_ID else None)


def test_module_key_column_is_the_scalar_encoding() -> None:
    build_ids = pa.array([case[0] for case in KEY_CASES], pa.string())
    paths = pa.array([case[1] for case in KEY_CASES], pa.string())
    assert module_key_column(build_ids, paths).to_pylist() == [case[3] for case in KEY_CASES]
