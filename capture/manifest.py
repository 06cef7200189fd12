"""The run manifest: what a run is, how it was captured, what it holds.

Rewritten atomically (temporary file + rename) after every flush, so a killed
process leaves the last flush's manifest behind with `complete: false`.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tbpipe.schemas.raw import FORMAT_NAME, MANIFEST_FILE, RAW_SCHEMA_VERSION


def new_run_id() -> str:
    """Sortable by start time, unique across hosts and processes."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _torch_version() -> str | None:
    # Only report torch when the program imported it: importing it here would
    # cost seconds and change the program under test.
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None) if torch is not None else None


def _cuda_version() -> str | None:
    """The CUDA version torch was built with, once the program imported torch (None for CPU builds)."""
    version = getattr(sys.modules.get("torch.version"), "cuda", None)
    return str(version) if version else None


def _import_roots() -> list[str]:
    """sys.path as absolute folders: the ingest names Python files relative to these, so that a
    site keeps its identity when the same code runs from another checkout folder."""
    roots = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        if path not in roots:
            roots.append(path)
    return roots


def initial_manifest(
    run_id: str,
    labels: dict[str, str],
    sources: list[str],
    capture_settings: dict[str, Any],
    parent_run_id: str | None,
) -> dict[str, Any]:
    from tbpipe.capture import __version__

    return {
        "format": FORMAT_NAME,
        "schema_version": RAW_SCHEMA_VERSION,
        "run_id": run_id,
        "parent_run_id": parent_run_id,
        "started_at": _utc_now(),
        "ended_at": None,
        "complete": False,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch_version": _torch_version(),
        "cuda_version": _cuda_version(),
        "sys_path": _import_roots(),
        "tbpipe_version": __version__,
        "labels": dict(labels),
        "sources": list(sources),
        "capture": dict(capture_settings),
        "counters": {
            "events_recorded": 0,
            "events_dropped": 0,  # the flusher fell behind: buffers were full
            "events_sampled_out": 0,  # left out by the session's sample_rate
            "events_rate_limited": 0,  # left out by max_events_per_stack_per_s
            "events_written": 0,
            "stacks_written": 0,
        },
        "source_status": {},  # per source: "recording", or one line saying why it records nothing
        "files": {},
        "threads": {},
        "errors": [],
    }


def write_manifest(run_dir: Path, manifest: dict[str, Any], unless_same_as: str | None = None) -> str:
    """Writes the manifest (whole or not at all: under a hidden name, then renamed) and returns what
    it says apart from its time stamp. Given the previous return value, a manifest that says nothing
    new is not rewritten: a process idle for hours keeps its run folder still (fewer writes, and a
    kill finds no write in progress)."""
    manifest["torch_version"] = manifest.get("torch_version") or _torch_version()
    manifest["cuda_version"] = manifest.get("cuda_version") or _cuda_version()
    # sys.path grows after start-up (the script's folder comes after sitecustomize, programs add
    # their own): keep every root seen, in the order first seen.
    roots = manifest.setdefault("sys_path", [])
    roots.extend(root for root in _import_roots() if root not in roots)
    content = json.dumps({k: v for k, v in manifest.items() if k != "updated_at"}, sort_keys=True)
    if content == unless_same_as:
        return content
    manifest["updated_at"] = _utc_now()
    target = run_dir / MANIFEST_FILE
    temporary = run_dir / f".{MANIFEST_FILE}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(temporary, target)
    return content


def mark_closed(manifest: dict[str, Any]) -> None:
    manifest["ended_at"] = _utc_now()
    manifest["complete"] = True
