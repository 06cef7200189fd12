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

WORKLOAD = str(Path(__import__("tbpipe.pipeline.demo.workload", fromlist=["x"]).__file__).resolve())
FRAME_LINE = re.compile(r"^(?P<file>.+):(?P<line>\d+|\?):(?P<function>.+?)(?P<inlined> \[inlined\])?$")


@pytest.fixture(scope="module")
def demo(tmp_path_factory, symbol_cache) -> tuple[Path, str]:
    """`tbpipe demo` as `make run` runs it: capture, ingest, top call sites."""
    root = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="250")
    result = subprocess.run(
        [*TBPIPE, "demo", "--out", "demo-runs"], cwd=root, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr + result.stdout
    return root / "demo-runs" / "tbpipe.duckdb", result.stdout


def line_of(text: str) -> int:
    lines = Path(WORKLOAD).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_demo_prints_the_top_kernel_launch_sites(demo) -> None:
    db, output = demo
    table = {}
    for row in output.splitlines():
        cells = [c.strip() for c in row.split("│")]
        if len(cells) >= 7 and cells[1].isdigit():
            table[(cells[3], cells[4].rsplit(".", 1)[-1], cells[5])] = int(cells[2].replace(",", ""))
    softmax = WORKLOAD + f":{line_of('site: attention key')}"
    epilogue = WORKLOAD + f":{line_of('site: feed_forward epilogue')}"
    allreduce = WORKLOAD + f":{line_of('site: main')}"
    compare = WORKLOAD + f":{line_of('site: feed_forward compare')}"
    steps = 20
    assert table[("softmax_kernel", "key", softmax)] == steps * 6  # sorted() calls key once per value
    assert table[("gemm_kernel", "feed_forward", epilogue)] == steps
    assert table[("allreduce_kernel", "main", allreduce)] == steps
    assert table[("gemm_kernel", "compare", compare)] >= steps * 5  # qsort compares at least n-1 times
    assert "tbpipe show --site" in output
    # The traceback printed under the table interleaves Python and native frames.
    assert f"{compare}:feed_forward.<locals>.compare" in output or f"{compare}:compare" in output


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
            SELECT min(e.event_id) FROM events e JOIN stack_sites s USING (stack_id) JOIN sites t USING (site_id)
            WHERE t.line = ? AND e.name = 'gemm_kernel'
            """,
            [line_of("site: feed_forward compare")],
        )[0][0]
    finally:
        con.close()


def test_show_event_prints_the_combined_traceback(demo) -> None:
    db, _ = demo
    event_id = _compare_event(db)
    result = cli("show", "--db", str(db), "--event", str(event_id))
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
    event = cli("show", "--db", str(db), "--event", str(event_id))
    stack_id = int(re.search(r"^# stack (\d+)$", event.stdout, re.MULTILINE).group(1))
    stack = cli("show", "--db", str(db), "--stack", str(stack_id))
    assert stack.exit_code == 0, stack.output
    assert _frames(stack.stdout) == _frames(event.stdout)

    key = cli(
        "query", "--db", str(db), "-f", "csv", "SELECT site_key FROM kernel_launch_sites ORDER BY events DESC LIMIT 1"
    )
    site_key = key.stdout.splitlines()[1].strip('"')
    site = cli("show", "--db", str(db), "--site", site_key, "--limit", "2")
    assert site.exit_code == 0, site.output
    head = site.stdout.splitlines()
    assert head[0].startswith(f"# call site {site_key}: {WORKLOAD}:") and head[0].endswith("(user frame)")
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
