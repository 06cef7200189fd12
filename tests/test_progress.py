"""The long commands (`tbpipe export`, `tbpipe report`, `tbpipe lake export`): a progress bar on stderr
when it is a terminal (a real pseudo-terminal here), nothing of it in a pipe, under CI or with
--no-progress; the output is the same either way."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TBPIPE

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, ingest_runs
from tbpipe.pipeline.progress import StepProgress, on_terminal

# What a bar draws with: escape sequences, carriage returns, and rich's bar of heavy lines.
BAR = re.compile("[\x1b\r\u2501]")


def launch(times: int) -> None:
    for _ in range(times):
        capture.record("kernel_launch", "gemm")


@pytest.fixture(scope="module")
def db(tmp_path_factory, symbol_cache) -> Path:
    root = tmp_path_factory.mktemp("progress")
    for commit, times in (("a", 3), ("b", 5)):
        with capture.session(root / "runs", labels={"suite": "progress", "commit": commit}):
            launch(times)
    path = root / "tbpipe.duckdb"
    summary = ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False))
    assert summary.ok and summary.ingested == 2
    return path


# Each command, the bar's title, and the file it writes (checked to be the same with and without a bar).
COMMANDS = {
    "export": (
        lambda db, out: ["export", "--db", str(db), "--run", "latest", "--run", "latest:commit=a", "-f", "collapsed",
                         "-o", str(out / "gemm.folded")],
        "export collapsed",
        "gemm.folded",
    ),
    "report": (
        lambda db, out: ["report", "--db", str(db), "--candidate", "latest", "--baseline", "latest:commit=a",
                         "--no-suspects", "--format", "json", "-o", str(out / "report.json")],
        "report",
        "report.json",
    ),
    "lake export": (
        lambda db, out: ["lake", "export", "--db", str(db), "--lake", str(out / "lake")],
        "lake export",
        "lake/runs",
    ),
}  # fmt: skip


def _environment(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env.update(TERM="xterm-256color", COLUMNS="120", **changes)
    return env


def on_a_terminal(args: list[str], env: dict[str, str], timeout_s: float = 120.0) -> tuple[int, str]:
    """Runs the CLI with stderr on a pseudo-terminal (stdout to a pipe): its exit status and what
    the terminal received."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [*TBPIPE, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env
    )
    os.close(slave)
    received = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                break
            if not chunk:
                break
            received += chunk
        status = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
        process.stdout.close()
    return status, received.decode("utf-8", "replace")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bar_on_a_terminal_none_in_a_pipe(db, tmp_path, command) -> None:
    make_args, title, written = COMMANDS[command]
    piped, terminal = tmp_path / "piped", tmp_path / "terminal"
    piped.mkdir()
    terminal.mkdir()

    result = subprocess.run([*TBPIPE, *make_args(db, piped)], capture_output=True, text=True, env=_environment())
    assert result.returncode == 0, result.stderr
    assert not BAR.search(result.stderr) and result.stderr[:8] in ("", "tbpipe: "), result.stderr

    status, drawn = on_a_terminal(make_args(db, terminal), _environment())
    assert status == 0, drawn
    assert "\x1b[" in drawn and "\u2501" in drawn and title in drawn, drawn  # the bar, drawn and taken away
    if command != "lake export":
        assert (terminal / written).read_bytes() == (piped / written).read_bytes()
    else:
        assert (terminal / written).is_dir() and (piped / written).is_dir()


def test_no_bar_on_a_terminal_under_ci_or_when_told(db, tmp_path) -> None:
    make_args = COMMANDS["lake export"][0]
    for env, flag in ((_environment(CI="true"), []), (_environment(), ["--no-progress"])):
        status, drawn = on_a_terminal([*make_args(db, tmp_path), *flag], env)
        assert status == 0, drawn
        assert not BAR.search(drawn.replace("\r\n", "\n")), (flag, drawn)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_follows_the_terminal(monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert on_terminal() and StepProgress("x", 1, None).enabled
    assert not StepProgress("x", 1, False).enabled and not StepProgress("x", 1).enabled  # a library's default
    monkeypatch.setenv("CI", "true")
    assert not on_terminal() and on_terminal(True)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.delenv("CI")
    assert not StepProgress("x", 1, None).enabled
