"""The stack stage (`tbpipe.pipeline.stacks`) against hand-written expectations.

The combined order: each hand-written case below states the order a person expects, and the
definition (`order.combined_order`), the ingest's columnar path (`layout.combined_slots`) and the
in-process path (`render.symbolize_stacks`) must each produce exactly it; tests/test_rules.py holds
the fast path to the definition on random stacks. Also here: the constants that the schemas and
the extension share, the stack hash's MD5 against DuckDB's, the module key's encoding, and what the
stack hash keeps apart.
"""

from __future__ import annotations

import hashlib
import random

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from tbpipe import _native
from tbpipe.pipeline.stacks import layout, order, render
from tbpipe.pipeline.symbols.model import SymbolizedFrame
from tbpipe.schemas import identity, raw
from tbpipe.schemas.lake import TABLES
from tbpipe.schemas.modulekey import KeyKind, ModuleKey

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


def test_md5_low64_hashes_arrow_columns_as_hashlib_does() -> None:
    # Lengths on each side of MD5's block and padding boundaries, and text that is not ASCII.
    texts = ["a" * n for n in (0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 128, 1000)] + ["é\u2603" * 40]
    expected = [int.from_bytes(hashlib.md5(t.encode()).digest()[8:], "little") for t in texts]
    assert identity.md5_low64(pa.array(texts, pa.string())).tolist() == expected
    assert identity.md5_low64(pa.array(texts, pa.large_string())).tolist() == expected
    # A slice reads its own texts, not the buffer's first ones; chunks are joined.
    assert identity.md5_low64(pa.array(texts, pa.string()).slice(3, 4)).tolist() == expected[3:7]
    chunked = pa.chunked_array([pa.array(texts[:5], pa.string()), pa.array(texts[5:], pa.string())])
    assert identity.md5_low64(chunked).tolist() == expected
    assert identity.md5_low64(pa.array([], pa.string())).tolist() == []
    # Python text with a lone surrogate hashes as its surrogatepass bytes.
    lone = "a\udc80"
    assert identity.md5_low64([lone]).tolist() == [
        int.from_bytes(hashlib.md5(lone.encode("utf-8", "surrogatepass")).digest()[8:], "little")
    ]
    with pytest.raises(ValueError, match="null"):
        identity.md5_low64(pa.array(["x", None], pa.string()))
    # Offsets that leave the data are refused, not read.
    with pytest.raises(ValueError, match="past the data"):
        _native.md5_low64(np.array([0, 9], dtype=np.int32), b"short")
    with pytest.raises(ValueError, match="not rising"):
        _native.md5_low64(np.array([0, 3, 1], dtype=np.int32), b"short")


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


# ------------------------------------------------------------------------------------------ stack hashes


def _random_raw_tables(rng: np.random.Generator, stacks: int) -> dict[str, pa.Table]:
    """A raw run's stacks, modules and code with every case the hash must keep apart or together:
    empty lists, markers (module -1), eval-loop and frame-pointer flags, a module index and code ids
    the run does not describe, two module rows with one index, negative lines; in two chunks."""
    flag_choices = [0, E, raw.NATIVE_FRAME_BY_FRAME_POINTER, raw.NATIVE_FRAME_EXACT_PC, M, E | 2]
    rows = []
    for stack in range(stacks):
        native = [
            {
                "module": int(rng.choice([-1, 0, 1, 2, 7])),
                "offset": int(rng.integers(0, 1 << 63, dtype=np.uint64)) | 1 << 63
                if rng.random() < 0.1
                else int(rng.integers(0, 5000)),
                "flags": int(rng.choice(flag_choices)),
            }
            for _ in range(int(rng.integers(0, 12)))
        ]
        python = [
            {
                "code_id": int(rng.choice([11, 12, 13, 99])),
                "offset": int(rng.integers(-1, 40)),
                "line": int(rng.integers(-1, 300)),
                "flags": int(rng.choice([0, ENTRY, raw.PYTHON_FRAME_LINE_RESOLVED, ENTRY | 2])),
            }
            for _ in range(int(rng.integers(0, 6)))
        ]
        status = int(rng.choice([0, raw.STACK_NO_NATIVE, raw.STACK_NATIVE_TRUNCATED]))
        rows.append({"stack_id": 1000 + stack, "thread_id": 1, "status": status, "native": native, "python": python})
    schema = raw.stacks_schema()
    half = len(rows) // 2
    modules = pa.table(
        {
            "module_index": [0, 1, 2, 1],  # index 7 is not described; index 1 twice (the first row counts)
            "path": ["/lib/a.so", "/lib/b.so", "/lib/c.so", "/lib/other.so"],
            "build_id": ["ab" * 20, None, "cd" * 8, "ef" * 20],
            "load_bias": pa.array([0, 0, 4096, 0], pa.uint64()),
            "exec_ranges": [[], [], [], []],
            "eval_ranges": [[], [], [], []],
        },
        schema=raw.modules_schema(),
    )
    code = pa.table(
        {
            "code_id": pa.array([11, 12, 13, 12], pa.uint64()),  # code id 99 is not described
            "filename": ["a.py", "b.py", "c.py", "b.py"],
            "qualname": ["f", "g", "Cls.h", "g"],
            "first_line": [1, 10, -1, 10],
        },
        schema=raw.code_schema(),
    )
    stacks_table = pa.concat_tables(
        [pa.Table.from_pylist(rows[:half], schema), pa.Table.from_pylist(rows[half:], schema)]
    )
    return {"stacks": stacks_table, "modules": modules, "code": code}


def test_the_stack_hash_keeps_apart_what_frames_mean_and_nothing_else() -> None:
    """The reference on random stacks: (nearly) one hash per stack; whether a line was resolved at
    capture leaves the hash as it is, an entry flag changes it."""
    tables = _random_raw_tables(np.random.default_rng(7), 400)
    hashes = identity.raw_stack_hashes(tables["stacks"], tables["modules"], tables["code"])
    assert len(set(hashes.tolist())) > 350
    stacks = tables["stacks"].to_pylist()[:3]
    for stack, flags in zip(stacks, (ENTRY, ENTRY | raw.PYTHON_FRAME_LINE_RESOLVED, 0)):
        stack["native"], stack["status"] = [], 0
        stack["python"] = [{"code_id": 11, "offset": 0, "line": 5, "flags": flags}]
    changed = identity.raw_stack_hashes(
        pa.Table.from_pylist(stacks, raw.stacks_schema()), tables["modules"], tables["code"]
    )
    assert changed[0] == changed[1] != changed[2]


def test_frames_of_chosen_stacks_across_a_batch() -> None:
    """A batch's frames, asked for in any order, are each run's own with references into the batch's tables."""
    import pyarrow.compute as pc

    from tbpipe.pipeline.stacks.flatten import concat_flat_runs, flatten_run

    rng = np.random.default_rng(3)
    runs = [_random_raw_tables(rng, count) for count in (30, 1, 45)]
    # The last run's stacks in three chunks, sliced out of one table (as parts read one by one come):
    # its frames are gathered chunk by chunk.
    stacks = runs[2]["stacks"]
    runs[2]["stacks"] = pa.concat_tables([stacks.slice(0, 10), stacks.slice(10, 20), stacks.slice(30)])
    assert runs[2]["stacks"]["native"].num_chunks >= 3
    flats = [flatten_run(tables) for tables in runs]
    batch, run_of = concat_flat_runs(flats)
    chosen = rng.permutation(len(batch.raw_ids))[:50]
    frames = batch.frames(chosen)
    module_base = np.cumsum([0] + [f.modules.num_rows for f in flats])
    code_base = np.cumsum([0] + [f.code.num_rows for f in flats])
    native_at = python_at = 0
    for stack in chosen.tolist():
        run = int(run_of[stack])
        local = stack - sum(len(f.raw_ids) for f in flats[:run])
        row = runs[run]["stacks"].filter(pc.equal(runs[run]["stacks"]["stack_id"], int(flats[run].raw_ids[local])))
        native, python = row["native"][0].as_py(), row["python"][0].as_py()
        assert frames.native_lengths.tolist()[chosen.tolist().index(stack)] == len(native)
        for frame in native:
            ref = int(frames.native_ref[native_at])
            known = frame["module"] in (0, 1, 2)
            assert (ref >= 0) == known
            if known:
                assert batch.modules["module_index"][ref].as_py() == frame["module"]
                assert module_base[run] <= ref < module_base[run + 1]
            assert (int(frames.native_address[native_at]), int(frames.native_flags[native_at])) == (
                frame["offset"],
                frame["flags"],
            )
            native_at += 1
        for frame in python:
            ref = int(frames.python_ref[python_at])
            assert (ref >= 0) == (frame["code_id"] != 99)
            if ref >= 0:
                assert batch.code["code_id"][ref].as_py() == frame["code_id"]
                assert code_base[run] <= ref < code_base[run + 1]
            assert (int(frames.python_line[python_at]), int(frames.python_flags[python_at])) == (
                frame["line"],
                frame["flags"],
            )
            python_at += 1
    assert (native_at, python_at) == (len(frames.native_address), len(frames.python_line))


def test_stack_hashing_refuses_offsets_outside_the_frames() -> None:
    empty_u64 = np.zeros(0, np.uint64)
    frames = (np.zeros(3, np.int32), np.zeros(3, np.uint64), np.zeros(3, np.uint32))
    python = (np.zeros(2, np.int32), empty_u64, np.zeros(0, np.int32), np.zeros(0, np.uint32))
    keys = (np.zeros(0, np.int64), empty_u64, empty_u64, empty_u64)
    status = np.zeros(1, np.uint32)
    for offsets, problem in (
        ([0, 4], "offsets past the frames"),
        ([2, 1], "offsets go down"),
        ([-1, 2], "negative offset"),
    ):
        with pytest.raises(ValueError, match=problem):
            _native.hash_raw_stacks(status, np.array(offsets, np.int32), *frames, *python, *keys)
    with pytest.raises(ValueError, match="contiguous"):
        _native.hash_raw_stacks(status, np.array([0, 3, 3], np.int32)[::2], *frames, *python, *keys)
    assert len(_native.hash_raw_stacks(status, np.array([0, 3], np.int32), *frames, *python, *keys)) == 8


def test_combined_order_refuses_lengths_outside_the_frames() -> None:
    bits = (1, 2, 4, 8)
    status, flags = np.zeros(2, np.uint32), np.zeros(3, np.uint32)
    for native, python, problem in (
        ([2, 2], [1, 2], "lengths do not add up"),
        ([-1, 4], [1, 2], "negative length"),
        ([3], [1, 2], "one per stack"),
        ([2**63 - 1, 2**63 - 1], [1, 2], "lengths do not add up"),  # a sum that would wrap to 0 - 2
    ):
        with pytest.raises(ValueError, match=problem):
            _native.combined_order(np.array(native, np.int64), np.array(python, np.int64), status, flags, flags, *bits)
    # Stack 0: an eval loop standing for two Python frames; stack 1: a native frame, then an eval loop
    # standing for one Python frame.
    native_flags, python_flags = np.array([4, 0, 4], np.uint32), np.array([0, 8, 8], np.uint32)
    lengths = np.array([1, 2], np.int64), np.array([2, 1], np.int64)
    owner, source, is_python, slot, *_ = _native.combined_order(*lengths, status, native_flags, python_flags, *bits)
    assert np.frombuffer(owner, np.int64).tolist() == [0, 0, 1, 1]
    assert np.frombuffer(source, np.int64).tolist() == [0, 1, 1, 2]
    assert np.frombuffer(is_python, np.bool_).tolist() == [True, True, False, True]
    assert np.frombuffer(slot, np.int32).tolist() == [0, 1, 0, 1]


def test_slot_columns_gathers_each_slot_and_refuses_rows_outside_the_columns() -> None:
    """Slots: a Python frame of code row 1 placed from code origins, a native frame at an exact PC,
    a marker (its address the stop reason, never an exact PC whatever its bits), a Python frame of
    no known code object."""
    marker, exact, origin = raw.NATIVE_FRAME_MARKER, raw.NATIVE_FRAME_EXACT_PC, 1 << 16
    native_flags = np.array([exact, marker | exact], np.uint32)
    native = (np.array([3, -1], np.int64), np.array([0x1234, 2], np.uint64), native_flags)
    python = (np.array([1, -1], np.int64), np.array([10, 20], np.int32), np.array([origin, 0], np.uint32))
    first_lines = np.array([5, 7], np.int32)
    kinds = (layout.PYTHON, layout.NATIVE, layout.MARKER)

    def gather(source, is_python, python_ref=python[0]):
        return _native.slot_columns(
            np.array(source, np.int64),
            np.array(is_python, np.uint8),
            *native,
            python_ref,
            *python[1:],
            first_lines,
            marker,
            exact,
            origin,
            *kinds,
        )

    columns = gather([0, 0, 1, 1], [1, 0, 0, 1])
    dtypes = (np.int8, np.int64, np.int64, np.uint64, np.bool_, np.int32, np.bool_, np.int32)
    kind, module_row, code_row, address, is_exact, line, inlined, first_line = (
        np.frombuffer(data, dtype).tolist() for data, dtype in zip(columns, dtypes)
    )
    assert kind == [layout.PYTHON, layout.NATIVE, layout.MARKER, layout.PYTHON]
    assert module_row == [-1, 3, -1, -1]
    assert code_row == [1, -1, -1, -1]
    assert address == [0, 0x1234, 2, 0]
    assert is_exact == [False, True, False, False]
    assert line == [10, -1, -1, 20]
    assert inlined == [True, False, False, False]
    assert first_line == [7, -1, -1, -1]
    for source, is_python, refs, problem in (
        ([2], [0], python[0], "native frame is outside"),
        ([-1], [1], python[0], "Python frame is outside"),
        ([2], [1], python[0], "Python frame is outside"),  # one past the last
        ([0], [1], np.array([2, -1], np.int64), "code row is outside"),
        ([0, 1], [1], python[0], "one each per slot"),
    ):
        with pytest.raises(ValueError, match=problem):
            gather(source, is_python, refs)


@pytest.mark.parametrize("exact_pass_only", [False, True])
def test_distinct_rows_groups_equal_rows_exactly(exact_pass_only) -> None:
    """Ids number the distinct rows in order of first appearance, whichever pass assigns them; rows
    that differ in one byte anywhere (the tail past the last 8-byte word too) never share an id."""
    rng = np.random.default_rng(5)
    for width in (1, 7, 8, 13, 24):
        values = rng.integers(0, 256, size=(300, width), dtype=np.uint8)
        values[1] = values[0]
        values[2] = values[0]
        values[2, -1] ^= 1  # differs from row 0 in its last byte only
        rows = values[rng.integers(0, 300, 5000)]
        rows[:3] = values[:3]
        ids, first = _native.distinct_rows(rows.ravel(), width, exact_pass_only=exact_pass_only)
        ids, first = np.frombuffer(ids, np.int64), np.frombuffer(first, np.int64)
        _, expected_first = np.unique(rows, axis=0, return_index=True)
        # Each row's id stands for its own bytes, and there are as many ids as distinct rows.
        assert np.array_equal(rows[first[ids]], rows)
        assert len(first) == len(expected_first)
        assert np.array_equal(first, np.sort(expected_first))  # first appearances, in order
        assert ids[0] == ids[1] != ids[2]
    with pytest.raises(ValueError, match="multiple of the width"):
        _native.distinct_rows(np.zeros(10, np.uint8), 3)


# ------------------------------------------------------------------------------------------ inline expansion


def _random_slots_and_symbols(rng: random.Random, stacks: int) -> tuple[layout.Slots, pa.Table]:
    """Slots of random stacks over a few modules (one undescribed, two paths of one build), and the
    inline chains of some of their addresses (depths listed out of order, one module no slot names)."""
    modules = [("/lib/a.so", "ka"), ("/lib/b.so", "kb"), ("/copy/b.so", "kb"), ("/lib/gone.so", None)]
    columns: dict[str, list] = {name: [] for name in ("stack_id", "slot", *layout.FRAME_COLUMNS)}
    for stack in range(stacks):
        for slot in range(rng.randrange(1, 9)):
            kind = rng.choice([layout.PYTHON, layout.NATIVE, layout.NATIVE, layout.MARKER])
            path, key = rng.choice(modules) if kind == layout.NATIVE else (None, None)
            python = kind == layout.PYTHON
            stop = rng.choice([1, 2])
            row = {
                "stack_id": 10 + 3 * stack,
                "slot": slot,
                "kind": kind,
                "function": rng.choice(["f", "g"])
                if python
                else (f"<stopped {stop}>" if kind == layout.MARKER else None),
                "file": rng.choice(["x.py", "y.py"]) if python else None,
                "line": rng.choice([3, 4]) if python else -1,
                "first_line": rng.choice([1, 2]) if python else -1,
                "module": path,
                "module_key": key,
                "address": rng.choice([0x10, 0x20, 0x30])
                if kind == layout.NATIVE
                else (stop if kind == layout.MARKER else 0),
                "exact": kind == layout.NATIVE and rng.random() < 0.3,
                "reason": f"reason {stop}" if kind == layout.MARKER else None,
                "inlined": python and rng.random() < 0.2,
            }
            for name, value in row.items():
                columns[name].append(value)
    symbol_rows = []
    for key in ("ka", "kb", "kz"):
        for address in (0x10, 0x20):
            for exact in (False, True):
                if rng.random() < 0.7:
                    depths = list(range(rng.randrange(1, 4)))
                    rng.shuffle(depths)
                    for depth in depths:
                        symbol_rows.append(
                            {
                                "module_key": key,
                                "address": address,
                                "exact": exact,
                                "depth": depth,
                                "function": f"{key}:{address:x}:{int(exact)}:{depth}",
                                "file": "lib.cc",
                                "line": rng.choice([0, 7]),
                                "inlined": depth > 0,
                                "reason": None,
                            }
                        )
    slots = layout.Slots(
        stack_id=np.array(columns["stack_id"], np.int64),
        slot=np.array(columns["slot"], np.int32),
        kind=np.array(columns["kind"], np.int8),
        function=pa.array(columns["function"], pa.string()),
        file=pa.array(columns["file"], pa.string()),
        line=np.array(columns["line"], np.int32),
        first_line=np.array(columns["first_line"], np.int32),
        module=pa.array(columns["module"], pa.string()),
        module_key=pa.array(columns["module_key"], pa.string()),
        address=np.array(columns["address"], np.uint64),
        exact=np.array(columns["exact"], bool),
        reason=pa.array(columns["reason"], pa.string()),
        inlined=np.array(columns["inlined"], bool),
    )
    # The lake's symbols rows, with the unsigned addresses `expand` reads.
    symbols = pa.Table.from_pylist(symbol_rows, schema=TABLES["symbols"].schema)
    symbols = symbols.set_column(1, "address", symbols["address"].cast(pa.uint64()))
    return slots, symbols


def _expanded_by_definition(slots: layout.Slots, symbols: pa.Table) -> tuple[list[dict], list[tuple]]:
    """Each slot's rows, slot by slot: a native slot whose (module key, address, exact) has symbols
    rows becomes them by depth; any other slot is one row of its own. Also each row's identity: what
    makes two rows one frame."""
    chains: dict[tuple, list[tuple[int, dict]]] = {}
    for index, row in enumerate(symbols.to_pylist()):
        chains.setdefault((row["module_key"], row["address"], row["exact"]), []).append((index, row))
    rows, identities = [], []
    depth, previous = 0, None
    for s in range(len(slots)):
        stack_id = int(slots.stack_id[s])
        depth = 0 if stack_id != previous else depth
        previous = stack_id
        kind = int(slots.kind[s])
        module, key = slots.module[s].as_py(), slots.module_key[s].as_py()
        address, exact, inlined = int(slots.address[s]), bool(slots.exact[s]), bool(slots.inlined[s])
        chain = chains.get((key, address, exact), []) if kind == layout.NATIVE and key is not None else []
        base = {"stack_id": stack_id, "slot": int(slots.slot[s])}
        native = {"kind": "native", "module": module, "module_key": key, "address": address, "exact": exact}
        for chain_depth, (index, symbol) in enumerate(sorted(chain, key=lambda item: item[1]["depth"])):
            line = symbol["line"] if symbol["line"] > 0 else None
            rows.append(
                base
                | native
                | {"depth": depth, "chain_depth": chain_depth, "function": symbol["function"], "file": symbol["file"]}
                | {"line": line, "first_line": None, "inlined": symbol["inlined"], "reason": symbol["reason"]}
            )
            identities.append(("chain", index, module, inlined))
            depth += 1
        if chain:
            continue
        own = base | {"depth": depth, "chain_depth": 0}
        if kind == layout.PYTHON:
            frame = {"kind": "python", "function": slots.function[s].as_py(), "file": slots.file[s].as_py()}
            frame |= {"line": int(slots.line[s]), "first_line": int(slots.first_line[s]), "inlined": inlined}
            frame |= {"module": None, "module_key": None, "address": None, "exact": None, "reason": None}
        elif kind == layout.NATIVE:
            reason = layout.NOT_SYMBOLIZED_REASON if key is not None else layout.NO_MODULE_REASON
            frame = native | {"function": None, "file": None, "line": None, "first_line": None}
            frame |= {"inlined": False, "reason": reason}
        else:
            frame = {"kind": "marker", "function": slots.function[s].as_py(), "file": None, "line": None}
            frame |= {"first_line": None, "module": None, "module_key": None, "address": address, "exact": None}
            frame |= {"inlined": False, "reason": slots.reason[s].as_py()}
        rows.append(own | frame)
        identities.append(("own", *sorted(frame.items(), key=lambda item: item[0])))
        depth += 1
    return rows, identities


def test_inline_expansion_is_the_definition() -> None:
    """`layout.expand` (one pass in the extension) against a slot-by-slot expansion: the same rows and
    frames, one frame per distinct identity, frames numbered in order of first appearance, and each
    stack's frame count and innermost symbolized frame."""
    for seed in range(6):
        slots, symbols = _random_slots_and_symbols(random.Random(seed), 40)
        expanded = layout.expand(slots, symbols)
        expected, identities = _expanded_by_definition(slots, symbols)
        table = expanded.table()
        assert table.select(list(expected[0])).to_pylist() == expected
        frame = expanded.rows["frame"].to_numpy()
        ids, first_row = np.unique(frame, return_index=True)
        assert ids.tolist() == list(range(len(ids))) and np.all(np.diff(first_row) > 0)  # by first appearance
        frame_of_identity: dict[tuple, int] = {}
        for key, frame_id in zip(identities, frame.tolist()):
            assert frame_of_identity.setdefault(key, frame_id) == frame_id
        assert len(set(frame_of_identity.values())) == expanded.frames.num_rows == len(frame_of_identity)
        stacks = sorted({row["stack_id"] for row in expected})
        assert expanded.stack_order.tolist() == stacks
        assert expanded.per_stack_frames.tolist() == [sum(r["stack_id"] == s for r in expected) for s in stacks]
        innermost = [
            next((r["depth"] for r in expected if r["stack_id"] == s and r["kind"] != "marker" and r["function"]), -1)
            for s in stacks
        ]
        assert expanded.symbolized_depth.tolist() == innermost
