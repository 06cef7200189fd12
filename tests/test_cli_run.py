"""`tbpipe run`: a whole program and its Python children, one run each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import TBPIPE
from support.runs import read_runs

PROGRAM = """
import subprocess, sys
from tbpipe.capture import record
record("kernel_launch", "parent_kernel")
if len(sys.argv) == 1:
    subprocess.run([sys.executable, __file__, "child"], check=True)
else:
    record("kernel_launch", "child_kernel")
sys.exit(3 if len(sys.argv) == 1 else 0)
"""


def tbpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*TBPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_run_captures_program_and_python_children(tmp_path: Path) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    result = tbpipe("run", "--out", "runs", "--label", "suite=cli", "--", sys.executable, str(script), cwd=tmp_path)
    assert result.returncode == 3, result.stderr  # the program's own exit status
    runs = read_runs(tmp_path / "runs")
    assert len(runs) == 2
    by_name = {r.tables["events"]["name"].to_pylist()[-1]: r for r in runs}
    parent, child = by_name["parent_kernel"], by_name["child_kernel"]
    assert child.manifest["parent_run_id"] == parent.run_id
    assert parent.manifest["labels"] == child.manifest["labels"] == {"suite": "cli"}
    assert parent.complete and child.complete
    assert child.tables["events"]["name"].to_pylist() == ["parent_kernel", "child_kernel"]


def test_run_rejects_label_without_equals(tmp_path: Path) -> None:
    result = tbpipe("run", "--label", "oops", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert result.returncode == 2
    assert "label 'oops' is not of the form KEY=VALUE" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_rejects_unknown_source(tmp_path: Path) -> None:
    result = tbpipe("run", "--source", "nope", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown event source 'nope'" in result.stderr


def test_run_rejects_unwritable_out(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file")
    result = tbpipe("run", "--out", "taken/runs", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert result.returncode == 2
    assert "taken/runs" in result.stderr and "Traceback" not in result.stderr


def test_run_without_command(tmp_path: Path) -> None:
    result = tbpipe("run", cwd=tmp_path)
    assert result.returncode == 2
    assert "nothing to run" in result.stderr


def test_run_passes_sampling_options_to_every_process(tmp_path: Path) -> None:
    script = tmp_path / "many.py"
    script.write_text("from tbpipe.capture import record\nfor i in range(4000):\n    record('user', 'tick')\n")
    result = tbpipe("run", "--out", "runs", "--sample-rate", "0.25", "--", sys.executable, str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    assert run.manifest["capture"]["sample_rate"] == 0.25
    counters = run.manifest["counters"]
    written = run.tables["events"].num_rows
    assert written == counters["events_written"]
    assert written + counters["events_sampled_out"] == 4000
    assert 500 < written < 1500  # about a quarter


def test_run_rejects_bad_sample_rate(tmp_path: Path) -> None:
    result = tbpipe("run", "--sample-rate", "2", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert result.returncode == 2
    assert "sample rate must be in (0, 1]" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_run_passes_op_stacks_and_rejects_an_unknown_setting(tmp_path: Path) -> None:
    result = tbpipe(
        "run", "--out", "runs", "--op-stacks", "outermost", "--", sys.executable, "-c", "pass", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    assert run.manifest["capture"]["op_stacks"] == "outermost"
    result = tbpipe("run", "--out", "bad", "--op-stacks", "inner", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert result.returncode == 2
    assert "op_stacks must be one of own, outermost, not 'inner'" in result.stderr
    assert not (tmp_path / "bad").exists()


def test_run_says_when_nothing_was_recorded(tmp_path: Path) -> None:
    # Isolated mode ignores PYTHONPATH, so the program runs unrecorded: say so.
    result = tbpipe("run", "--out", "runs", "--", sys.executable, "-I", "-c", "pass", cwd=tmp_path)
    assert result.returncode == 0
    assert "no Python process" in result.stderr and "recorded" in result.stderr
    assert read_runs(tmp_path / "runs") == []
