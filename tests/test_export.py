"""`tbpipe export`: pprof, collapsed stacks and Chrome traces of runs really captured here, read back
by the tools people use (Go's pprof, headless Chromium) and checked against the database's counts."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from conftest import TBPIPE

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.selectors import RunSelectionError, parse_selector, resolve_runs
from tbpipe.pipeline.export import ExportFilter, ExportFormat, ExportOutputError, NoEventsError, export, profile_proto
from tbpipe.pipeline.export.collapsed import escape_frame, unescape_frame
from tbpipe.pipeline.export.frames import NO_STACK, line_label
from tbpipe.pipeline.export.pprof import thread_label

# ------------------------------------------------------------------------------ runs captured here

# A module whose path holds every character the collapsed format must escape.
ODD_DIR = "semi;colon%pct\nnewline"
ODD_MODULE = """
from tbpipe.capture import record


def odd_launch(count):
    for _ in range(count):
        record("kernel_launch", "odd;kernel")
"""


def launch_gemm(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "gemm", grid=[4, 1, 1])


def launch_pair() -> None:
    capture.record("kernel_launch", "gemm", grid=[2, 1, 1])
    capture.record("op", "aten::mm")


def launch_in_thread(count: int) -> None:
    def work() -> None:
        for _ in range(count):
            capture.record("user", "from_thread")

    thread = threading.Thread(target=work, name="export-worker")
    thread.start()
    thread.join()


@pytest.fixture(scope="module")
def odd_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    folder = root / ODD_DIR
    folder.mkdir()
    (folder / "oddlaunch_tbpipe.py").write_text(ODD_MODULE)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("oddlaunch_tbpipe")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("oddlaunch_tbpipe", None)


@pytest.fixture(scope="module")
def db(tmp_path_factory, symbol_cache, odd_module) -> Path:
    """Two runs of one suite: `a` (older) and `b` (newer, fewer gemm launches)."""
    root = tmp_path_factory.mktemp("export")
    with capture.session(root / "runs", labels={"suite": "export", "commit": "a"}):
        launch_gemm(7)
        for _ in range(3):
            launch_pair()
        odd_module.odd_launch(2)
        launch_in_thread(4)
    with capture.session(root / "runs", labels={"suite": "export", "commit": "b"}):
        launch_gemm(4)
        launch_pair()
    path = root / "tbpipe.duckdb"
    summary = ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False))
    assert summary.ok and summary.ingested == 2
    return path


def rows(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return query_rows(con, sql, params)
    finally:
        con.close()


def run_id(db: Path, commit: str) -> str:
    return rows(db, "SELECT run_id FROM runs WHERE labels['commit'] = ?", [commit])[0][0]


def run_export(db: Path, out: Path, fmt: str, *runs: str, **choice) -> int:
    con = open_database(db, read_only=True)
    try:
        summary = export(con, ExportFilter(runs=runs, **choice), ExportFormat(fmt), out)
    finally:
        con.close()
    assert summary.path == out and out.is_file()
    return summary.events


def stack_frames(db: Path) -> dict[int, list[dict]]:
    """Every stack's frames from `stack_frames`, innermost first (read here, apart from the exporter)."""
    stacks: dict[int, list[dict]] = {}
    for stack_id, kind, function, file, line, module, address, inlined in rows(
        db,
        "SELECT stack_id, kind, function, file, line, module, address, inlined FROM stack_frames ORDER BY stack_id, depth",
    ):
        stacks.setdefault(stack_id, []).append(
            {
                "kind": kind,
                "function": function,
                "file": file,
                "line": line,
                "module": module,
                "address": address,
                "inlined": inlined,
            }
        )
    return stacks


def events_per(db: Path, run_ids: list[str], columns: str) -> dict[tuple, int]:
    found = rows(
        db,
        f"SELECT {columns}, count(*) FROM events WHERE list_contains(?, run_id) GROUP BY ALL",
        [run_ids],
    )
    return {tuple(row[:-1]): row[-1] for row in found}


# ------------------------------------------------------------------------------ run selectors


def test_run_selectors(db) -> None:
    a, b = run_id(db, "a"), run_id(db, "b")
    con = open_database(db, read_only=True)
    try:
        assert resolve_runs(con, ["latest"]) == [b]
        assert resolve_runs(con, ["latest:commit=a"]) == [a]
        assert resolve_runs(con, ["latest:suite=export, commit=b", a, "latest"]) == [b, a]
        assert resolve_runs(con, [a[:-3]]) == [a]  # a unique prefix
        with pytest.raises(RunSelectionError, match="no run with labels commit=zzz"):
            resolve_runs(con, ["latest:commit=zzz"])
        with pytest.raises(RunSelectionError, match="no run 'nope'"):
            resolve_runs(con, ["nope"])
        with pytest.raises(RunSelectionError, match="ambiguous"):
            resolve_runs(con, [a[:4]])
    finally:
        con.close()
    with pytest.raises(RunSelectionError, match="KEY=VALUE"):
        parse_selector("latest:commit")
    assert parse_selector("latest:a=1,b=2").labels == {"a": "1", "b": "2"}


# ------------------------------------------------------------------------------ collapsed stacks


def collapsed_expected(db: Path, run_ids: list[str]) -> Counter:
    frames = stack_frames(db)
    expected: Counter = Counter()
    for (stack_id,), count in events_per(db, run_ids, "stack_id").items():
        if stack_id is None or stack_id not in frames:
            expected[NO_STACK] += count
            continue
        labels = [escape_frame(line_label(f["kind"], f, f["module"], f["address"])) for f in reversed(frames[stack_id])]
        expected[";".join(labels)] += count
    return expected


def parse_collapsed(text: str) -> list[tuple[str, int]]:
    lines = []
    for line in text.split("\n")[:-1]:
        stack, _, count = line.rpartition(" ")
        lines.append((stack, int(count)))
    return lines


def test_collapsed_counts_per_stack_equal_the_database(db, tmp_path) -> None:
    a, b = run_id(db, "a"), run_id(db, "b")
    out = tmp_path / "both.folded"
    written = run_export(db, out, "collapsed", "latest:commit=a", "latest")
    lines = parse_collapsed(out.read_text())
    got: Counter = Counter()
    for stack, count in lines:
        got[stack] += count
    assert got == collapsed_expected(db, [a, b])
    assert written == sum(got.values()) == rows(db, "SELECT sum(events) FROM runs")[0][0]
    # One line per stack: as many lines as stacks with these events.
    assert len(lines) == rows(db, "SELECT count(DISTINCT stack_id) FROM events")[0][0]


def test_collapsed_escapes_frame_text(db, tmp_path, odd_module) -> None:
    out = tmp_path / "odd.folded"
    run_export(db, out, "collapsed", "latest:commit=a", name="odd;kernel")
    text = out.read_text()
    (line,) = text.splitlines()  # the newline in the file name did not split the line
    stack, count = parse_collapsed(text)[0]
    assert count == 2
    frames = stack.split(";")
    (odd,) = [f for f in frames if f.startswith("odd_launch ")]
    assert "%3B" in odd and "%0A" in odd and "%25" in odd
    assert unescape_frame(odd) == f"odd_launch ({odd_module.__file__}:7)"
    # As many frames as the stack has, outermost first.
    (stack_id,) = {r[0] for r in rows(db, "SELECT stack_id FROM events WHERE name = 'odd;kernel'")}
    expected = stack_frames(db)[stack_id]
    assert len(frames) == len(expected)
    assert frames[-1] == escape_frame(line_label("python", expected[0], None, None))


def test_filters_by_kind_name_and_site(db, tmp_path) -> None:
    a, b = run_id(db, "a"), run_id(db, "b")
    sites = rows(
        db,
        "SELECT name, site_key, run_id, events FROM call_sites WHERE site_function = 'launch_pair' ORDER BY ALL",
    )
    (mm_site, mm_events), (gemm_site, gemm_events) = {(r[0], r[1]): r[3] for r in sites if r[2] == a}.items()
    assert [mm_site[0], gemm_site[0], mm_events, gemm_events] == ["aten::mm", "gemm", 3, 3]
    out = tmp_path / "site.folded"
    assert run_export(db, out, "collapsed", a, site=gemm_site[1]) == 3
    assert run_export(db, out, "collapsed", a, b, site=gemm_site[1]) == 3 + 1  # the same site in run b
    assert run_export(db, out, "collapsed", a, b, site=gemm_site[1], kind="kernel_launch", name="gemm") == 4
    assert all(stack.split(";")[-1].startswith("launch_pair ") for stack, _ in parse_collapsed(out.read_text()))
    assert run_export(db, out, "collapsed", a, kind="op") == 3
    assert run_export(db, out, "collapsed", a, b, name="gemm") == 7 + 3 + 4 + 1


# ------------------------------------------------------------------------------ pprof, read by Go's pprof


def go_pprof(*args: str) -> str:
    if shutil.which("go") is None:
        pytest.skip("go is not installed (Debian package golang-go): cannot read pprof files with Go's pprof")
    process = subprocess.run(["go", "tool", "pprof", *args], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    return process.stdout


def pprof_name(frame: dict) -> str:
    """How Go's pprof prints one of our frames."""
    if frame["kind"] == "marker":
        return f"[{frame['function']}]"
    return frame["function"] + (" (inline)" if frame["inlined"] else "")


def parse_traces(text: str) -> list[tuple[dict, int, list[str]]]:
    samples = []
    for block in text.split("-----------+-------------------------------------------------------")[1:]:
        labels, value, frames = {}, None, []
        for line in block.splitlines():
            if not line.strip():
                continue
            label = re.match(r"^\s*(\w+):\s+(.*)$", line)
            if label and value is None:
                labels[label.group(1)] = label.group(2)
            elif value is None:
                value_text, _, name = line.strip().partition(" ")
                value, frames = int(value_text), [name.strip()]
            else:
                frames.append(line.strip())
        if value is not None:  # pprof closes the list with one more separator
            samples.append((labels, value, frames))
    return samples


@pytest.mark.default_interpreter_only
def test_pprof_traces_equal_the_database(db, tmp_path) -> None:
    a = run_id(db, "a")
    out = tmp_path / "a.pb.gz"
    assert run_export(db, out, "pprof", a) == rows(db, "SELECT events FROM runs WHERE run_id = ?", [a])[0][0]
    assert gzip.decompress(out.read_bytes())  # gzipped, as pprof files are

    frames = stack_frames(db)
    threads = dict(
        rows(db, "SELECT unnest(map_keys(threads)), unnest(map_values(threads)) FROM runs WHERE run_id = ?", [a])
    )
    expected = Counter()
    for (kind, name, thread_id, stack_id), count in events_per(db, [a], "kind, name, thread_id, stack_id").items():
        labels = {"run": a, "kind": kind, "name": name, "thread": thread_label(thread_id, threads.get(thread_id))}
        names = [pprof_name(f) for f in frames[stack_id]]
        expected[(json.dumps(labels, sort_keys=True), count, tuple(names))] += 1
    got = Counter(
        (json.dumps(labels, sort_keys=True), value, tuple(names))
        for labels, value, names in parse_traces(go_pprof("-traces", "-symbolize=none", str(out)))
    )
    assert got == expected


def parse_top(text: str) -> tuple[int, dict[str, tuple[int, int]]]:
    total = int(re.search(r"Total samples = (-?\d+)", text).group(1)) if "Total samples" in text else None
    table: dict[str, tuple[int, int]] = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["flat", "flat%"]) + 1
    for line in lines[start:]:
        flat, _, _, cum, _, name = line.split(maxsplit=5)
        table[name] = (int(flat), int(cum))
    return total, table


@pytest.mark.default_interpreter_only
def test_pprof_top_equals_the_database(db, tmp_path) -> None:
    a, b = run_id(db, "a"), run_id(db, "b")
    out = tmp_path / "both.pb.gz"
    run_export(db, out, "pprof", a, b)
    total, top = parse_top(go_pprof("-top", "-nodecount=100000", "-symbolize=none", str(out)))
    frames = stack_frames(db)
    per_stack = events_per(db, [a, b], "stack_id")
    assert total == sum(per_stack.values())
    flat: Counter = Counter()
    cum: Counter = Counter()
    for (stack_id,), count in per_stack.items():
        names = [pprof_name(f) for f in frames[stack_id]]
        flat[names[0]] += count
        for name in set(names):
            cum[name] += count
    assert {name: values[0] for name, values in top.items() if values[0]} == dict(flat)
    # CPython 3.10's code objects carry no qualified name: the capture names the frame `work` there.
    work = "launch_in_thread.<locals>.work" if sys.version_info >= (3, 11) else "work"
    for name in ("launch_gemm", "launch_pair", "odd_launch", work):
        assert top[name][1] == cum[name], name
    assert top["launch_gemm"] == (7 + 4, 7 + 4)


@pytest.mark.default_interpreter_only
def test_pprof_diff_base_between_two_runs(db, tmp_path) -> None:
    base, new = tmp_path / "a.pb.gz", tmp_path / "b.pb.gz"
    run_export(db, base, "pprof", "latest:commit=a", kind="kernel_launch")
    run_export(db, new, "pprof", "latest:commit=b", kind="kernel_launch")
    _, top = parse_top(go_pprof("-top", "-nodecount=100000", "-symbolize=none", f"-diff_base={base}", str(new)))
    assert top["launch_gemm"] == (4 - 7, 4 - 7)
    assert top["launch_pair"] == (1 - 3, 1 - 3)
    assert top["odd_launch"] == (-2, -2)


@pytest.mark.default_interpreter_only
def test_pprof_mappings_let_pprof_symbolize_natives_itself(db, tmp_path) -> None:
    """With -symbolize=force pprof drops our names and symbolizes every native address itself from
    the mapped files: it must land on the functions our symbolizer found, never on others."""
    a = run_id(db, "a")
    out = tmp_path / "a.pb.gz"
    run_export(db, out, "pprof", a, name="gemm")
    raw = go_pprof("-raw", "-symbolize=none", str(out))
    mappings = re.findall(r"^\d+: 0x0/0xffffffffffffffff/0x0 (\S+) ([0-9a-f]+)", raw, re.M)
    assert mappings and all(len(build_id) >= 32 for _, build_id in mappings)
    gemm_stacks = {r[0] for r in rows(db, "SELECT stack_id FROM events WHERE run_id = ? AND name = 'gemm'", [a])}
    frames = stack_frames(db)
    ours = {f["function"] for s in gemm_stacks for f in frames[s] if f["kind"] != "marker"}
    physical = {f["function"] for s in gemm_stacks for f in frames[s] if f["kind"] == "native" and not f["inlined"]}
    forced = {
        name.removesuffix(" (inline)")
        for _, _, names in parse_traces(go_pprof("-traces", "-symbolize=force", str(out)))
        for name in names
        if not name.startswith("[")  # "[libfoo.so]": an address pprof's tools could not name
    }
    assert forced <= ours  # no address lands in another function
    assert len(forced & physical) >= len(physical) / 2  # and most are named again


def test_pprof_header_addresses_and_main_mapping_equal_the_database(db, tmp_path) -> None:
    """Read with the profile's own schema: the run's times, the filter in a comment, every native
    return address minus one, and the interpreter's executable as mapping[0] (pprof's main binary)."""
    a, b = run_id(db, "a"), run_id(db, "b")
    out = tmp_path / "ab.pb.gz"
    assert run_export(db, out, "pprof", a, b, kind="kernel_launch") == 7 + 3 + 4 + 1 + 2
    profile = profile_proto.message("Profile")()
    profile.ParseFromString(gzip.decompress(out.read_bytes()))
    strings = list(profile.string_table)
    ((started, ended),) = rows(
        db, "SELECT min(epoch_ns(started_at)), max(epoch_ns(ended_at)) FROM runs WHERE run_id IN (?, ?)", [a, b]
    )
    assert (profile.time_nanos, profile.duration_nanos) == (started, ended - started)
    assert [strings[c] for c in profile.comment] == [
        f"tbpipe export of runs {a}, {b}",
        "events of kind 'kernel_launch'",
    ]
    assert sum(sample.value[0] for sample in profile.sample) == 7 + 3 + 4 + 1 + 2
    names = [strings[m.filename] for m in profile.mapping]
    assert not re.search(r"[.]so([._]\d+)*$", names[0]) and any(".so" in n for n in names[1:]), names
    returns = {
        address - 1
        for (address,) in rows(
            db, "SELECT address FROM stack_frames WHERE kind = 'native' AND chain_depth = 0 AND NOT exact"
        )
    }
    written = {location.address for location in profile.location if location.mapping_id}
    assert written and written <= returns


# ------------------------------------------------------------------------------ Chrome trace


def check_chrome_trace(db: Path, trace: dict, run_ids: list[str]) -> None:
    events = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    expected = events_per(db, run_ids, "kind, name, thread_id")
    assert Counter((e["cat"], e["name"], e["tid"]) for e in events) == Counter(expected)
    assert sorted(e["args"]["event_id"] for e in events) == [
        r[0] for r in rows(db, "SELECT event_id FROM events WHERE list_contains(?, run_id) ORDER BY 1", [run_ids])
    ]
    # Each event's stack frame chain is its stack, innermost first.
    frames = stack_frames(db)
    stack_of = dict(rows(db, "SELECT event_id, stack_id FROM events"))
    table = trace["stackFrames"]
    for event in events:
        names, node = [], event["sf"]
        while node is not None:
            names.append(table[node]["name"])
            node = table[node].get("parent")
        expected_frames = frames[stack_of[event["args"]["event_id"]]]
        assert names == [line_label(f["kind"], f, f["module"], f["address"]) for f in expected_frames]
        assert event["args"]["stack_id"] == stack_of[event["args"]["event_id"]]
    # Thread names as metadata, for every thread with events.
    named = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events} <= named


def test_chrome_trace_events_and_counts_match(db, tmp_path) -> None:
    a, b = run_id(db, "a"), run_id(db, "b")
    out = tmp_path / "trace.json"
    assert run_export(db, out, "chrome-trace", a, b) == sum(events_per(db, [a, b], "run_id").values())
    trace = json.loads(out.read_text())
    check_chrome_trace(db, trace, [a, b])
    main = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["args"]["name"] == "MainThread"]
    assert len(main) == 2  # one per run
    gemm = next(e for e in trace["traceEvents"] if e.get("name") == "gemm")
    assert gemm["args"]["site"].endswith(":launch_gemm") and gemm["args"]["attrs"] == {"grid": [4, 1, 1]}
    assert isinstance(gemm["ts"], int) and gemm["ts"] > 1.7e15  # microseconds since 1970


def test_chrome_trace_with_tracebacks_in_args(db, tmp_path) -> None:
    out = tmp_path / "trace.json"
    run_export(db, out, "chrome-trace", "latest:commit=a", kind="op")
    trace = json.loads(out.read_text())
    frames = stack_frames(db)
    events = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(events) == 3 and "traceback" not in events[0]["args"]

    con = open_database(db, read_only=True)
    try:
        export(
            con, ExportFilter(runs=("latest:commit=a",), kind="op"), ExportFormat.chrome_trace, out, traceback_args=True
        )
    finally:
        con.close()
    for event in json.loads(out.read_text())["traceEvents"]:
        if event["ph"] == "i":
            expected = frames[event["args"]["stack_id"]]
            assert event["args"]["traceback"] == [line_label(f["kind"], f, f["module"], f["address"]) for f in expected]


@pytest.mark.default_interpreter_only
def test_chrome_trace_loads_in_headless_chromium(db, tmp_path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian package chromium): cannot load the trace in a browser")
    from playwright.sync_api import sync_playwright

    a, b = run_id(db, "a"), run_id(db, "b")
    out = tmp_path / "trace.json"
    run_export(db, out, "chrome-trace", a, b)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page()
            parsed = page.evaluate(
                """text => {
                    const trace = JSON.parse(text);
                    const instants = trace.traceEvents.filter(e => e.ph === "i");
                    return {instants: instants.length, frames: Object.keys(trace.stackFrames).length,
                            unresolved: instants.filter(e => !(e.sf in trace.stackFrames)).length};
                }""",
                out.read_text(),
            )
        finally:
            browser.close()
    assert parsed["instants"] == sum(events_per(db, [a, b], "run_id").values())
    assert parsed["unresolved"] == 0 and parsed["frames"] > 0


# ------------------------------------------------------------------------------ bad input


def test_bad_input_is_one_clear_line(db, tmp_path) -> None:
    def tbpipe(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*TBPIPE, "export", "--db", str(db), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "250"},  # rich wraps at the terminal's width
        )

    cases = [
        (["--run", "no-such-run", "-f", "collapsed"], "no run 'no-such-run' in the database"),
        (["--run", "latest:commit=zzz", "-f", "pprof", "-o", str(tmp_path / "x")], "no run with labels commit=zzz"),
        (["--run", "latest", "--name", "nothing-like-it", "-f", "collapsed"], "no events of name 'nothing-like-it'"),
        (["--run", "latest:commit=b", "--kind", "user", "-f", "collapsed"], "no events of kind 'user' in run"),
        (["--run", "latest", "--site", "0123456789abcdef", "-f", "collapsed"], "no call site with key"),
        (["--run", "latest", "-f", "pprof", "-o", str(tmp_path / "missing" / "x.pb.gz")], "does not exist"),
        (["--run", "latest", "-f", "pprof", "-o", str(tmp_path)], "is a directory"),
    ]
    for args, message in cases:
        process = tbpipe(*args)
        assert process.returncode == 2, (args, process.stderr)
        assert process.stderr.startswith("tbpipe: ") and message in process.stderr, (args, process.stderr)
        assert len(process.stderr.strip().splitlines()) == 1 and "Traceback" not in process.stderr
    # A place nobody can create files in (root included): refused, nothing left behind.
    process = tbpipe("--run", "latest", "-f", "collapsed", "-o", "/proc/tbpipe-export.folded")
    assert process.returncode == 2 and process.stderr.startswith("tbpipe: cannot write /proc/tbpipe-export.folded: ")
    assert len(process.stderr.strip().splitlines()) == 1 and "Traceback" not in process.stderr


def test_library_errors_are_typed(db, tmp_path) -> None:
    con = open_database(db, read_only=True)
    try:
        with pytest.raises(NoEventsError):
            export(con, ExportFilter(runs=("latest",), kind="alloc"), ExportFormat.pprof, tmp_path / "x")
        with pytest.raises(ExportOutputError):
            export(con, ExportFilter(runs=("latest",)), ExportFormat.pprof, tmp_path / "no" / "x")
        # The connection is left as it was: no temporary tables behind.
        assert query_rows(con, "SELECT count(*) FROM duckdb_tables() WHERE temporary") == [(0,)]
    finally:
        con.close()
    assert not (tmp_path / "x").exists()


def test_cli_writes_to_standard_output(db) -> None:
    process = subprocess.run(
        [*TBPIPE, "export", "--db", str(db), "--run", "latest", "-f", "collapsed", "--kind", "op"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    assert sum(count for _, count in parse_collapsed(process.stdout)) == 1
