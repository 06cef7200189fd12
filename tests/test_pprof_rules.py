"""The pprof and collapsed-stack writers' rules, stated exactly: a return address is written minus one
(an exact address as it is), the main program's mapping comes first, a mapping says what it lacks,
frames are named as the tools read them, and collapsed frame text escapes and unescapes losslessly.
Profiles built here are read back with Go's pprof."""

from __future__ import annotations

import gzip
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.export import ExportFilter, ExportFormat, export
from tbpipe.pipeline.export.collapsed import escape_frame, unescape_frame
from tbpipe.pipeline.export.frames import line_label, location_labels
from tbpipe.pipeline.export.pprof import _LIBRARY, StringTable, _Tables, thread_label
from tbpipe.pipeline.export.profile_proto import message


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


@pytest.fixture(scope="module")
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


# ------------------------------------------------------------------------------------------ whole exports


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, symbol_cache) -> tuple[Path, str, str]:
    """A run whose events have no stack (nothing walked) and one whose events have one."""
    root = tmp_path_factory.mktemp("pprof_rules")
    with capture.session(root / "runs", python=False, native=False, labels={"commit": "bare"}):
        for _ in range(3):
            capture.record("kernel_launch", "k")
    with capture.session(root / "runs", labels={"commit": "walked"}):
        for _ in range(2):
            capture.record("kernel_launch", "k")
    path = root / "tbpipe.duckdb"
    assert ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False)).ok
    with open_database(path, read_only=True) as con:
        ids = dict(query_rows(con, "SELECT labels['commit'], run_id FROM runs"))
    return path, ids["bare"], ids["walked"]


def exported(db: Path, fmt: str, out: Path, *runs: str) -> int:
    with open_database(db, read_only=True) as con:
        return export(con, ExportFilter(runs=runs), ExportFormat(fmt), out).events


def test_events_without_a_stack_count_under_one_frame(two_runs, tmp_path: Path) -> None:
    db, bare, walked = two_runs
    out = tmp_path / "both.txt"
    assert exported(db, "collapsed", out, bare, walked) == 5
    lines = out.read_text().splitlines()
    assert lines[-1] == "[no stack] 3" and len(lines) == 2 and lines[0].endswith(" 2")
    assert "test_events_without_a_stack_count_under_one_frame" not in lines[0]  # recorded by the fixture
    assert exported(db, "collapsed", out, bare) == 3 and out.read_text() == "[no stack] 3\n"
    assert exported(db, "collapsed", out, walked) == 2 and "[no stack]" not in out.read_text()


def read_profile(path: Path):
    profile = message("Profile")()
    profile.ParseFromString(gzip.decompress(path.read_bytes()))
    return profile, list(profile.string_table)


def test_a_pprof_sample_per_stack_with_its_labels(two_runs, tmp_path: Path) -> None:
    db, bare, walked = two_runs
    out = tmp_path / "both.pb.gz"
    assert exported(db, "pprof", out, bare, walked) == 5
    assert out.read_bytes()[4:8] == bytes(4)  # no time in the gzip header: equal exports are equal files
    profile, strings = read_profile(out)
    assert [(strings[t.type], strings[t.unit]) for t in profile.sample_type] == [("events", "count")]
    assert (strings[profile.period_type.type], profile.period, strings[profile.default_sample_type]) == (
        "events",
        1,
        "events",
    )
    locations = {location.id: location for location in profile.location}
    functions = {function.id: strings[function.name] for function in profile.function}
    samples = {}
    for sample in profile.sample:
        labels = {strings[label.key]: strings[label.str] for label in sample.label}
        leaf = [functions[line.function_id] for line in locations[sample.location_id[0]].line]
        samples[labels["run"]] = (sample.value[0], leaf, labels, len(sample.location_id))
    assert samples[bare][:2] == (3, ["[no stack]"]) and samples[bare][3] == 1
    assert samples[walked][0] == 2 and samples[walked][3] > 1
    for _, _, labels, _ in samples.values():
        assert (labels["kind"], labels["name"]) == ("kernel_launch", "k")
        assert re.fullmatch(r"MainThread \(\d+\)", labels["thread"]), labels
    (comment,) = [strings[c] for c in read_profile(out)[0].comment]
    assert comment == f"tbpipe export of runs {bare}, {walked}"
    exported(db, "pprof", out, bare)
    alone, strings = read_profile(out)
    assert [strings[c] for c in alone.comment] == [f"tbpipe export of run {bare}"]
