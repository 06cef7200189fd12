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


def environment_for_run(
    out_dir: str, labels: dict[str, str], sources: list[str], options: dict[str, object] | None = None
) -> dict[str, str]:
    return {
        ENV_OUT: out_dir,
        ENV_LABELS: json.dumps(labels),
        ENV_SOURCES: ",".join(sources),
        ENV_OPTIONS: json.dumps(options or {}),
    }


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
        session.start()
    except Exception as error:  # never stop the program under test
        print(f"tbpipe: not recording pid {os.getpid()}: {error}", file=sys.stderr)
        return
    # Python processes this one starts record into their own runs, linked to this one.
    os.environ[ENV_PARENT] = session.run_id or ""
