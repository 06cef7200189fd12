"""`tbpipe show` (combined tracebacks from the database) and `tbpipe demo` (`make run`) end to end."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import typer
from conftest import TBPIPE
from typer.testing import CliRunner

from tbpipe.pipeline.commands import query as query_command
from tbpipe.pipeline.commands import show as show_command
from tbpipe.pipeline.db import open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.read import NotFoundError
from tbpipe.pipeline.errors import UsageError

FRAME_LINE = re.compile(r"^(?P<file>.+):(?P<line>\d+|\?):(?P<function>.+?)(?P<inlined> \[inlined\])?$")


@pytest.fixture(scope="module")
def demo(tmp_path_factory, symbol_cache) -> tuple[Path, str]:
    """`tbpipe demo` as `make run` runs it: two nights captured, ingested, top call sites, the report."""
    global WORKLOAD
    root = tmp_path_factory.mktemp("demo")
    WORKLOAD = str((root / "demo-runs" / "checkout-2" / "workload.py").resolve())
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="80")  # a log: nothing cut
    result = subprocess.run(
        [*TBPIPE, "demo", "--out", "demo-runs"], cwd=root, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr + result.stdout
    return root / "demo-runs" / "tbpipe.duckdb", result.stdout


WORKLOAD = ""  # night-2's checkout of the demo workload, set by the `demo` fixture


def line_of(text: str) -> int:
    lines = Path(WORKLOAD).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_demo_prints_the_top_kernel_launch_sites_and_the_report(demo) -> None:
    db, output = demo
    table = {}
    for row in output.splitlines():
        cells = [c.strip() for c in row.split("│")]
        if len(cells) >= 7 and cells[1].isdigit():
            table[(cells[3], cells[4].rsplit(".", 1)[-1], cells[5])] = int(cells[2].replace(",", ""))
            assert re.fullmatch(r"[0-9a-f]{16}", cells[6]), row  # whole, to give to `tbpipe show --site`
    softmax = f"workload.py:{line_of('site: attention key')}"
    epilogue = f"workload.py:{line_of('site: feed_forward epilogue')}"
    allreduce = f"workload.py:{line_of('site: main')}"
    compare = f"workload.py:{line_of('site: feed_forward compare')}"
    layernorm = f"workload.py:{line_of('site: layer (new tonight)')}"
    steps, values = 20, 12  # night 2 sorts twice the six values of night 1
    assert table[("softmax_kernel", "key", softmax)] == steps * values  # sorted() calls key once per value
    assert table[("gemm_kernel", "feed_forward", epilogue)] == steps
    assert table[("allreduce_kernel", "main", allreduce)] == steps
    assert table[("layernorm_kernel", "layer", layernorm)] == steps
    assert table[("gemm_kernel", "compare", compare)] >= steps * (values - 1)  # qsort compares at least n-1 times
    # Each step's command on a line of its own, whole, though the output is 80 columns wide.
    commands = re.findall(r"^\$ (.+)$", output, re.MULTILINE)
    assert len(commands) == 6 and not any("…" in command for command in commands)
    assert re.search(r"^tbpipe show --site [0-9a-f]{16} --limit 1 --db \S+tbpipe\.duckdb$", commands[4], re.M)
    # The traceback printed under the table interleaves Python and native frames.
    compare_line = f"{WORKLOAD}:{line_of('site: feed_forward compare')}"
    # CPython 3.10's code objects carry no qualified name: the frame is just `compare` there.
    assert f"{compare_line}:feed_forward.<locals>.compare" in output or f"{compare_line}:compare" in output
    # Then the report between the two nights: doubled softmax, more sort comparisons, a new layernorm.
    assert "**3 regressions (1 new, 2 increased)" in output
    assert (
        f"| increased (+100%), moved from line {line_of('site: attention key') - 3} | kernel_launch | `softmax_kernel`"
        in output
    )
    html = re.search(r"^HTML report: (.+)$", output, re.MULTILINE).group(1)
    assert Path(html).is_file() and "layernorm_kernel" in Path(html).read_text()


def cli(*args: str):
    app = typer.Typer()
    show_command.register(app)
    query_command.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


def _frames(output: str) -> list[dict]:
    out = []
    for line in output.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = FRAME_LINE.match(line)
        assert match or line.startswith("<"), f"not a frame line: {line!r}"
        if match:
            out.append(match.groupdict())
    return out


def _compare_event(db: Path) -> int:
    con = open_database(db, read_only=True)
    try:
        return query_rows(
            con,
            """
            SELECT min(e.event_id) FROM events e JOIN stack_sites s USING (stack_id)
            WHERE s.site_file = ? AND s.site_line = ? AND e.name = 'gemm_kernel'
            """,
            [WORKLOAD, line_of("site: feed_forward compare")],
        )[0][0]
    finally:
        con.close()


def test_show_event_prints_the_combined_traceback(demo) -> None:
    db, _ = demo
    event_id = _compare_event(db)
    result = cli("show", "--db", str(db), "--event", str(event_id), "--frames", "all")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"# event {event_id}: kernel_launch gemm_kernel\n")
    assert '"grid": 4' in result.stdout
    frames = _frames(result.stdout)
    # Innermost first: the Python callback, then the C code that called it (libc's qsort via
    # libffi), then the Python function that called qsort, and the interpreter's own frames last.
    names = [f["function"] for f in frames]
    assert names[0].endswith("compare") and frames[0]["file"] == WORKLOAD
    qsort = next(i for i, n in enumerate(names) if "qsort" in n or "msort" in n)
    caller = next(i for i, n in enumerate(names) if n.endswith("feed_forward"))
    main = next(i for i, n in enumerate(names) if n.endswith("main") and frames[i]["file"] == WORKLOAD)
    assert 0 < qsort < caller < main
    assert any("Py_RunMain" in n or "Py_BytesMain" in n for n in names[main:])
    # Inlined frames are marked, exactly where the database says a frame is inlined.
    con = open_database(db, read_only=True)
    stack_id = query_rows(con, "SELECT stack_id FROM events WHERE event_id = ?", [event_id])[0][0]
    inlined = [
        bool(r[0])
        for r in query_rows(con, "SELECT inlined FROM stack_frames WHERE stack_id = ? ORDER BY depth", [stack_id])
    ]
    con.close()
    assert [bool(f["inlined"]) for f in frames] == inlined
    assert any(inlined)


def test_show_stack_and_site(demo) -> None:
    db, _ = demo
    event_id = _compare_event(db)
    event = cli("show", "--db", str(db), "--event", str(event_id), "--frames", "all")
    stack_id = int(re.search(r"^# stack (\d+)$", event.stdout, re.MULTILINE).group(1))
    stack = cli("show", "--db", str(db), "--stack", str(stack_id), "--frames", "all")
    assert stack.exit_code == 0, stack.output
    assert _frames(stack.stdout) == _frames(event.stdout)

    key = cli(
        "query", "--db", str(db), "-f", "csv", "SELECT site_key FROM kernel_launch_sites ORDER BY events DESC LIMIT 1"
    )
    site_key = key.stdout.splitlines()[1].strip('"')
    site = cli("show", "--db", str(db), "--site", site_key, "--limit", "2", "--frames", "all")
    assert site.exit_code == 0, site.output
    head = site.stdout.splitlines()
    # Where the site is in the newest run: night 2's checkout, at tonight's line (the heaviest site
    # moved between the nights: its first recorded place is night 1's, three lines up).
    assert re.match(rf"# call site {site_key}: .*/demo-runs/checkout-2/workload\.py:(\d+):", head[0]), head[0]
    assert head[0].endswith("(user frame; in the newest run)")
    first = cli("query", "--db", str(db), "-f", "csv", f"SELECT file, line FROM sites WHERE site_key = '{site_key}'")
    first_file, first_line = first.stdout.splitlines()[1].split(",")
    assert "checkout-1" in first_file and f"workload.py:{first_line}:" not in head[0]
    assert len(re.findall(r"^# stack \d+: [\d,]+ events \(", site.stdout, re.MULTILINE)) == 2
    assert all(f["file"] or f["function"] for f in _frames(site.stdout))


def test_show_errors(demo) -> None:
    db, _ = demo
    for args in ([], ["--event", "1", "--stack", "1"]):
        result = cli("show", "--db", str(db), *args)
        assert isinstance(result.exception, UsageError) and "exactly one of" in str(result.exception)
    for option, value, message in (
        ("--event", "99999999", "no event 99999999"),
        ("--stack", "99999999", "no stack 99999999"),
        ("--site", "feedfacefeedface", "no call site with key 'feedfacefeedface'"),
    ):
        result = cli("show", "--db", str(db), option, value)
        assert isinstance(result.exception, NotFoundError) and message in str(result.exception)
