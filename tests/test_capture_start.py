"""What `tbpipe run` costs a process's start: nothing heavy is imported before an event needs it, an
idle process still leaves a complete run, and the launcher's git state is read once for all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TBPIPE
from support.runs import read_runs

# Prints which of the writer's libraries are loaded: right after start-up, then after one event
# and a flush (its first part written).
PROGRAM = """
import sys
from tbpipe import capture

heavy = ("pyarrow", "numpy", "tbpipe.capture.writer", "tbpipe.schemas.raw")
print("start", [m for m in heavy if m in sys.modules])
capture.active_session().flush()
print("idle flush", [m for m in heavy if m in sys.modules])
if len(sys.argv) > 1:
    capture.record("kernel_launch", "gemm")
    capture.active_session().flush()
    print("event", [m for m in heavy if m in sys.modules])
"""


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "program.py").write_text(PROGRAM)
    result = subprocess.run(
        [*TBPIPE, "run", "--out", "runs", "--", sys.executable, "program.py", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


def test_the_writer_loads_with_the_first_part(tmp_path: Path) -> None:
    lines = run(tmp_path, "record").stdout.splitlines()
    assert lines[0] == "start []" and lines[1] == "idle flush []"
    assert lines[2] == "event ['pyarrow', 'numpy', 'tbpipe.capture.writer', 'tbpipe.schemas.raw']"
    (recorded,) = read_runs(tmp_path / "runs")
    assert recorded.complete and recorded.tables["events"]["name"].to_pylist() == ["gemm"]


def test_an_idle_process_leaves_a_complete_run_without_parts(tmp_path: Path) -> None:
    assert run(tmp_path).stdout.splitlines()[1] == "idle flush []"
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counters"]["events_recorded"] == 0 and manifest["files"] == {}
    assert "MainThread" in manifest["threads"].values()


def test_processes_take_the_launchers_git_state(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@x", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@x"
    )
    (tmp_path / "a.txt").write_text("a")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-q", "-m", "a"], check=True, env=env)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    # A `git` that fails on PATH: the captured process must not need to run it.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\nexit 97\n")
    (fake / "git").chmod(0o755)
    from tbpipe.capture.autostart_session import ENV_GIT, environment_for_run
    from tbpipe.capture.launch import autostart_dir
    from tbpipe.capture.manifest import git_state

    state = git_state(str(tmp_path))
    child_env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    child_env.update(environment_for_run(str(tmp_path / "runs"), {}, [], {}, (str(tmp_path), state)))
    child_env["PYTHONPATH"] = str(autostart_dir())
    (tmp_path / "program.py").write_text("pass\n")
    subprocess.run([sys.executable, "program.py"], cwd=tmp_path, env=child_env, check=True, timeout=60)
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["git"] == state and state["commit"] == head.strip() and state["dirty"] is False
    assert json.loads(child_env[ENV_GIT])["cwd"] == str(tmp_path)
