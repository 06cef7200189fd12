"""Running a whole program under capture (`tbpipe run`): every Python process in it records its own run.

The launcher puts `capture/autostart/` first on PYTHONPATH and describes the session in the
environment (`autostart_session`); each Python process of the program, children included, then
starts a session at start-up and writes one run folder into the output folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tbpipe.capture.errors import LaunchError


def autostart_dir() -> Path:
    """The folder whose sitecustomize.py starts recording in each captured process."""
    return Path(__file__).resolve().parent / "autostart"


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings -> {KEY: VALUE}; LaunchError names the first malformed one."""
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise LaunchError(f"label {pair!r} is not of the form KEY=VALUE")
        labels[key] = value
    return labels


def run_captured(
    command: list[str],
    out_dir: Path,
    labels: dict[str, str],
    sources: list[str],
    options: dict[str, object] | None = None,
    cwd: Path | None = None,
) -> int:
    """Runs `command` (in `cwd`) with every Python process in it recording into `out_dir`; returns its
    exit status. `options` are Session keyword options (sample_rate, max_events_per_stack_per_s).
    """
    if not command:
        raise LaunchError("nothing to run: give the command after --, e.g. tbpipe run -- python train.py")
    env = captured_environment(out_dir, labels, sources, options, cwd)
    before = _run_dirs(out_dir)
    try:
        status = subprocess.call(command, env=env, cwd=cwd)
    except FileNotFoundError:
        raise LaunchError(f"command not found: {command[0]}") from None
    if not _run_dirs(out_dir) - before:
        # Nothing recorded is almost always a set-up problem, not an idle program.
        print(
            f"tbpipe: no Python process of `{command[0]}` recorded into {out_dir} (is it a Python program? "
            "`python -I`/`-E` ignore PYTHONPATH, through which tbpipe starts recording)",
            file=sys.stderr,
        )
    return status


def captured_environment(
    out_dir: Path,
    labels: dict[str, str],
    sources: list[str],
    options: dict[str, object] | None = None,
    cwd: Path | None = None,
) -> dict[str, str]:
    """This process's environment for a program (run in `cwd`) whose every Python process records
    into `out_dir` (made here); LaunchError or SessionError on bad labels, sources or options."""
    from tbpipe.capture.autostart_session import environment_for_run
    from tbpipe.capture.manifest import git_state
    from tbpipe.capture.sessions import Session, ensure_out_dir

    # Validate labels, sources and options here, once, with the session's own
    # checks, rather than let every captured process fail on them.
    Session(out_dir, labels, sources, **(options or {}))
    ensure_out_dir(out_dir)
    env = dict(os.environ)
    folder = os.path.abspath(cwd or os.curdir)
    env.update(environment_for_run(str(out_dir.resolve()), labels, sources, options, (folder, git_state(folder))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(autostart_dir()), env.get("PYTHONPATH", "")) if p)
    return env


def _run_dirs(out_dir: Path) -> set[Path]:
    return {manifest.parent for manifest in out_dir.glob("*/manifest.json")}
