"""The stacks' flattening (pipeline/stacks/flatten.py) and layout (pipeline/stacks/layout.py) on small
hand-made inputs with hand-computed results: which rows frames refer to (the first of equal keys, -1 for
what a run does not describe), frames gathered chunk by chunk and run by run in the order asked for,
written hashes that differ, the slots' texts (stop reasons by code), the codes of texts held twice in a
dictionary, which native slots are looked up, and the inline expansion's rows and frames."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tbpipe.pipeline.stacks import flatten, layout
from tbpipe.schemas import identity, raw
from tbpipe.schemas.lake import TABLES

E = raw.NATIVE_FRAME_EVAL_LOOP
M = raw.NATIVE_FRAME_MARKER
X = raw.NATIVE_FRAME_EXACT_PC
ENTRY = raw.PYTHON_FRAME_ENTRY
BIG = 2**63 + 5  # past int64: an unsigned column read as signed would go wrong


# ------------------------------------------------------------------------------------------ flattening


def test_a_column_as_numpy_whatever_its_chunks() -> None:
    two = pa.chunked_array([pa.array([1, 2], pa.uint64()), pa.array([BIG], pa.uint64())])
    one = pa.chunked_array([pa.array([BIG, 3], pa.uint64())])
    for column, expected in ((two, [1, 2, BIG]), (one, [BIG, 3]), (pa.array([7], pa.uint64()), [7])):
        values = flatten._numpy(column, np.uint64)
        assert values.dtype == np.uint64 and values.tolist() == expected
    empty = flatten._numpy(pa.chunked_array([], pa.int32()), np.uint32)
    assert empty.dtype == np.uint32 and len(empty) == 0
    assert flatten._numpy(pa.chunked_array([pa.array([-1], pa.int32())]), np.int64).dtype == np.int64


def test_a_key_finds_the_first_row_holding_it_and_an_absent_key_none() -> None:
    keys = np.array([5, 7, 5, 9], np.int64)
    rows = flatten._rows_of(keys, np.array([5, 9, 8, 7, 5], np.int64), pa.int64())
    assert rows.dtype == np.int64 and rows.tolist() == [0, 3, -1, 1, 0]
    unsigned = flatten._rows_of(np.array([1, BIG], np.uint64), np.array([BIG, 2], np.uint64), pa.uint64())
    assert unsigned.tolist() == [1, -1]
    none = flatten._rows_of(np.zeros(0, np.int64), np.array([1, 2], np.int64), pa.int64())
    assert none.dtype == np.int64 and none.tolist() == [-1, -1]


def test_rows_are_the_identity_only_when_each_row_is_its_own() -> None:
    assert flatten._is_identity(np.array([0, 1, 2]), 3)
    assert flatten._is_identity(np.zeros(0, np.int64), 0)
    assert not flatten._is_identity(np.array([0, 1]), 3)
    assert not flatten._is_identity(np.array([0, 2, 1]), 3)
    assert not flatten._is_identity(np.array([1, 2, 3]), 3)


def test_spans_and_the_frames_of_chosen_lists() -> None:
    spans = flatten._spans(np.array([5, 0, 2], np.int64), np.array([2, 0, 3], np.int64))
    assert spans.tolist() == [5, 6, 2, 3, 4]
    assert flatten._spans(np.zeros(0, np.int64), np.zeros(0, np.int64)).tolist() == []
    # Lists of 2, 1 and 3 frames laid end to end: frames 0-1, 2, 3-5.
    lengths = np.array([2, 1, 3], np.uint32)
    assert flatten._frames_of(lengths, np.array([2, 0], np.int64)).tolist() == [3, 4, 5, 0, 1]
    assert flatten._frames_of(lengths, np.array([1, 1], np.int64)).tolist() == [2, 2]


def native_list(*frames: tuple[int, int, int]) -> list[dict]:
    return [{"module": m, "offset": o, "flags": f} for m, o, f in frames]


NATIVE_TYPE = raw.stacks_schema().field("native").type


def test_list_frames_are_gathered_chunk_by_chunk_in_the_order_asked_for() -> None:
    lists = [
        native_list((0, 10, 0), (1, 11, X)),
        native_list(),
        native_list((2, BIG, E)),
        native_list((3, 13, 0), (4, 14, 0), (5, 15, M)),
    ]
    fields = (("module", np.int64), ("offset", np.uint64), ("flags", np.uint32))
    chunked = pa.chunked_array(
        [pa.array(lists[:2], NATIVE_TYPE), pa.array(lists[2:3], NATIVE_TYPE), pa.array(lists[3:], NATIVE_TYPE)]
    )
    whole = pa.chunked_array([pa.array(lists, NATIVE_TYPE)])
    rows = np.array([3, 0, 2, 1, 0], np.int64)
    expected_module = [3, 4, 5, 0, 1, 2, 0, 1]
    expected_offset = [13, 14, 15, 10, 11, BIG, 10, 11]
    expected_flags = [0, 0, M, 0, X, E, 0, X]
    for column in (chunked, whole, pa.array(lists, NATIVE_TYPE)):
        module, offset, flags = flatten._list_frames(column, rows, fields)
        assert (module.dtype, offset.dtype, flags.dtype) == (np.int64, np.uint64, np.uint32)
        assert module.tolist() == expected_module
        assert offset.tolist() == expected_offset
        assert flags.tolist() == expected_flags
    # A chunk that is a slice of a longer list array: its offsets do not start at 0.
    sliced = pa.chunked_array([pa.array(lists, NATIVE_TYPE).slice(2, 2)])
    module, offset, _ = flatten._list_frames(sliced, np.array([1, 0], np.int64), fields)
    assert module.tolist() == [3, 4, 5, 2] and offset.tolist() == [13, 14, 15, BIG]


def raw_tables(
    stacks: list[tuple[int, int, list, list]], modules=((0, "/lib/a.so", "aa" * 20), (1, "/lib/b.so", None)), code=()
) -> dict[str, pa.Table]:
    """A raw run: stacks as (stack_id, status, native frames, python frames), split in two chunks."""
    rows = [
        {
            "stack_id": stack_id,
            "thread_id": 1,
            "status": status,
            "native": native_list(*native),
            "python": [{"code_id": c, "offset": 0, "line": line, "flags": f} for c, line, f in python],
        }
        for stack_id, status, native, python in stacks
    ]
    half = max(1, len(rows) // 2)
    schema = raw.stacks_schema()
    table = pa.concat_tables([pa.Table.from_pylist(rows[:half], schema), pa.Table.from_pylist(rows[half:], schema)])
    modules_table = pa.Table.from_pylist(
        [
            {"module_index": i, "path": p, "build_id": b, "load_bias": 0, "exec_ranges": [], "eval_ranges": []}
            for i, p, b in modules
        ],
        schema=raw.modules_schema(),
    )
    code_table = pa.Table.from_pylist(
        [{"code_id": c, "filename": f, "qualname": q, "first_line": first} for c, f, q, first in code],
        schema=raw.code_schema(),
    )
    return {"stacks": table, "modules": modules_table, "code": code_table}


CODE = ((BIG, "b.py", "g", 20), (3, "a.py", "f", 1), (BIG, "b2.py", "g2", 21), (9, "c.py", "h", 5))


def run_one() -> dict[str, pa.Table]:
    # Module index 1 twice (its first row counts), index 7 not described; code id 4 not described,
    # code id BIG twice (its first row counts).
    return raw_tables(
        [
            (30, raw.STACK_NATIVE_TRUNCATED, [(1, 100, 0), (7, 101, X)], [(BIG, 22, ENTRY)]),
            (10, 0, [], [(3, 2, 0), (4, 5, 0), (9, -1, ENTRY)]),
            (20, raw.STACK_NO_NATIVE, [(0, 102, E), (-1, 5, M)], []),
            (10, 0, [], [(3, 2, 0), (4, 5, 0), (9, -1, ENTRY)]),
        ],
        modules=((0, "/lib/a.so", "aa" * 20), (1, "/lib/b.so", None), (1, "/lib/b2.so", "bb" * 20)),
        code=CODE,
    )


def test_a_run_flattened_keeps_each_stack_once_and_its_first_rows_of_modules_and_code() -> None:
    tables = run_one()
    flat = flatten.flatten_run(tables)
    assert flat.raw_ids.tolist() == [10, 20, 30]
    assert flat.status.dtype == np.uint32 and flat.status.tolist() == [
        0,
        raw.STACK_NO_NATIVE,
        raw.STACK_NATIVE_TRUNCATED,
    ]
    assert flat.native_lengths.tolist() == [0, 2, 2] and flat.python_lengths.tolist() == [3, 0, 1]
    assert flat.native_lengths.dtype == flat.python_lengths.dtype == np.int64
    assert flat.hashes.dtype == np.uint64
    by_reference = identity.raw_stack_hashes(tables["stacks"], tables["modules"], tables["code"])
    assert flat.hashes.tolist() == [by_reference[1], by_reference[2], by_reference[0]]
    # Code: distinct ids in order, each its first row.
    assert flat.code.to_pylist() == [
        {"code_id": 3, "filename": "a.py", "qualname": "f", "first_line": 1},
        {"code_id": 9, "filename": "c.py", "qualname": "h", "first_line": 5},
        {"code_id": BIG, "filename": "b.py", "qualname": "g", "first_line": 20},
    ]
    assert flat.modules["path"].to_pylist() == ["/lib/a.so", "/lib/b.so", "/lib/b2.so"]
    assert flat.has_frames
    frames = flat.frames(np.array([2, 0, 1]))
    assert frames.status.tolist() == [raw.STACK_NATIVE_TRUNCATED, 0, raw.STACK_NO_NATIVE]
    assert frames.native_lengths.tolist() == [2, 0, 2] and frames.python_lengths.tolist() == [1, 3, 0]
    assert frames.native_ref.tolist() == [1, -1, 0, -1]
    assert frames.native_address.tolist() == [100, 101, 102, 5]
    assert frames.native_flags.tolist() == [0, X, E, M]
    assert frames.python_ref.tolist() == [2, 0, -1, 1]
    assert frames.python_line.tolist() == [22, 2, 5, -1]
    assert frames.python_flags.tolist() == [ENTRY, 0, 0, ENTRY]
    assert set(frames.slot_arguments()) == {
        "status", "native_lengths", "python_lengths", "native_ref", "native_address", "native_flags",
        "python_ref", "python_line", "python_flags",
    }  # fmt: skip


def test_a_run_whose_code_ids_are_distinct_and_in_order_keeps_its_code_table() -> None:
    tables = raw_tables([(1, 0, [], [(3, 4, 0), (9, 6, 0)])], code=((3, "a.py", "f", 1), (9, "c.py", "h", 5)))
    flat = flatten.flatten_run(tables)
    assert flat.code.to_pylist() == tables["code"].to_pylist()
    assert flat.frames(np.array([0])).python_ref.tolist() == [0, 1]


def test_written_hashes_that_differ_from_the_frames_are_counted() -> None:
    tables = run_one()
    flat = flatten.flatten_run(tables)
    right = {10: int(flat.hashes[0]), 20: int(flat.hashes[1]), 30: int(flat.hashes[2])}

    def counted(written: list) -> int:
        stacks = tables["stacks"].set_column(5, "stack_hash", pa.array(written, pa.uint64()))
        return flatten.differing_written_hashes({**tables, "stacks": stacks}, flat)

    ids = tables["stacks"]["stack_id"].to_pylist()  # 30, 10, 20, 10
    assert counted([right[i] for i in ids]) == 0
    assert counted([right[30] ^ 1, right[10], right[20], right[10] ^ 2]) == 2
    assert counted([None, right[10] ^ 1, None, right[10]]) == 1  # a null is not a difference
    assert counted([right[30], right[10], 0, right[10]]) == 1  # 0 written is a difference
    assert counted([None] * 4) == 0  # parts written before raw schema 4
    wrong = tables["stacks"].set_column(5, "stack_hash", pa.array([1, 2, 3, 4], pa.uint64()))
    assert flatten.differing_written_hashes({**tables, "stacks": wrong}, flat) == 4
    assert flatten.differing_written_hashes({**tables, "stacks": wrong.drop_columns(["stack_hash"])}, flat) == 0
    no_origins = pa.table({"file": pa.array([], pa.string())})
    assert flatten.differing_written_hashes({**tables, "stacks": wrong, "code_origins": no_origins}, flat) == 4
    origins = pa.table({"file": ["g.py"]})
    assert flatten.differing_written_hashes({**tables, "stacks": wrong, "code_origins": origins}, flat) == 0


def run_two() -> dict[str, pa.Table]:
    return raw_tables(
        [
            (5, 0, [(0, 200, 0)], [(3, 7, ENTRY)]),
            (6, 0, [(1, 201, 0), (4, 202, 0)], [(8, 8, 0), (3, 9, 0)]),
        ],
        modules=((4, "/lib/d.so", "dd" * 20), (0, "/lib/e.so", None)),
        code=((3, "x.py", "k", 2),),
    )


def test_runs_in_one_batch_give_the_frames_asked_for_with_references_into_the_batch() -> None:
    flats = [flatten.flatten_run(run_one()), flatten.flatten_run(run_two())]
    batch, run_of = flatten.concat_flat_runs(flats)
    assert run_of.tolist() == [0, 0, 0, 1, 1]
    assert batch.raw_ids.tolist() == [10, 20, 30, 5, 6]
    assert batch.status.tolist() == [0, raw.STACK_NO_NATIVE, raw.STACK_NATIVE_TRUNCATED, 0, 0]
    assert batch.native_lengths.tolist() == [0, 2, 2, 1, 2] and batch.python_lengths.tolist() == [3, 0, 1, 1, 2]
    assert batch.hashes.tolist() == [*flats[0].hashes.tolist(), *flats[1].hashes.tolist()]
    assert batch.modules.num_rows == 5 and batch.code.num_rows == 4
    assert batch.has_frames
    # Run two's modules are rows 3 and 4, its code row 3; what a run does not describe stays -1.
    expected = {
        0: ([], [], [0, -1, 1], [2, 5, -1]),
        1: ([0, -1], [102, 5], [], []),
        2: ([1, -1], [100, 101], [2], [22]),
        3: ([4], [200], [3], [7]),
        4: ([-1, 3], [201, 202], [-1, 3], [8, 9]),
    }
    for chosen in ([4, 0, 3, 2], [0, 1, 2, 3, 4], [3, 1], [1, 4, 2, 0, 3], [3, 4, 0]):
        frames = batch.frames(np.array(chosen))
        assert frames.native_ref.dtype == frames.python_ref.dtype == np.int64
        assert frames.native_ref.tolist() == [r for s in chosen for r in expected[s][0]], chosen
        assert frames.native_address.tolist() == [a for s in chosen for a in expected[s][1]], chosen
        assert frames.python_ref.tolist() == [r for s in chosen for r in expected[s][2]], chosen
        assert frames.python_line.tolist() == [line for s in chosen for line in expected[s][3]], chosen
        assert frames.native_lengths.tolist() == [len(expected[s][0]) for s in chosen]
    flags = batch.frames(np.array([4, 2]))
    assert flags.native_flags.tolist() == [0, 0, 0, X] and flags.python_flags.tolist() == [0, 0, ENTRY]
    none = batch.frames(np.zeros(0, np.int64))
    assert all(len(column) == 0 for column in (none.native_ref, none.python_ref, none.native_address))
    alone, run_of_one = flatten.concat_flat_runs(flats[:1])
    assert alone is flats[0] and run_of_one.tolist() == [0, 0, 0] and run_of_one.dtype == np.int64


def test_a_run_read_without_its_frames_refuses_to_give_them() -> None:
    tables = run_one()
    stacks = tables["stacks"].set_column(5, "stack_hash", pa.array([3, 1, 2, 1], pa.uint64()))
    known = flatten.known_stacks_run(stacks, tables["modules"])
    assert known.raw_ids.tolist() == [10, 20, 30] and known.hashes.tolist() == [1, 2, 3]
    assert not known.has_frames
    with pytest.raises(ValueError, match="known_stacks_run"):
        known.frames(np.array([0]))
    batch, _ = flatten.concat_flat_runs([flatten.flatten_run(run_two()), known])
    assert not batch.has_frames


# ------------------------------------------------------------------------------------------ layout


def test_taking_rows_gives_null_for_minus_one_and_a_dictionary_keeps_its_texts() -> None:
    values = pa.array(["a", "b", None])
    assert layout._take(values, np.array([1, -1, 0, 2])).to_pylist() == ["b", None, "a", None]
    nothing = layout._take(pa.array([], pa.string()), np.array([-1, -1]))
    assert nothing.type == pa.string() and nothing.to_pylist() == [None, None]
    chunked = pa.chunked_array([["x", "y"], ["z"]])
    encoded = layout._dictionary(chunked, np.array([2, -1, 0, 2], np.int64))
    assert encoded.type == pa.dictionary(pa.int32(), pa.string())
    assert encoded.to_pylist() == ["z", None, "x", "z"]
    assert layout._plain(encoded).type == pa.string() and layout._plain(encoded).to_pylist() == ["z", None, "x", "z"]
    assert layout._plain(values) is values


def test_stop_texts_per_distinct_code_with_unknown_codes_named() -> None:
    texts, reasons, of = layout._stop_texts(np.array([5, 1, 5, 42], np.uint64))
    assert reasons.to_pylist() == ["PC outside every loaded module", "depth limit reached", "stop reason 42"]
    assert texts.to_pylist() == [f"<native walk stopped: {r}>" for r in reasons.to_pylist()]
    assert of.dtype == np.int64 and of.tolist() == [1, 0, 1, 2]


def test_codes_give_one_integer_per_text_even_when_a_dictionary_holds_it_twice() -> None:
    assert layout._codes(pa.array(["a", None, "b", "a"])).tolist() == [0, -1, 1, 0]
    assert layout._codes(pa.array(["a"])).tolist() == [0]
    assert layout._codes(pa.chunked_array([["b"], [None, "b", "c"]])).tolist() == [0, -1, 0, 1]
    twice = pa.DictionaryArray.from_arrays(pa.array([2, 0, None, 1], pa.int32()), pa.array(["f", "g", "f"]))
    codes = layout._codes(twice)
    assert codes.dtype == np.int64 and codes.tolist() == [0, 0, -1, 1]
    empty = layout._codes(pa.array([], pa.string()))
    assert empty.dtype == np.int64 and len(empty) == 0


def test_a_dictionary_of_narrow_indices_and_every_value_used_still_has_room_for_nulls() -> None:
    texts = pa.array([f"t{i}" for i in range(128)])
    narrow = pa.DictionaryArray.from_arrays(pa.array([127, None, 0], pa.int8()), texts)
    assert layout._per_index(narrow, np.arange(128) * 2).tolist() == [254, -1, 0]
    assert layout._codes(narrow).tolist() == [127, -1, 0]
    assert layout._index_in(narrow, pa.array(["t0", "t127"])).tolist() == [1, -1, 0]


def test_index_in_a_set_of_texts() -> None:
    value_set = pa.array(["k1", "k2"])
    plain = layout._index_in(pa.array(["k2", None, "zz", "k1"]), value_set)
    assert plain.dtype == np.int64 and plain.tolist() == [1, -1, -1, 0]
    keys = pa.DictionaryArray.from_arrays(pa.array([1, None, 0, 2], pa.int32()), pa.array(["k1", "k2", "zz"]))
    found = layout._index_in(pa.chunked_array([keys]), value_set)
    assert found.dtype == np.int64 and found.tolist() == [1, -1, 0, -1]


def slots_of(rows: list[tuple], inlined: list[bool] | None = None) -> layout.Slots:
    """Slots from rows (stack_id, slot, kind, function, file, line, first_line, module, module_key,
    address, exact, reason)."""
    column = list(zip(*rows))
    return layout.Slots(
        stack_id=np.array(column[0], np.int64),
        slot=np.array(column[1], np.int32),
        kind=np.array(column[2], np.int8),
        function=pa.array(column[3], pa.string()),
        file=pa.array(column[4], pa.string()),
        line=np.array(column[5], np.int32),
        first_line=np.array(column[6], np.int32),
        module=pa.array(column[7], pa.string()),
        module_key=pa.array(column[8], pa.string()),
        address=np.array(column[9], np.uint64),
        exact=np.array(column[10], bool),
        reason=pa.array(column[11], pa.string()),
        inlined=None if inlined is None else np.array(inlined, bool),
    )


P, N, K = layout.PYTHON, layout.NATIVE, layout.MARKER


def test_symbols_are_looked_up_once_per_module_key_address_and_exactness() -> None:
    slots = slots_of(
        [
            (1, 0, N, None, None, -1, -1, "/a.so", "ka", 16, False, None),
            (1, 1, N, None, None, -1, -1, "/a.so", "ka", 16, True, None),
            (1, 2, P, "f", "f.py", 3, 1, None, None, 16, False, None),
            (1, 3, N, None, None, -1, -1, "/x.so", None, 16, False, None),
            (2, 0, N, None, None, -1, -1, "/a2.so", "ka", 16, False, None),
            (2, 1, N, None, None, -1, -1, "/b.so", "kb", 16, False, None),
            (2, 2, N, None, None, -1, -1, "/a.so", "ka", BIG, False, None),
            (2, 3, K, "<stop>", None, -1, -1, None, None, 16, False, "r"),
            (2, 4, N, None, None, -1, -1, "/b.so", "kb", 16, False, None),
            (2, 5, N, None, None, -1, -1, "/a.so", "ka", 17, False, None),
            (2, 6, N, None, None, -1, -1, "/a.so", "ka", BIG + 1, False, None),
            (2, 7, N, None, None, -1, -1, "/a.so", "ka", BIG, False, None),
        ]
    )
    # Addresses past 2**53 apart by one are two addresses.
    assert layout.distinct_native_slots(slots).tolist() == [0, 1, 5, 6, 9, 10]


def symbols_of(rows: list[tuple]) -> pa.Table:
    """Symbols rows (module_key, address, exact, depth, function, file, line, inlined, reason)."""
    names = TABLES["symbols"].schema.names
    table = pa.Table.from_pylist([dict(zip(names, row)) for row in rows], schema=TABLES["symbols"].schema)
    return table.set_column(1, "address", table["address"].cast(pa.uint64()))


def expanded_rows(slots: layout.Slots, symbols: pa.Table) -> tuple[list[tuple], layout.Frames]:
    frames = layout.expand(slots, symbols)
    table = frames.table()
    names = ("stack_id", "depth", "slot", "chain_depth", "kind", "function", "file", "line", "first_line")
    names += ("module", "module_key", "address", "exact", "inlined", "reason")
    return [tuple(row[n] for n in names) for row in table.to_pylist()], frames


NOT_SYM, NO_MODULE = layout.NOT_SYMBOLIZED_REASON, layout.NO_MODULE_REASON


def test_inline_chains_replace_native_slots_and_each_frame_is_shown_once() -> None:
    # Stacks 7 then 3 (not in order of id); dictionary texts as combined_slots writes them.
    slots = slots_of(
        [
            (7, 0, N, None, None, -1, -1, "/a.so", "ka", 16, False, None),
            (7, 1, P, "f", "f.py", 3, 1, None, None, 0, False, None),
            (7, 2, N, None, None, -1, -1, "/a.so", "ka", 32, False, None),
            (7, 3, N, None, None, -1, -1, "/x.so", None, 48, True, None),
            (7, 4, K, "<stopped>", None, -1, -1, None, None, 5, False, "depth limit reached"),
            (3, 0, N, None, None, -1, -1, "/a.so", "ka", 32, False, None),
            (3, 1, P, "f", "f.py", 3, 1, None, None, 0, False, None),
            (3, 2, N, None, None, -1, -1, "/a2.so", "ka", 16, True, None),
        ],
        inlined=[False, True, False, False, False, False, False, False],
    )
    symbols = symbols_of(
        [
            ("ka", 16, False, 1, "outer", "a.cc", 1, False, None),
            ("ka", 16, False, 0, "inner", "a.cc", 12, True, None),
            ("ka", 16, True, 0, None, None, 0, False, "no symbol"),
            ("kz", 32, False, 0, "elsewhere", "z.cc", 1, False, None),
        ]
    )
    rows, frames = expanded_rows(slots, symbols)
    assert rows == [
        (7, 0, 0, 0, "native", "inner", "a.cc", 12, None, "/a.so", "ka", 16, False, True, None),
        (7, 1, 0, 1, "native", "outer", "a.cc", 1, None, "/a.so", "ka", 16, False, False, None),
        (7, 2, 1, 0, "python", "f", "f.py", 3, 1, None, None, None, None, True, None),
        (7, 3, 2, 0, "native", None, None, None, None, "/a.so", "ka", 32, False, False, NOT_SYM),
        (7, 4, 3, 0, "native", None, None, None, None, "/x.so", None, 48, True, False, NO_MODULE),
        (7, 5, 4, 0, "marker", "<stopped>", None, None, None, None, None, 5, None, False, "depth limit reached"),
        (3, 0, 0, 0, "native", None, None, None, None, "/a.so", "ka", 32, False, False, NOT_SYM),
        (3, 1, 1, 0, "python", "f", "f.py", 3, 1, None, None, None, None, False, None),
        (3, 2, 2, 0, "native", None, None, None, None, "/a2.so", "ka", 16, True, False, "no symbol"),
    ]
    # The unsymbolized slot at 32 is one frame in both stacks; the Python frame marked inlined is
    # another frame than the one not marked.
    assert frames.rows["frame"].to_pylist() == [0, 1, 2, 3, 4, 5, 3, 6, 7]
    assert frames.frames.num_rows == 8
    assert frames.rows.schema.types == [pa.int64(), pa.int32(), pa.int32(), pa.int32(), pa.int32()]
    assert frames.stack_order.tolist() == [3, 7] and frames.per_stack_frames.tolist() == [3, 6]
    assert frames.stack_order.dtype == frames.per_stack_frames.dtype == np.int64
    # Innermost frame with a function: stack 3's Python frame at depth 1, stack 7's inline chain at 0.
    assert frames.symbolized_depth.dtype == np.int32 and frames.symbolized_depth.tolist() == [1, 0]
    assert frames.frames.schema.field("line").type == pa.int32()
    assert frames.frames.schema.field("address").type == pa.uint64()


def test_stacks_in_order_of_id_and_one_without_a_symbolized_frame() -> None:
    slots = slots_of(
        [
            (1, 0, N, None, None, -1, -1, "/a.so", "ka", 48, False, None),
            (1, 1, K, "<stopped>", None, -1, -1, None, None, 2, False, "no unwind info for this PC"),
            (2, 0, N, None, None, -1, -1, "/a.so", "ka", 16, True, None),
            (2, 1, N, None, None, -1, -1, "/a.so", "ka", 16, False, None),
            (4, 0, P, None, "g.py", 0, 0, None, None, 0, False, None),
        ]
    )
    symbols = symbols_of(
        [("ka", 16, True, 0, "exact_fn", "a.cc", 4, False, None), ("ka", 16, False, 0, "f", "a.cc", None, False, None)]
    )
    rows, frames = expanded_rows(slots, symbols)
    assert [row[:6] for row in rows] == [
        (1, 0, 0, 0, "native", None),
        (1, 1, 1, 0, "marker", "<stopped>"),
        (2, 0, 0, 0, "native", "exact_fn"),
        (2, 1, 1, 0, "native", "f"),
        (4, 0, 0, 0, "python", None),
    ]
    # A symbols line 0 is unknown; a Python frame's line and first line are as read.
    assert [row[7] for row in rows] == [None, None, 4, None, 0] and rows[4][8] == 0
    assert frames.stack_order.tolist() == [1, 2, 4] and frames.per_stack_frames.tolist() == [2, 2, 1]
    assert frames.symbolized_depth.tolist() == [-1, 0, -1]
    # One slot, its chain from symbols: a slot's own row is not read for it.
    alone, _ = expanded_rows(slots_of([slots_rows_one()]), symbols)
    assert alone == [(1, 0, 0, 0, "native", "exact_fn", "a.cc", 4, None, "/a.so", "ka", 16, True, False, None)]

    # With a single symbols row, a slot's own row takes nothing from the symbols.
    one_row = symbols_of([("ka", 16, True, 0, "exact_fn", "a.cc", 4, False, "r")])
    python = (1, 1, P, "f", "f.py", 2, 1, None, None, 0, False, None)
    mixed, _ = expanded_rows(slots_of([slots_rows_one(), python]), one_row)
    assert [(row[5], row[14]) for row in mixed] == [("exact_fn", "r"), ("f", None)]


def slots_rows_one() -> tuple:
    return (1, 0, N, None, None, -1, -1, "/a.so", "ka", 16, True, None)


def test_without_symbols_every_native_slot_is_one_unsymbolized_frame() -> None:
    slots = slots_of(
        [
            (9, 0, N, None, None, -1, -1, "/a.so", "ka", 16, True, None),
            (9, 1, N, None, None, -1, -1, "/b.so", None, 16, False, None),
            (9, 2, P, "f", "f.py", 8, 2, None, None, 0, False, None),
        ]
    )
    rows, frames = expanded_rows(slots, symbols_of([]))
    assert rows == [
        (9, 0, 0, 0, "native", None, None, None, None, "/a.so", "ka", 16, True, False, NOT_SYM),
        (9, 1, 1, 0, "native", None, None, None, None, "/b.so", None, 16, False, False, NO_MODULE),
        (9, 2, 2, 0, "python", "f", "f.py", 8, 2, None, None, None, None, False, None),
    ]
    assert frames.symbolized_depth.tolist() == [2]
    empty = layout.expand(_no_slots(), symbols_of([]))
    assert empty.rows.num_rows == 0 and empty.stack_order.tolist() == [] and empty.symbolized_depth.tolist() == []


def _no_slots() -> layout.Slots:
    one = slots_of([(1, 0, P, "f", "f.py", 1, 1, None, None, 0, False, None)])
    return layout.Slots(**{name: value[:0] if value is not None else None for name, value in one.__dict__.items()})


def test_unique_values_in_order_or_not() -> None:
    for values in ([3, 3, 5, 9, 9, 9], [9, 3, 9, 5, 3, 9], [3, 9, 5, 9], [4], []):
        array = np.array(values, np.int64)
        got = layout._unique(array)
        expected = np.unique(array, return_index=True, return_counts=True)
        assert [part.tolist() for part in got] == [part.tolist() for part in expected], values


def test_slots_of_stacks_with_their_modules_code_and_stop_reasons() -> None:
    modules = pa.table({"path": ["/lib/a.so", "/lib/b.so"], "module_key": ["ka", None]})
    code = pa.table(
        {
            "code_id": pa.array([1, 2], pa.uint64()),
            "filename": ["f.py", "g.py"],
            "qualname": ["f", "g"],
            "first_line": pa.array([10, 20], pa.int32()),
        }
    )
    # Stack 40: native [plain a.so, eval loop b.so, marker 'depth limit'], Python [g entry];
    # stack 50: native [exact a.so, module undescribed, marker 'code 42'], no Python frames.
    slots, shapes = layout.combined_slots(
        stack_ids=np.array([40, 50], np.int64),
        status=np.array([raw.STACK_NATIVE_TRUNCATED, raw.STACK_NATIVE_TRUNCATED], np.uint32),
        native_lengths=np.array([3, 3], np.int64),
        python_lengths=np.array([1, 0], np.int64),
        native_ref=np.array([0, 1, -1, 0, -1, -1], np.int64),
        native_address=np.array([0x10, 0x20, 5, 0x30, 0x40, 42], np.uint64),
        native_flags=np.array([0, E, M, X, 0, M], np.uint32),
        python_ref=np.array([1], np.int64),
        python_line=np.array([23], np.int32),
        python_flags=np.array([ENTRY], np.uint32),
        modules=modules,
        code=code,
    )
    assert slots.stack_id.tolist() == [40, 40, 40, 50, 50, 50] and slots.stack_id.dtype == np.int64
    assert slots.slot.tolist() == [0, 1, 2, 0, 1, 2] and slots.slot.dtype == np.int32
    assert slots.kind.tolist() == [N, P, K, N, N, K]
    assert slots.function.to_pylist() == [
        None, "g", "<native walk stopped: depth limit reached>", None, None, "<native walk stopped: stop reason 42>",
    ]  # fmt: skip
    assert slots.file.to_pylist() == [None, "g.py", None, None, None, None]
    assert slots.line.tolist() == [-1, 23, -1, -1, -1, -1]
    assert slots.first_line.tolist() == [-1, 20, -1, -1, -1, -1]
    assert slots.module.to_pylist() == ["/lib/a.so", None, None, "/lib/a.so", None, None]
    assert slots.module_key.to_pylist() == ["ka", None, None, "ka", None, None]
    assert slots.address.tolist() == [0x10, 0, 5, 0x30, 0x40, 42]
    assert slots.exact.tolist() == [False, False, False, True, False, False]
    assert slots.reason.to_pylist() == [None, None, "depth limit reached", None, None, "stop reason 42"]
    assert slots.inlined is None
    assert shapes.problem.to_pylist() == [None, None]


def test_slots_without_code_or_modules_and_a_frame_placed_from_code_origins() -> None:
    from tbpipe.pipeline.stacks.origins import ORIGIN_FLAG

    no_modules = pa.table({"path": pa.array([], pa.string()), "module_key": pa.array([], pa.string())})
    empty_code = raw.code_schema().empty_table()
    slots, _ = layout.combined_slots(
        stack_ids=np.array([8], np.int64),
        status=np.array([raw.STACK_NO_NATIVE], np.uint32),
        native_lengths=np.array([0], np.int64),
        python_lengths=np.array([2], np.int64),
        native_ref=np.zeros(0, np.int64),
        native_address=np.zeros(0, np.uint64),
        native_flags=np.zeros(0, np.uint32),
        python_ref=np.array([-1, -1], np.int64),
        python_line=np.array([4, 6], np.int32),
        python_flags=np.array([ORIGIN_FLAG, 0], np.uint32),
        modules=no_modules,
        code=empty_code,
    )
    assert slots.kind.tolist() == [P, P]
    assert slots.function.to_pylist() == [None, None] and slots.file.to_pylist() == [None, None]
    assert slots.first_line.tolist() == [-1, -1] and slots.line.tolist() == [4, 6]
    assert slots.inlined is not None and slots.inlined.tolist() == [True, False]
    assert slots.reason.to_pylist() == [None, None] and slots.reason.type == pa.string()
    # Texts stay texts without a row to take them from.
    for column in (slots.function, slots.file, slots.module, slots.module_key):
        assert column.type == pa.dictionary(pa.int32(), pa.string())
