"""The ingest service: one thread that loads runs into the database, the only writer while the service runs.

Jobs come from the watcher (run folders that appeared or changed under `--watch` folders), from
uploads (`POST /api/runs`) and from the retention schedule (`tbpipe serve --retain-*`: a task run in
the writer's turn like an ingest, `retain.Retainer`). Each ingest job is one `ingest_runs` call, exactly what `tbpipe ingest` does
(validation, quarantine, each run whole or not at all), inside `ServedDatabase.writing()`. Jobs are
kept (the last `KEEP_JOBS`) so that `GET /api/ingest/jobs/{id}` can say what came of each run.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tbpipe.pipeline.db.ingest import IngestOptions, RunOutcome, ingest_runs
from tbpipe.pipeline.errors import TbpipeError
from tbpipe.pipeline.serve.database import ServedDatabase

log = logging.getLogger("tbpipe.serve.ingest")

KEEP_JOBS = 500
QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class IngestJob:
    job_id: str
    source: str  # 'watch', 'upload' or 'retain'
    paths: list[Path]
    status: str = QUEUED
    queued_at: str = field(default_factory=_now)
    finished_at: str | None = None
    outcomes: list[RunOutcome] = field(default_factory=list)
    error: str | None = None
    on_done: Callable[[IngestJob], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    task: Callable[[], str] | None = None  # run instead of an ingest (the database writable): its summary
    summary: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "source": self.source,
            "status": self.status,
            "queued_at": self.queued_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "summary": self.summary,
            "runs": [
                {
                    "path": str(o.path),
                    "status": o.status,
                    "run_id": o.run_id,
                    "complete": o.complete,
                    "events": o.events,
                    "new_stacks": o.new_stacks,
                    "reason": o.reason,
                    "notes": o.notes,
                }
                for o in self.outcomes
            ],
        }


class IngestService:
    def __init__(self, database: ServedDatabase, options: IngestOptions):
        self.database = database
        self.options = options
        self._queue: queue.Queue[IngestJob | None] = queue.Queue()
        self._jobs: OrderedDict[str, IngestJob] = OrderedDict()
        self._jobs_lock = threading.Lock()
        self._counter = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.running: IngestJob | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tbpipe-ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def submit(
        self, paths: Sequence[Path], source: str, on_done: Callable[[IngestJob], None] | None = None
    ) -> IngestJob:
        return self._queued(
            IngestJob(f"{int(time.time())}-{next(self._counter)}", source, list(paths), on_done=on_done)
        )

    def _queued(self, job: IngestJob) -> IngestJob:
        with self._jobs_lock:
            self._jobs[job.job_id] = job
            while len(self._jobs) > KEEP_JOBS:
                self._jobs.popitem(last=False)
        self._queue.put(job)
        return job

    def submit_task(self, task: Callable[[], str], source: str) -> IngestJob:
        """`task` run in the writer's turn, the database writable (a retain); its line is the job's summary."""
        return self._queued(IngestJob(f"{int(time.time())}-{next(self._counter)}", source, [], task=task))

    def job(self, job_id: str) -> IngestJob | None:
        with self._jobs_lock:
            return self._jobs.get(job_id)

    def jobs(self, limit: int = 50) -> list[IngestJob]:
        with self._jobs_lock:
            return list(self._jobs.values())[-limit:][::-1]

    def queued(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.running = job
            job.status = RUNNING
            try:
                with self.database.writing():
                    if job.task is not None:
                        job.summary = job.task()
                    else:
                        summary = ingest_runs(job.paths, self.options, on_message=lambda text: log.info("%s", text))
                        job.outcomes = summary.outcomes
                job.status = DONE
                if job.summary:
                    log.info("%s: %s", job.source, job.summary)
                for outcome in job.outcomes:
                    if outcome.status == "quarantined":
                        log.warning("quarantined %s: %s", outcome.path, outcome.reason)
                    elif outcome.status != "present":
                        log.info(
                            "%s %s (%s, %d events)", outcome.status, outcome.run_id,
                            "complete" if outcome.complete else "incomplete", outcome.events,
                        )  # fmt: skip
            except TbpipeError as error:
                job.status, job.error = FAILED, str(error)
                log.error("ingest of %s failed: %s", ", ".join(map(str, job.paths)), error)
            except Exception as error:  # a bug: keep serving, say what happened
                job.status, job.error = FAILED, f"internal error: {type(error).__name__}: {error}"
                log.exception("ingest of %s failed", ", ".join(map(str, job.paths)))
            finally:
                job.finished_at = _now()
                self.running = None
                job.done.set()
                if job.on_done is not None:
                    try:
                        job.on_done(job)
                    except Exception:
                        log.exception("after ingest job %s", job.job_id)
