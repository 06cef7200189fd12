"""The run manifest: what a run is, how it was captured, what it holds.

Rewritten atomically (temporary file + rename) after every flush, so a killed
process leaves the last flush's manifest behind with `complete: false`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tbpipe.schemas.format import FORMAT_NAME, MANIFEST_FILE, RAW_SCHEMA_VERSION


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


# The one git command a session start may run (for the dirty flag), and how long it may take.
_GIT_STATUS_TIMEOUT_S = 2.0
_OBJECT_NAME = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")


def _checkout_of(folder: str) -> tuple[str, str] | None:
    """(work tree root, git folder) of the git checkout holding `folder`, read from the files."""
    path = os.path.abspath(folder)
    while True:
        dot = os.path.join(path, ".git")
        if os.path.isdir(dot):
            return path, dot
        if os.path.isfile(dot):  # a worktree or submodule: "gitdir: <path>"
            with open(dot, encoding="utf-8", errors="replace") as file:
                text = file.read().strip()
            return (
                (path, os.path.normpath(os.path.join(path, text[7:].strip()))) if text.startswith("gitdir:") else None
            )
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _read_ref(git_dir: str, ref: str) -> str | None:
    """The object name `ref` (e.g. 'refs/heads/main') points at: a loose ref, else packed-refs."""
    common = git_dir
    if os.path.isfile(os.path.join(git_dir, "commondir")):  # a worktree keeps branches in the main git folder
        with open(os.path.join(git_dir, "commondir"), encoding="utf-8") as file:
            common = os.path.normpath(os.path.join(git_dir, file.read().strip()))
    for folder in dict.fromkeys((git_dir, common)):
        try:
            with open(os.path.join(folder, ref), encoding="utf-8") as file:
                return file.read().strip()
        except OSError:
            pass
    try:
        with open(os.path.join(common, "packed-refs"), encoding="utf-8") as file:
            for line in file:
                name, _, packed = line.strip().partition(" ")
                if packed == ref:
                    return name
    except OSError:
        pass
    return None


def git_state(folder: str | None = None) -> dict[str, Any] | None:
    """HEAD, a dirty flag and the root of the git checkout the program runs in (its working folder,
    else its main script's), so reports can tell which commit a run measured; None outside one.
    HEAD is read from the files; the dirty flag takes one `git status` (None when it cannot tell)."""
    starts = [folder] if folder else [os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[0] or os.curdir))]
    found = next((c for c in map(_checkout_of, starts) if c is not None), None)
    if found is None:
        return None
    root, git_dir = found
    try:
        with open(os.path.join(git_dir, "HEAD"), encoding="utf-8") as file:
            head = file.read().strip()
    except OSError:
        return None
    branch = head[5:].strip() if head.startswith("ref:") else None
    commit = _read_ref(git_dir, branch) if branch else head
    dirty = None
    git = shutil.which("git")
    if git is not None:
        try:
            status = subprocess.run(
                [git, "-C", root, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                timeout=_GIT_STATUS_TIMEOUT_S,
                env=dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C"),  # never take the index lock
                check=False,
            )
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {
        "commit": commit if commit and _OBJECT_NAME.match(commit) else None,
        "branch": branch[len("refs/heads/") :] if branch and branch.startswith("refs/heads/") else branch,
        "dirty": dirty,
        "root": root,
    }


def initial_manifest(
    run_id: str,
    labels: dict[str, str],
    sources: list[str],
    capture_settings: dict[str, Any],
    parent_run_id: str | None,
    git: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest a session starts with; `git` is a parent's `git_state()` (a forked child keeps
    it rather than ask git again), looked up when not given."""
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
        "git": git if git is not None else git_state(),
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
            "stacks_reused": 0,  # events that took an earlier event's stack (see capture/torch_ops.py)
            "stacks_reuse_checked": 0,  # reused stacks gathered anyway to check them
            "stacks_reuse_mismatched": 0,  # checks that found another stack
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


def note_counters(manifest: dict[str, Any], counters: dict[str, int]) -> None:
    """The recorder's totals and the process's thread names into the manifest (every flush, whether
    it wrote parts or not)."""
    totals = manifest["counters"]
    totals["events_recorded"] = counters["recorded"]
    totals["events_dropped"] = counters["dropped"]
    manifest["threads"].update({str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None})


def mark_closed(manifest: dict[str, Any]) -> None:
    manifest["ended_at"] = _utc_now()
    manifest["complete"] = True
