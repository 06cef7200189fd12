"""The pprof and collapsed-stack writers' rules, stated exactly: a return address is written minus one
(an exact address as it is), the main program's mapping comes first, a mapping says what it lacks,
frames are named as the tools read them, and collapsed frame text escapes and unescapes losslessly.
Profiles built here are read back with Go's pprof."""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.export import ExportFilter
from tbpipe.pipeline.export.collapsed import escape_frame, unescape_frame, write_collapsed
from tbpipe.pipeline.export.frames import line_label, location_labels
from tbpipe.pipeline.export.pprof import _LIBRARY, StringTable, _header, _Tables, thread_label, write_pprof
from tbpipe.pipeline.export.profile_proto import message
from tbpipe.pipeline.export.source import RunInfo, StackLocations


def line(function: str | None, file: str | None = None, number: int | None = None, inlined: bool = False) -> dict:
    return {"function": function, "file": file, "line": number, "inlined": inlined}


def native(location_id: int, module: str | None, address: int | None, lines: list[dict], **fields) -> dict:
    return {
        "location_id": location_id,
        "kind": "native",
        "module_key": fields.get("module_key", f"key:{module}"),
        "module": module,
        "build_id": fields.get("build_id", hashlib.sha1(str(module).encode()).hexdigest()),
        "address": address,
        "exact": fields.get("exact", False),
        "lines": lines,
    }


def other(location_id: int, kind: str, lines: list[dict]) -> dict:
    return {
        "location_id": location_id,
        "kind": kind,
        "module_key": None,
        "module": None,
        "build_id": None,
        "address": None,
        "exact": False,
        "lines": lines,
    }


# A library's frame comes first, as it does in real stacks (the leaf is in libc or libtorch).
LOCATIONS = [
    native(1, "/lib/libc.so.6", 0x2000, [line("memcpy")]),
    native(2, "/usr/bin/python3.11", 0x1000, [line("inner", "eval.c", 7, True), line("main", "main.c", 10)]),
    other(3, "python", [line("train", "app/train.py", 42)]),
    native(4, "/opt/libtorch_cpu.so", 0x3000, [line(None)], exact=True),
    other(5, "marker", [line(None)]),
    other(6, "marker", [line("signal handler")]),
    native(7, "/lib/libc.so.6", 0x2100, [line("memset", "memset.S", None)]),
    native(8, "/opt/app/trainer", None, [line("run", "run.cc", 3)], build_id=None),
    native(9, "/opt/app/trainer", 0, [line("start", "run.cc", 1)], build_id=None),
    other(10, "python", [line(None, "gen.py", 2)]),
    native(11, None, 0x10, [line(None)], module_key=None),
]


# Built for each test (not once per module): `make mutate` runs a mutant only against the tests that
# reached its function, and a module fixture's calls count for the first test alone.
@pytest.fixture()
def tables() -> _Tables:
    built = _Tables(StringTable())
    built.add_locations(LOCATIONS)
    return built


def text(tables: _Tables, index: int) -> str:
    return list(tables.strings.index)[index]


def test_the_main_program_comes_first_then_the_libraries_in_order(tables) -> None:
    mappings = list(tables.mappings.values())
    assert [text(tables, m.filename) for m in mappings] == [
        "/usr/bin/python3.11",
        "/opt/app/trainer",
        "",  # a module of no name is no library either
        "/lib/libc.so.6",
        "/opt/libtorch_cpu.so",
    ]
    assert [m.id for m in mappings] == [1, 2, 3, 4, 5]
    assert list(tables.mappings) == [
        "key:/usr/bin/python3.11",
        "key:/opt/app/trainer",
        "?",
        "key:/lib/libc.so.6",
        "key:/opt/libtorch_cpu.so",
    ]


def test_mappings_span_the_address_space_at_offset_0(tables) -> None:
    for mapping in tables.mappings.values():
        assert (mapping.memory_start, mapping.memory_limit, mapping.file_offset) == (0, (1 << 64) - 1, 0)
    python = tables.mappings["key:/usr/bin/python3.11"]
    assert text(tables, python.build_id) == LOCATIONS[1]["build_id"]
    assert tables.mappings["key:/opt/app/trainer"].build_id == 0  # no build-ID: the empty string


def test_a_return_address_is_written_minus_one(tables) -> None:
    address = {entry.id: entry.address for entry in tables.locations}
    assert address[1] == 0x1FFF and address[2] == 0xFFF and address[7] == 0x20FF
    assert address[4] == 0x3000  # exact: the address itself
    assert address[8] == 0 and address[9] == 0  # unknown or 0: never below 0
    assert address[3] == 0 and address[5] == 0  # not native: no address
    mapping_of = {entry.id: entry.mapping_id for entry in tables.locations}
    assert mapping_of[1] == mapping_of[7] == 4 and mapping_of[2] == 1 and mapping_of[4] == 5
    assert mapping_of[3] == 0 and mapping_of[11] == 3


def test_an_exact_location_of_no_known_address_is_at_0() -> None:
    tables = _Tables(StringTable())
    tables.add_locations([native(1, "/lib/libc.so.6", None, [line("f")], exact=True)])
    assert [entry.address for entry in tables.locations] == [0]


def test_a_mapping_says_what_its_locations_lack(tables) -> None:
    flags = {
        key: (m.has_functions, m.has_filenames, m.has_line_numbers, m.has_inline_frames)
        for key, m in tables.mappings.items()
    }
    assert flags["key:/usr/bin/python3.11"] == (True, True, True, True)
    assert flags["key:/lib/libc.so.6"] == (True, False, False, False)  # no file, then no line
    assert flags["key:/opt/libtorch_cpu.so"] == (False, False, False, False)  # unsymbolized
    assert flags["key:/opt/app/trainer"] == (True, True, True, True)
    assert flags["?"] == (False, False, False, False)


def test_lines_and_functions(tables) -> None:
    functions = {f.id: (text(tables, f.name), text(tables, f.filename)) for f in tables.functions.values()}
    lines = {entry.id: [(*functions[one.function_id], one.line) for one in entry.line] for entry in tables.locations}
    assert lines[2] == [("inner", "eval.c", 7), ("main", "main.c", 10)]  # innermost first
    assert lines[3] == [("train", "app/train.py", 42)]
    assert lines[1] == [("memcpy", "", 0)]
    assert lines[4] == [] and lines[11] == []  # unsymbolized: pprof may name the address itself
    assert lines[5] == [("[native walk stopped]", "", 0)] and lines[6] == [("[signal handler]", "", 0)]
    assert lines[7] == [("memset", "memset.S", 0)]
    assert lines[10] == [("<unknown code>", "gen.py", 2)]
    assert [f.id for f in tables.functions.values()] == list(range(1, len(tables.functions) + 1))
    assert [entry.id for entry in tables.locations] == list(range(1, 12))


def test_a_function_is_one_per_name_and_file() -> None:
    tables = _Tables(StringTable())
    assert tables.function_id("f", "a.py") == 1 and tables.function_id("f", "a.py") == 1
    assert tables.function_id("f", "b.py") == 2 and tables.function_id("f", None) == 3
    assert tables.function_id("f", "") == 3


def test_the_string_table() -> None:
    strings = StringTable()
    assert strings("") == 0 and strings(None) == 0
    assert strings("a") == 1 and strings("b") == 2 and strings("a") == 1
    assert strings.take_pending() == ["", "a", "b"] and strings.take_pending() == []
    assert strings("c") == 3 and strings.take_pending() == ["c"]


@pytest.mark.parametrize(
    "module, library",
    [
        ("/lib/libc.so.6", True),
        ("libtorch_cpu.so", True),
        ("/usr/lib/libz.so.1.2.13", True),
        ("libfoo.so_2", True),
        ("/usr/bin/python3.11", False),
        ("/opt/app/trainer", False),
        ("/opt/libsox", False),
        ("/opt/x.so.backup", False),
        ("/opt/x.sox", False),
    ],
)
def test_what_counts_as_a_library(module: str, library: bool) -> None:
    assert bool(_LIBRARY.search(module)) is library


def test_thread_labels() -> None:
    assert thread_label(7, "worker") == "worker (7)" and thread_label(7, None) == "7" and thread_label(7, "") == "7"


def test_go_pprof_reads_the_mappings_and_addresses(tables, tmp_path: Path) -> None:
    if shutil.which("go") is None:
        pytest.skip("go is not installed (Debian package golang-go): cannot read pprof files with Go's pprof")
    Profile, ValueType, Sample = message("Profile"), message("ValueType"), message("Sample")
    strings = tables.strings
    profile = Profile(sample_type=[ValueType(type=strings("events"), unit=strings("count"))])
    profile.mapping.extend(tables.mappings.values())
    profile.location.extend(tables.locations)
    profile.function.extend(tables.functions.values())
    profile.sample.append(Sample(location_id=[1, 2, 3], value=[5]))
    profile.sample.append(Sample(location_id=[4, 7, 8], value=[2]))
    profile.string_table.extend(strings.take_pending())
    path = tmp_path / "p.pb.gz"
    path.write_bytes(gzip.compress(profile.SerializeToString()))
    raw = subprocess.run(
        ["go", "tool", "pprof", "-raw", "-symbolize=none", str(path)], capture_output=True, text=True, timeout=120
    )
    assert raw.returncode == 0, raw.stderr
    mappings = dict(re.findall(r"^\s*(\d+): 0x0/0xffffffffffffffff/0x0 (\S*)", raw.stdout.split("Mappings")[1], re.M))
    assert set(mappings.values()) == {
        "/usr/bin/python3.11",
        "/opt/app/trainer",
        "/lib/libc.so.6",
        "/opt/libtorch_cpu.so",
    }
    located = {
        (address, mappings[mapping])
        for address, mapping in re.findall(r"^\s*\d+: 0x([0-9a-f]+) M=(\d+)", raw.stdout, re.M)
    }
    assert located == {
        ("1fff", "/lib/libc.so.6"),
        ("fff", "/usr/bin/python3.11"),
        ("3000", "/opt/libtorch_cpu.so"),
        ("20ff", "/lib/libc.so.6"),
        ("0", "/opt/app/trainer"),
    }


# ------------------------------------------------------------------------------------------ frame text


def test_frame_labels() -> None:
    assert line_label("python", line("train", "app/train.py", 42), None, None) == "train (app/train.py:42)"
    assert line_label("python", line("train", "app/train.py", None), None, None) == "train (app/train.py:?)"
    assert line_label("native", line(None), "/lib/libc.so.6", 0x1A2B) == "libc.so.6+0x1a2b"
    assert line_label("native", line(None), None, None) == "??+0x0"
    assert line_label("native", line("memcpy"), "/lib/libc.so.6", 1) == "memcpy (libc.so.6)"
    assert line_label("native", line("f", "f.cc", 3, True), "/x/lib.so", 1) == "f (f.cc:3) [inlined]"
    assert line_label("native", line("f", "f.cc", 0), "/x/lib.so", 1) == "f (f.cc:0)"
    assert line_label("marker", line(None), None, None) == "[native walk stopped]"
    assert line_label("marker", line("stopped: no frame pointer"), None, None) == "[stopped: no frame pointer]"
    assert line_label("python", line(None, "gen.py", 1), None, None) == "<unknown code> (gen.py:1)"
    assert location_labels(LOCATIONS[1]) == ["inner (eval.c:7) [inlined]", "main (main.c:10)"]


def test_escapes_by_hand() -> None:
    assert escape_frame("a;b%c\nd\re") == "a%3Bb%25c%0Ad%0De"
    assert escape_frame("100%3B") == "100%253B"  # an escape's look-alike stays text
    assert unescape_frame("100%253B") == "100%3B" and unescape_frame("a%3Bb%25c%0Ad%0De") == "a;b%c\nd\re"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab;%\r\n 3BDA250"), max_size=30))
def test_escaping_is_lossless_and_leaves_no_separator(frame: str) -> None:
    escaped = escape_frame(frame)
    assert not set(escaped) & set(";\r\n")
    assert unescape_frame(escaped) == frame
    # The reference: percent-encoding of exactly these four characters.
    assert escaped == "".join({"%": "%25", ";": "%3B", "\r": "%0D", "\n": "%0A"}.get(c, c) for c in frame)


# ------------------------------------------------------------------------------------------ whole profiles

LOCATION_SCHEMA = pa.schema(
    [
        ("location_id", pa.int64()),
        ("kind", pa.string()),
        ("module_key", pa.string()),
        ("module", pa.string()),
        ("build_id", pa.string()),
        ("address", pa.uint64()),
        ("exact", pa.bool_()),
        (
            "lines",
            pa.large_list(
                pa.struct(
                    [("function", pa.string()), ("file", pa.string()), ("line", pa.int32()), ("inlined", pa.bool_())]
                )
            ),
        ),
    ]
)
# The chosen stacks (innermost location first) and a frame whose text needs escaping in collapsed stacks.
ODD = other(12, "python", [line("odd;name%", "x\ny.py", 5)])
STACKS = {100: [1, 2, 3], 200: [4, 7, 8], 300: [5, 6], 500: [12, 10]}
# (run_number, name_id, thread_id, stack_id, events); stack None: no stack was walked; stack 400 has
# events but no frames.
SAMPLES = [
    (1, 1, 7, None, 3),
    (1, 1, 7, 100, 5),
    (1, 2, 7, 100, 2),
    (1, 1, 8, 200, 4),
    (1, 1, 7, 300, 2),
    (2, 1, 7, 100, 1),
    (2, 1, 9, 400, 6),
    (2, 2, 9, 500, 7),
]
RUNS = [
    RunInfo("run-a", 1, 10, "host", 1_000, 5_000, {7: "MainThread", 8: ""}),
    RunInfo("run-b", 2, 11, "host", None, None, {}),
]


class HandSource:
    """What the writers read of an `ExportSource` (its runs, names, chosen stacks' locations, samples and
    counts per stack), from the hand-made tables above instead of a database."""

    def __init__(self, runs: list[RunInfo] = RUNS, choice: ExportFilter | None = None, samples=SAMPLES) -> None:
        self.runs = runs
        self.run_ids = [run.run_id for run in runs]
        self.choice = choice or ExportFilter(runs=tuple(self.run_ids))
        self.names = {1: ("kernel_launch", "gemm"), 2: ("op", "aten::mm")}
        self.samples = samples

    def stack_locations(self) -> StackLocations:
        chosen = {stack: ids for stack, ids in STACKS.items() if stack in {row[3] for row in self.samples}}
        stacks = pa.table(
            {
                "stack_id": pa.array(list(chosen), pa.int64()),
                "location_ids": pa.array(list(chosen.values()), pa.large_list(pa.int64())),
            }
        )
        return StackLocations(pa.Table.from_pylist([*LOCATIONS, ODD], LOCATION_SCHEMA), stacks)

    def sample_batches(self, rows: int) -> Iterator[pa.RecordBatch]:
        names = ["run_number", "name_id", "thread_id", "stack_id", "events"]
        table = pa.table({name: pa.array([row[i] for row in self.samples], pa.int64()) for i, name in enumerate(names)})
        yield from table.to_batches(max_chunksize=3)  # several batches, as a big export reads them

    def stack_counts(self) -> pa.Table:
        summed: dict[int | None, int] = {}
        for *_, stack, events in self.samples:
            summed[stack] = summed.get(stack, 0) + events
        ordered = sorted(summed, key=lambda stack: -1 if stack is None else stack)
        return pa.table({"stack_id": pa.array(ordered, pa.int64()), "events": [summed[s] for s in ordered]})


def written(source: HandSource, tmp_path: Path) -> tuple[Any, list[str], int, bytes]:
    out = tmp_path / "p.pb.gz"
    with open(out, "wb") as file:
        total = write_pprof(source, file)
    profile = message("Profile")()
    profile.ParseFromString(gzip.decompress(out.read_bytes()))
    return profile, list(profile.string_table), total, out.read_bytes()


def test_a_sample_per_run_name_thread_and_stack(tmp_path: Path) -> None:
    profile, strings, total, _ = written(HandSource(), tmp_path)
    assert total == sum(row[4] for row in SAMPLES)
    samples = [
        (list(s.location_id), list(s.value), [(strings[label.key], strings[label.str]) for label in s.label])
        for s in profile.sample
    ]

    def labels(run: str, kind: str, name: str, thread: str) -> list[tuple[str, str]]:
        return [("run", run), ("kind", kind), ("name", name), ("thread", thread)]

    no_stack = [len(LOCATIONS) + 2]  # after the chosen locations
    assert samples == [
        (no_stack, [3], labels("run-a", "kernel_launch", "gemm", "MainThread (7)")),
        ([1, 2, 3], [5], labels("run-a", "kernel_launch", "gemm", "MainThread (7)")),
        ([1, 2, 3], [2], labels("run-a", "op", "aten::mm", "MainThread (7)")),
        ([4, 7, 8], [4], labels("run-a", "kernel_launch", "gemm", "8")),
        ([5, 6], [2], labels("run-a", "kernel_launch", "gemm", "MainThread (7)")),
        ([1, 2, 3], [1], labels("run-b", "kernel_launch", "gemm", "7")),
        (no_stack, [6], labels("run-b", "kernel_launch", "gemm", "9")),  # events but no frames
        ([12, 10], [7], labels("run-b", "op", "aten::mm", "9")),
    ]
    (last,) = [entry for entry in profile.location if entry.id == no_stack[0]]
    functions = {f.id: (strings[f.name], strings[f.filename]) for f in profile.function}
    assert (last.mapping_id, last.address, [(functions[one.function_id], one.line) for one in last.line]) == (
        0, 0, [(("[no stack]", ""), 0)])  # fmt: skip
    assert [entry.id for entry in profile.location] == list(range(1, no_stack[0] + 1))
    assert [m.id for m in profile.mapping] == [1, 2, 3, 4, 5] and strings[
        profile.mapping[0].filename
    ] == "/usr/bin/python3.11"
    assert strings[0] == "" and len(set(strings)) == len(strings)  # each string once


def test_a_profile_written_to_memory_equals_one_written_to_a_file(tmp_path: Path) -> None:
    out = io.BytesIO()  # no file name, no mode: what a library caller may pass
    assert write_pprof(HandSource(), out) == sum(row[4] for row in SAMPLES)
    _, _, _, packed = written(HandSource(), tmp_path)
    # Byte for byte: neither the time nor the output's file name goes into the gzip header.
    assert out.getvalue() == packed


def test_more_samples_than_one_message_holds(tmp_path: Path) -> None:
    many = (1 << 16) + 10  # the samples go out in messages of 65,536; the rest in the last one
    samples = [(1, 1, 7, 100, i + 1) for i in range(many)]
    profile, strings, total, _ = written(HandSource(samples=samples), tmp_path)
    assert total == many * (many + 1) // 2 and len(profile.sample) == many
    assert [s.value[0] for s in profile.sample[-3:]] == [many - 2, many - 1, many]
    assert {tuple(s.location_id) for s in profile.sample} == {(1, 2, 3)}
    assert strings[profile.sample[-1].label[3].str] == "MainThread (7)"


def test_the_header_says_what_and_when(tmp_path: Path) -> None:
    profile, strings, _, packed = written(HandSource(), tmp_path)
    assert [(strings[t.type], strings[t.unit]) for t in profile.sample_type] == [("events", "count")]
    assert (strings[profile.period_type.type], strings[profile.period_type.unit], profile.period) == (
        "events",
        "count",
        1,
    )
    assert strings[profile.default_sample_type] == "events"
    assert (profile.time_nanos, profile.duration_nanos) == (1_000, 4_000)  # run-b has no times
    assert [strings[c] for c in profile.comment] == ["tbpipe export of runs run-a, run-b"]
    # gzip's fastest level (as pprof writes), no time in the header: equal exports are equal files.
    assert packed[:3] == b"\x1f\x8b\x08" and packed[4:8] == bytes(4) and packed[8] == 4


@pytest.mark.parametrize(
    "times, expected",
    [
        ([(3_000, 9_000), (2_000, 4_000)], (2_000, 7_000)),  # first start to last end
        ([(3_000, None), (2_000, None)], (2_000, 0)),  # no end: no duration
        ([(5_000, 1_000)], (5_000, 0)),  # a clock stepped back: never below 0
        ([(None, 4_000)], (0, 0)),  # no start: neither
    ],
)
def test_the_profile_s_time_span(times: list[tuple], expected: tuple[int, int]) -> None:
    runs = [RunInfo(f"r{i}", i, None, None, start, end, {}) for i, (start, end) in enumerate(times)]
    header = _header(HandSource(runs), StringTable())
    assert (header.time_nanos, header.duration_nanos) == expected


def test_one_run_and_a_filter_in_the_comments() -> None:
    strings = StringTable()
    choice = ExportFilter(runs=("latest",), kind="kernel_launch", name="gemm")
    header = _header(HandSource(RUNS[:1], choice), strings)
    assert [list(strings.index)[c] for c in header.comment] == [
        "tbpipe export of run run-a",
        "events of kind 'kernel_launch' and name 'gemm'",
    ]


def test_go_pprof_reads_a_written_profile(tmp_path: Path) -> None:
    if shutil.which("go") is None:
        pytest.skip("go is not installed (Debian package golang-go): cannot read pprof files with Go's pprof")
    out = tmp_path / "p.pb.gz"
    with open(out, "wb") as file:
        write_pprof(HandSource(), file)
    traces = subprocess.run(
        ["go", "tool", "pprof", "-traces", "-symbolize=none", str(out)], capture_output=True, text=True, timeout=120
    )
    assert traces.returncode == 0, traces.stderr
    # Each trace: its labels, then its value beside its leaf frame, then the callers.
    traces_read = []
    for block in traces.stdout.split("-----------+" + "-" * 55)[1:]:
        if not block.strip():
            continue  # after the last trace
        labels = dict(re.findall(r"^\s+(\w+):\s+(.+)$", block, re.M))
        value, leaf = re.search(r"^\s+(\d+)\s+(.+)$", block, re.M).groups()
        callers = block.split(leaf, 1)[1].split("\n")
        frames = [leaf] + [frame.strip() for frame in callers if frame.strip()]
        traces_read.append((labels["run"], labels["kind"], labels["name"], labels["thread"], int(value), frames))
    python = ["memcpy", "inner (inline)", "main", "train"]
    assert traces_read == [
        ("run-a", "kernel_launch", "gemm", "MainThread (7)", 3, ["[no stack]"]),
        ("run-a", "kernel_launch", "gemm", "MainThread (7)", 5, python),
        ("run-a", "op", "aten::mm", "MainThread (7)", 2, python),
        ("run-a", "kernel_launch", "gemm", "8", 4, ["[libtorch_cpu.so]", "memset", "run"]),
        ("run-a", "kernel_launch", "gemm", "MainThread (7)", 2, ["[native walk stopped]", "[signal handler]"]),
        ("run-b", "kernel_launch", "gemm", "7", 1, python),
        ("run-b", "kernel_launch", "gemm", "9", 6, ["[no stack]"]),
        ("run-b", "op", "aten::mm", "9", 7, ["odd;name%", "<unknown code>"]),
    ]
    assert "Total samples = 30" in traces.stdout and "tbpipe export of runs run-a, run-b" in traces.stdout


# ------------------------------------------------------------------------------------------ whole collapsed stacks


def collapsed(source: HandSource) -> tuple[list[str], int]:
    out = io.BytesIO()
    total = write_collapsed(source, out)
    return out.getvalue().decode().split("\n"), total


def test_collapsed_stacks_outermost_first_one_line_per_stack() -> None:
    lines, total = collapsed(HandSource())
    assert lines == [
        "train (app/train.py:42);main (main.c:10);inner (eval.c:7) [inlined];memcpy (libc.so.6) 8",
        "run (run.cc:3);memset (memset.S:?);libtorch_cpu.so+0x3000 4",
        "[signal handler];[native walk stopped] 2",
        "<unknown code> (gen.py:2);odd%3Bname%25 (x%0Ay.py:5) 7",
        "[no stack] 9",  # 3 events without a stack and 6 of a stack without frames
        "",
    ]
    assert total == sum(row[4] for row in SAMPLES)


def test_collapsed_without_unframed_events_has_no_such_line() -> None:
    lines, total = collapsed(HandSource(samples=[row for row in SAMPLES if row[3] not in (None, 400)]))
    assert lines[-2:] == ["<unknown code> (gen.py:2);odd%3Bname%25 (x%0Ay.py:5) 7", ""] and total == 21
    lines, total = collapsed(HandSource(samples=[row for row in SAMPLES if row[3] is None or row[3] == 100]))
    assert lines == [
        "train (app/train.py:42);main (main.c:10);inner (eval.c:7) [inlined];memcpy (libc.so.6) 8",
        "[no stack] 3",
        "",
    ]


def test_many_stacks_are_written_each_once_in_order() -> None:
    many = 5_000  # more than one write's worth of lines

    class Many(HandSource):
        def stack_locations(self) -> StackLocations:
            stacks = pa.table(
                {
                    "stack_id": pa.array(range(many), pa.int64()),
                    "location_ids": pa.array([[1]] * many, pa.large_list(pa.int64())),
                }
            )
            return StackLocations(pa.Table.from_pylist([LOCATIONS[2] | {"location_id": 1}], LOCATION_SCHEMA), stacks)

    lines, total = collapsed(Many(samples=[(1, 1, 7, i, i + 1) for i in range(many)]))
    assert lines == [f"train (app/train.py:42) {i + 1}" for i in range(many)] + [""]
    assert total == many * (many + 1) // 2
