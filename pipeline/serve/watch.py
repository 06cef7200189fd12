"""Watching run folders: each run folder under a `--watch` folder is handed to the ingest service once
per state of its files.

A run folder's state is what `tbpipe ingest` keys re-ingests on (`rawrun.parts_fingerprint`: its
parts and sizes, and whether the manifest says complete), so a live process rewriting its manifest
every second without new events does not count as a change. A complete run is ingested as soon as
it is seen; a run still being written once its state has not changed for `idle_s` (what it holds so
far goes in, marked incomplete), and again whenever its state changes and settles, last when it
completes. A folder that cannot be read as a run is handed over once it has been idle too, so the
ingest quarantines it with its reason; it is tried again only when it changes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tbpipe.pipeline.errors import TbpipeError
from tbpipe.pipeline.rawrun import DamagedRunError, find_run_dirs, parts_fingerprint, read_manifest
from tbpipe.pipeline.serve.background import PollingThread
from tbpipe.pipeline.serve.ingest import DONE, IngestJob, IngestService

log = logging.getLogger("tbpipe.serve.watch")


@dataclass
class _Seen:
    state: str
    complete: bool
    changed_at: float
    handed: str | None = None  # the state last handed to the ingest (and done)
    pending: bool = False


def folder_state(run_dir: Path) -> tuple[str, bool]:
    """(state, complete): the ingest's fingerprint of the run, or the reason it cannot be read."""
    try:
        manifest = read_manifest(run_dir)
        return parts_fingerprint(run_dir, manifest), bool(manifest.get("complete"))
    except DamagedRunError as error:
        names = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
        return f"damaged:{error}:{names}", False
    except OSError as error:
        return f"unreadable:{error}", False


class Watcher(PollingThread):
    name = "tbpipe-watch"
    failure = "scanning the watched folders failed"
    log = log

    def __init__(self, roots: list[Path], ingest: IngestService, idle_s: float = 30.0, poll_s: float = 1.0):
        super().__init__(poll_s)
        self.roots = [Path(r) for r in roots]
        self.ingest = ingest
        self.idle_s = idle_s
        self._seen: dict[Path, _Seen] = {}
        self._lock = threading.Lock()
        self.scans = 0

    def step(self) -> None:
        self.scan()

    def _run_dirs(self) -> list[Path]:
        found = []
        for root in self.roots:
            try:
                found += find_run_dirs([root])
            except TbpipeError as error:  # a watched folder that does not exist (yet)
                log.debug("%s", error)
        return found

    def scan(self, now: float | None = None) -> list[Path]:
        """One pass: hands every ready run folder to the ingest (one job); returns them."""
        now = time.monotonic() if now is None else now
        ready = []
        with self._lock:
            for run_dir in self._run_dirs():
                state, complete = folder_state(run_dir)
                seen = self._seen.get(run_dir)
                if seen is None or seen.state != state:
                    seen = self._seen[run_dir] = _Seen(
                        state, complete, now, seen.handed if seen else None, seen.pending if seen else False
                    )
                if seen.pending or seen.handed == state:
                    continue
                if complete or now - seen.changed_at >= self.idle_s:
                    seen.pending = True
                    ready.append((run_dir, state))
            self.scans += 1
        if ready:
            handed = dict(ready)

            def finished(job: IngestJob) -> None:
                with self._lock:
                    for path, state in handed.items():
                        seen = self._seen.get(path)
                        if seen is None:
                            continue
                        seen.pending = False
                        if job.status == DONE:
                            seen.handed = state  # retried on the next pass when the job failed

            log.info("ingesting %d run folder(s) from the watched folders", len(ready))
            self.ingest.submit([path for path, _ in ready], "watch", on_done=finished)
        return [path for path, _ in ready]

    def status(self) -> dict:
        with self._lock:
            return {
                "folders": [str(r) for r in self.roots],
                "idle_s": self.idle_s,
                "run_folders_seen": len(self._seen),
                "waiting": sorted(str(p) for p, s in self._seen.items() if s.handed != s.state and not s.pending),
                "scans": self.scans,
            }
