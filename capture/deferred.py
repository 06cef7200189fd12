"""The run's writer, made when the first part is written.

`tbpipe run` starts a session in every Python process of a program, most of which (a test suite's
workers, a data pipeline's helpers) record little or nothing. The writer's libraries (pyarrow,
numpy, the schemas) take most of a session's start, so a session holds this stand-in: it keeps
the manifest, rewrites it while nothing was recorded, and loads `writer.RunWriter` only for the
first flush that has rows to write.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tbpipe.capture.manifest import note_counters, write_manifest


def nothing_to_write(drained: dict[str, Any] | None, gpu: dict[str, Any] | None, extra: dict[str, Any] | None) -> bool:
    """True when a flush brings no rows: no events, no stacks, no GPU activity, no other part."""
    if gpu is not None or extra:
        return False
    return drained is None or (len(drained["ts_ns"]) == 0 and len(drained["stack_ids"]) == 0)


class DeferredWriter:
    """`writer.RunWriter`'s interface (write, hold_for_fork, release_after_fork, manifest); the real
    writer is made on the first write that has rows."""

    def __init__(self, run_dir: Path, manifest: dict[str, Any]):
        self.run_dir = run_dir
        self.manifest = manifest
        self._writer: Any = None
        # One write at a time, and none across a fork (see RunWriter.hold_for_fork): the first real
        # write imports the writer's libraries under it.
        self._lock = threading.Lock()
        self._manifest_written: str | None = None

    @property
    def loaded(self) -> bool:
        """Whether the real writer (and its libraries) was needed yet."""
        return self._writer is not None

    def hold_for_fork(self, timeout_s: float) -> bool:
        return self._lock.acquire(timeout=timeout_s)

    def release_after_fork(self) -> None:
        self._lock.release()

    def write(
        self,
        drained: dict[str, Any] | None,
        counters: dict[str, int],
        gpu: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """One flush (`RunWriter.write`); `drained` None: the recorder had nothing (it was not drained)."""
        with self._lock:
            if self._writer is None and not nothing_to_write(drained, gpu, extra):
                from tbpipe.capture.writer import RunWriter

                self._writer = RunWriter(self.run_dir, self.manifest)
            if self._writer is not None and drained is not None:
                self._writer.write(drained, counters, gpu, extra)
                return
            note_counters(self.manifest, counters)
            self._manifest_written = write_manifest(self.run_dir, self.manifest, self._manifest_written)
