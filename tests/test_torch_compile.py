"""torch.compile on the CPU (Inductor's C++ backend) under `tbpipe run --source torch-ops`, ingested.

Ops that Inductor's generated code runs are sited at the lines of the user's `forward` their graph
nodes came from; a graph break is an event at the line that broke the graph, with the reason
`torch._dynamo.explain` gives; a recompile is an event with its failing guard; compiles are events
with their time; nothing is sited in generated code. The expected lines are read from the source
text below (marker comments), never from tbpipe's output.

Compiles take seconds: one Inductor cache folder serves the whole test session, and all scenarios run
in two captured processes. The second runs from another folder, with its lines moved (Inductor serves
its Block from its cache, with the first process's stack traces) and without the print (its graph does
not break: against it, the first one's graph break is a new regression in `tbpipe report`).

PyTorch is only installable for some Python versions on these machines (torch 2.13 CPU for CPython
3.11); elsewhere these tests skip with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.runs import read_runs

torch = pytest.importorskip(
    "torch", reason=f"PyTorch is not installed for this Python ({sys.version.split()[0]}); the compile tests need it"
)
duckdb = pytest.importorskip("duckdb", reason="the call_sites view needs DuckDB (tbpipe ingest)")

from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database  # noqa: E402

MODEL = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))  # FC1 LINE
        return self.fc2(h) + x  # FC2 LINE


def with_print(x):
    y = x * 2
    print("inside the compiled function")  # PRINT LINE
    return y + 1


def scaled(x):
    return torch.sin(x) * 3
"""

TRAIN = """\
import torch
from model import Block, scaled, with_print

torch.manual_seed(0)
x = torch.randn(4, 8)
eager = Block()
eager(x)  # EAGER CALL
block = torch.compile(Block())
out = block(x)  # BLOCK CALL
out.sum().backward()  # BACKWARD CALL
block(x)  # AGAIN CALL
broken = torch.compile(with_print)
broken(torch.randn(4))  # BREAK CALL
shaped = torch.compile(scaled, dynamic=False)
shaped(torch.randn(4))  # FIRST SHAPE CALL
shaped(torch.randn(8))  # NEW SHAPE CALL
print("trained", flush=True)
"""


def line_of(source: str, marker: str) -> int:
    (number,) = [n for n, text in enumerate(source.splitlines(), 1) if text.rstrip().endswith(f"# {marker}")]
    return number


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory) -> Path:
    """One Inductor cache folder for every compile of the test session (as the captured process sets it)."""
    return tmp_path_factory.mktemp("inductor-cache")


def capture(work: Path, cache: Path, model: str) -> Path:
    work.mkdir(parents=True)
    (work / "model.py").write_text(model)
    (work / "train.py").write_text(TRAIN)
    out = work / "runs"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tbpipe.pipeline", "run", "--out", str(out), "--source", "torch-ops", "--"]
        + [sys.executable, "train.py"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "trained" in result.stdout
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, inductor_cache, symbol_cache):
    """Two captured processes (the second one's model moved down its file, in another folder) and their database."""
    base = tmp_path_factory.mktemp("compiled")
    first = capture(base / "first", inductor_cache, MODEL)
    moved = "# three lines\n# that move every\n# line of the model down\n" + "".join(
        line for line in MODEL.splitlines(keepends=True) if not line.rstrip().endswith("# PRINT LINE")
    )
    second = capture(base / "second", inductor_cache, moved)
    db = base / "compiled.duckdb"
    summary = ingest_runs([first, second], IngestOptions(db_path=db, cache_dir=symbol_cache, progress=False))
    assert summary.ok, [o.reason for o in summary.outcomes]
    return {
        "first": first,
        "second": second,
        "db": db,
        "cache": inductor_cache,
        "models": {"first": MODEL, "second": moved},
    }


def query(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def main_run(compiled, which: str):
    """The captured program's run (Inductor's compile workers, its child processes, have runs of their own)."""
    (run,) = [r for r in read_runs(compiled[which]) if r.manifest["argv"][-1:] == ["train.py"]]
    return run


def run_of(compiled, which: str) -> str:
    return main_run(compiled, which).run_id


@pytest.mark.parametrize("which", ["first", "second"])
def test_ops_of_compiled_code_are_sited_at_the_forward_lines(compiled, which) -> None:
    model = compiled["models"][which]
    model_file = str(compiled[which].parent / "model.py")
    fc1, fc2 = line_of(model, "FC1 LINE"), line_of(model, "FC2 LINE")
    run_id = run_of(compiled, which)
    # The eager Block's ops run from Block.forward; the compiled one's from Inductor's wrapper, whose
    # extern addmm calls must land on the same two lines.
    rows = query(
        compiled["db"],
        """
        SELECT site_function, site_file, site_line, site_is_user, sum(events)
        FROM call_sites WHERE run_id = ? AND kind = 'op' AND name = 'aten::addmm' GROUP BY ALL ORDER BY site_line
        """,
        [run_id],
    )
    assert [(f, file, line, user) for f, file, line, user, _n in rows] == [
        ("Block.forward", model_file, fc1, True),
        ("Block.forward", model_file, fc2, True),
    ]
    # One eager call and two compiled calls (the first compiled call may run its ops twice: Inductor
    # checks the graph's custom ops on it).
    assert all(n >= 3 for *_rest, n in rows)
    # Backward of the compiled graph: its matrix products come from the same forward lines.
    backward = query(
        compiled["db"],
        "SELECT DISTINCT site_file, site_line FROM call_sites WHERE run_id = ? AND kind = 'op' AND name = 'aten::mm'",
        [run_id],
    )
    assert set(backward) == {(model_file, fc1), (model_file, fc2)}


def test_compiled_and_eager_ops_of_a_line_are_one_call_site(compiled) -> None:
    run_id = run_of(compiled, "first")
    rows = query(
        compiled["db"],
        """
        SELECT s.site_line, count(DISTINCT t.site_key), bool_or(f.inlined), bool_or(NOT f.inlined)
        FROM event_counts e
        JOIN runs r USING (run_number)
        JOIN event_names n USING (name_id)
        JOIN stack_sites s USING (stack_id)
        JOIN sites t USING (site_id)
        JOIN stack_frames f ON f.stack_id = s.stack_id AND f.depth = s.site_depth
        WHERE r.run_id = ? AND n.name = 'aten::addmm'
        GROUP BY s.site_line ORDER BY s.site_line
        """,
        [run_id],
    )
    # Per line: one site key, reached both from an eager frame and from a frame placed inside the
    # generated code (inlined), so nightly comparisons see compiled and eager runs alike.
    assert [(keys, compiled_frame, eager_frame) for _line, keys, compiled_frame, eager_frame in rows] == [
        (1, True, True),
        (1, True, True),
    ]
    # And the moved copy in the other folder (served from Inductor's cache) has the same two sites.
    keys = "SELECT DISTINCT site_key FROM call_sites WHERE run_id = ? AND name = 'aten::addmm' ORDER BY 1"
    assert query(compiled["db"], keys, [run_id]) == query(compiled["db"], keys, [run_of(compiled, "second")])


def test_nothing_is_sited_in_generated_code(compiled) -> None:
    cache = str(compiled["cache"])
    for which in ("first", "second"):
        run = main_run(compiled, which)
        assert run.manifest["generated_code"]["inductor"] == cache
        # The raw stacks do hold frames of Inductor's wrappers (what was sited before this class existed).
        files = set(run.tables["code"]["filename"].to_pylist())
        assert any(f.startswith(cache + "/") for f in files)
        assert run.tables["code_origins"].num_rows > 0
    sites = query(compiled["db"], "SELECT DISTINCT site_file FROM call_sites WHERE site_file IS NOT NULL")
    assert sites
    for (file,) in sites:
        assert not file.startswith(cache + "/") and not file.startswith("<"), file
        assert "codegen(" not in file
    assert query(compiled["db"], "SELECT count(*) FROM call_sites WHERE site_key IS NOT NULL AND NOT site_is_user") == [
        (0,)
    ]
    generated = query(compiled["db"], "SELECT file FROM python_files WHERE is_generated")
    assert any(f.startswith(cache + "/") for (f,) in generated)
    assert not any(
        is_user for (is_user,) in query(compiled["db"], "SELECT is_user FROM python_files WHERE is_generated")
    )


def test_tracebacks_mark_generated_frames_and_the_lines_compiled_into_them(compiled, tmp_path) -> None:
    model_file = str(compiled["first"].parent / "model.py")
    fc1 = line_of(MODEL, "FC1 LINE")
    (stack_id,) = query(
        compiled["db"],
        """
        SELECT min(s.stack_id) FROM stack_sites s JOIN stack_frames f ON f.stack_id = s.stack_id AND f.depth = s.site_depth
        WHERE f.inlined AND f.file = ? AND f.line = ?
        """,
        [model_file, fc1],
    )[0]
    (traceback,) = query(compiled["db"], "SELECT traceback FROM stack_tracebacks WHERE stack_id = ?", [stack_id])[0]
    lines = traceback.split("\n")
    at = lines.index(f"{model_file}:{fc1}:Block.forward [inlined]")
    assert lines[at + 1].startswith(str(compiled["cache"]) + "/") and lines[at + 1].endswith(":Runner.call [generated]")
    shown = subprocess.run(
        [sys.executable, "-m", "tbpipe.pipeline", "show", "--db", str(compiled["db"]), "--stack", str(stack_id)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"{model_file}:{fc1}:Block.forward [inlined]" in shown.stdout
    assert "Runner.call [generated]" in shown.stdout


def test_graph_break_is_an_event_at_the_print_line_with_dynamos_reason(compiled) -> None:
    work = compiled["first"].parent
    sys.path.insert(0, str(work))
    try:
        import model  # the captured program's own module

        torch._dynamo.reset()
        explained = torch._dynamo.explain(model.with_print)(torch.randn(4))
    finally:
        sys.path.remove(str(work))
        sys.modules.pop("model", None)
        torch._dynamo.reset()
    (expected,) = explained.break_reasons
    print_line = line_of(MODEL, "PRINT LINE")
    assert expected.user_stack[-1].lineno == print_line  # what Dynamo itself says

    run_id = run_of(compiled, "first")
    rows = query(
        compiled["db"],
        """
        SELECT name, site_function, site_file, site_line, sum(events) FROM call_sites
        WHERE run_id = ? AND kind = 'graph_break' GROUP BY ALL
        """,
        [run_id],
    )
    assert rows == [(expected.reason.split("\n")[0], "with_print", str(work / "model.py"), print_line, 1)]
    (attrs,) = query(
        compiled["db"],
        "SELECT attrs FROM events WHERE run_id = ? AND kind = 'graph_break'",
        [run_id],
    )[0]
    attrs = json.loads(attrs)
    assert attrs["reason"] == expected.reason
    assert (attrs["file"], attrs["line"]) == (str(work / "model.py"), print_line)


def test_recompile_is_an_event_at_the_new_shape_with_its_guard(compiled) -> None:
    work = compiled["first"].parent
    run_id = run_of(compiled, "first")
    rows = query(
        compiled["db"],
        """
        SELECT e.name, s.site_file, s.site_line, e.attrs
        FROM events e JOIN stack_sites s USING (stack_id)
        WHERE e.run_id = ? AND e.kind = 'recompile'
        """,
        [run_id],
    )
    (name, file, line, attrs) = rows[0]
    assert len(rows) == 1
    assert (name, file, line) == ("scaled", str(work / "train.py"), line_of(TRAIN, "NEW SHAPE CALL"))
    reason = json.loads(attrs)["reason"]
    assert "size mismatch at index 0" in reason and "expected 4, actual 8" in reason


def test_compiles_are_events_with_their_time_at_the_calls_that_caused_them(compiled) -> None:
    run_id = run_of(compiled, "first")
    rows = query(
        compiled["db"],
        """
        SELECT e.name, s.site_line, CAST(e.attrs AS JSON)->>'seconds' AS seconds
        FROM events e JOIN stack_sites s USING (stack_id)
        WHERE e.run_id = ? AND e.kind = 'compile' AND s.site_file LIKE '%/train.py'
        ORDER BY e.event_id
        """,
        [run_id],
    )
    at = {(name, line) for name, line, _seconds in rows}
    assert ("forward", line_of(TRAIN, "BLOCK CALL")) in at
    assert ("forward (backward)", line_of(TRAIN, "BACKWARD CALL")) in at
    assert ("with_print", line_of(TRAIN, "BREAK CALL")) in at
    assert ("scaled", line_of(TRAIN, "FIRST SHAPE CALL")) in at
    assert ("scaled", line_of(TRAIN, "NEW SHAPE CALL")) in at
    assert all(float(seconds) > 0 for *_rest, seconds in rows)
    # The second call of the compiled Block compiled nothing.
    assert not any(line == line_of(TRAIN, "AGAIN CALL") for _name, line in at)


def test_a_new_graph_break_is_a_regression_in_the_report(compiled) -> None:
    first, second = run_of(compiled, "first"), run_of(compiled, "second")
    result = subprocess.run(
        [sys.executable, "-m", "tbpipe.pipeline", "report", "--db", str(compiled["db"]), "--format", "json"]
        + ["--candidate", first, "--baseline", second],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    breaks = [s for s in report["regressions"] if s["kind"] == "graph_break"]
    model_file = str(compiled["first"].parent / "model.py")
    assert [(s["site_file"], s["site_line"], s["change"], s["flagged"]) for s in breaks] == [
        (model_file, line_of(MODEL, "PRINT LINE"), "new", True)
    ]
    # The compiled Block's ops moved down their file in the baseline: the same sites, not new ones.
    flagged_ops = [s for s in report["regressions"] if s["name"] == "aten::addmm"]
    assert flagged_ops == []
    frames = breaks[0]["traceback"]
    at = next(i for i, frame in enumerate(frames) if frame["file"] == model_file)
    assert frames[at]["inlined"] and frames[at + 1]["generated"] and frames[at + 1]["file"].startswith("<tbpipe: ")
