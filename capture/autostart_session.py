"""The environment contract between `tbpipe run` and the processes it captures."""

from __future__ import annotations

import json
import os
import sys

ENV_OUT = "TBPIPE_RUN_OUT"
ENV_LABELS = "TBPIPE_RUN_LABELS"  # JSON object
ENV_SOURCES = "TBPIPE_RUN_SOURCES"  # comma-separated
ENV_PARENT = "TBPIPE_RUN_PARENT"  # run id of the process that started this one
ENV_OPTIONS = "TBPIPE_RUN_OPTIONS"  # JSON object of Session keyword options (sampling, limits)
# JSON {"cwd": folder, "git": git_state(folder)}: the launcher's checkout, read once for all the
# processes it starts (a `git status` each would cost every process of a big suite its start).
ENV_GIT = "TBPIPE_RUN_GIT"


def environment_for_run(
    out_dir: str,
    labels: dict[str, str],
    sources: list[str],
    options: dict[str, object] | None = None,
    git: tuple[str, dict[str, object] | None] | None = None,
) -> dict[str, str]:
    """`git`: (folder, its git_state) as the launcher read it, for the processes that run there."""
    env = {
        ENV_OUT: out_dir,
        ENV_LABELS: json.dumps(labels),
        ENV_SOURCES: ",".join(sources),
        ENV_OPTIONS: json.dumps(options or {}),
    }
    if git is not None and git[1] is not None:
        env[ENV_GIT] = json.dumps({"cwd": git[0], "git": git[1]})
    return env


def _launcher_git() -> dict[str, object] | None:
    """The launcher's git state when this process runs in the same folder, else None (read here)."""
    try:
        given = json.loads(os.environ.get(ENV_GIT) or "null")
        if isinstance(given, dict) and given.get("cwd") == os.getcwd() and isinstance(given.get("git"), dict):
            return given["git"]
    except (ValueError, OSError):
        pass
    return None


def start_from_environment() -> None:
    out_dir = os.environ.get(ENV_OUT)
    if not out_dir:
        return
    from tbpipe.capture.sessions import Session

    try:
        labels = json.loads(os.environ.get(ENV_LABELS) or "{}")
        sources = [s for s in (os.environ.get(ENV_SOURCES) or "").split(",") if s]
        options = json.loads(os.environ.get(ENV_OPTIONS) or "{}")
        session = Session(out_dir, labels, sources, parent_run_id=os.environ.get(ENV_PARENT) or None, **options)
        session._git = _launcher_git()
        session.start()
    except Exception as error:  # never stop the program under test
        print(f"tbpipe: not recording pid {os.getpid()}: {error}", file=sys.stderr)
        return
    # Python processes this one starts record into their own runs, linked to this one.
    os.environ[ENV_PARENT] = session.run_id or ""
