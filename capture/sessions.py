"""Capture sessions: start recording, flush in the background, close cleanly.

At most one session is active per process. While it is, `record()` (and the
switched-on sources) append events to per-thread native buffers; a background
thread drains them about once a second into a new set of Parquet files, so a
process killed with SIGKILL loses at most its last second of events.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tbpipe import _native
from tbpipe.capture.errors import SessionError
from tbpipe.capture.manifest import initial_manifest, mark_closed, new_run_id, write_manifest
from tbpipe.capture.sources import resolve_sources
from tbpipe.capture.writer import RunWriter

DEFAULT_FLUSH_INTERVAL_S = 1.0
# Per thread, between two flushes: past it events are dropped (and counted)
# rather than let a stalled writer grow memory without bound.
DEFAULT_MAX_BUFFERED_EVENTS = 1 << 22
ON_FORK_CHOICES = ("new_run", "stop")

_active: Session | None = None
_active_lock = threading.Lock()


def active_session() -> Session | None:
    return _active


def _validate_labels(labels: Mapping[str, Any] | None) -> dict[str, str]:
    checked: dict[str, str] = {}
    for key, value in (labels or {}).items():
        if not isinstance(key, str) or not key or "=" in key:
            raise SessionError(f"label key {key!r} must be a non-empty string without '='")
        checked[key] = str(value)
    return checked


def ensure_out_dir(out_dir: Path) -> Path:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SessionError(f"cannot create output folder {out_dir}: {error.strerror or error}") from None
    if not out_dir.is_dir():
        raise SessionError(f"output path {out_dir} is not a folder")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise SessionError(f"output folder {out_dir} is not writable")
    return out_dir


class Session:
    """One run: `with Session(out_dir, labels={...}): ...` records into `out_dir/<run_id>/`."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        labels: Mapping[str, Any] | None = None,
        sources: Iterable[str] = (),
        *,
        python: bool = True,
        native: bool = True,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS,
        on_fork: str = "new_run",
        parent_run_id: str | None = None,
        sample_rate: float = 1.0,
        max_events_per_stack_per_s: int = 0,
    ):
        self.out_dir = Path(out_dir)
        self.labels = _validate_labels(labels)
        self.source_names = list(sources)
        self._sources = resolve_sources(self.source_names)  # fails early on an unknown name
        if on_fork not in ON_FORK_CHOICES:
            raise SessionError(f"on_fork must be one of {', '.join(ON_FORK_CHOICES)}, not {on_fork!r}")
        if not flush_interval_s > 0:
            raise SessionError(f"flush interval must be positive, not {flush_interval_s!r}")
        # Overhead control: a sampled event costs nothing past a random draw;
        # the per-stack limit keeps at most N events per second of any one stack.
        if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
            raise SessionError(f"sample rate must be in (0, 1], not {sample_rate!r}")
        if not (isinstance(max_events_per_stack_per_s, int) and 0 <= max_events_per_stack_per_s < 2**32):
            raise SessionError(
                f"max events per stack per second must be a non-negative integer (0 = no limit), "
                f"not {max_events_per_stack_per_s!r}"
            )
        self.sample_rate = float(sample_rate)
        self.max_events_per_stack_per_s = max_events_per_stack_per_s
        self.python = python
        self.native = native
        self.flush_interval_s = flush_interval_s
        if not (isinstance(max_buffered_events, int) and max_buffered_events > 0):
            raise SessionError(f"max_buffered_events must be a positive integer, not {max_buffered_events!r}")
        self.max_buffered_events = max_buffered_events
        self.on_fork = on_fork
        self.parent_run_id = parent_run_id
        self.run_id: str | None = None
        self.run_dir: Path | None = None
        self._writer: RunWriter | None = None
        self._source_handles: list[tuple[Any, Any]] = []
        self._stop_flusher = threading.Event()
        self._flusher: threading.Thread | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------

    def start(self) -> Session:
        global _active
        with _active_lock:
            if _active is not None:
                raise SessionError(
                    f"a tbpipe session is already active in this process (run {_active.run_id}); sessions do not nest"
                )
            out_dir = ensure_out_dir(self.out_dir)
            self.run_id = new_run_id()
            self.run_dir = out_dir / self.run_id
            try:
                self.run_dir.mkdir()
            except OSError as error:
                raise SessionError(f"cannot create run folder {self.run_dir}: {error.strerror or error}") from None
            settings = {
                "python": self.python,
                "native": self.native,
                "flush_interval_s": self.flush_interval_s,
                "max_buffered_events": self.max_buffered_events,
                "on_fork": self.on_fork,
                "sample_rate": self.sample_rate,
                "max_events_per_stack_per_s": self.max_events_per_stack_per_s,
            }
            manifest = initial_manifest(self.run_id, self.labels, self.source_names, settings, self.parent_run_id)
            write_manifest(self.run_dir, manifest)
            self._writer = RunWriter(self.run_dir, manifest)
            _native._set_overhead_limits(self.sample_rate, self.max_events_per_stack_per_s)
            _native.start(self.python, self.native, self.max_buffered_events)
            _active = self
        self._start_sources()
        self._flusher = threading.Thread(target=self._flush_loop, name="tbpipe-flush", daemon=True)
        self._flusher.start()
        return self

    def _start_sources(self) -> None:
        """Starts every source; if one cannot start, undoes the whole session start and re-raises."""
        global _active
        try:
            for source in self._sources:
                self._source_handles.append((source, source.start()))
        except BaseException:
            for source, handle in reversed(self._source_handles):
                try:
                    source.stop(handle)
                except Exception:
                    pass
            self._source_handles.clear()
            self._closed = True
            _native.stop()
            with _active_lock:
                if _active is self:
                    _active = None
            shutil.rmtree(self.run_dir, ignore_errors=True)  # ours, just made, nothing recorded in it
            raise
        # A source that runs but records nothing (no GPU, no CUPTI) says why in one line.
        status = self._writer.manifest.setdefault("source_status", {})
        for source, handle in self._source_handles:
            status[source.name] = str(getattr(handle, "status", "recording"))
        write_manifest(self.run_dir, self._writer.manifest)

    def close(self) -> None:
        """Stop recording, write what is left and mark the run complete."""
        global _active
        if self._closed or self._writer is None:
            return
        self._closed = True
        for source, handle in reversed(self._source_handles):
            source.stop(handle)
        _native.stop()
        self._stop_flusher.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()
        self.flush()
        mark_closed(self._writer.manifest)
        write_manifest(self.run_dir, self._writer.manifest)
        with _active_lock:
            if _active is self:
                _active = None

    def flush(self) -> None:
        """Write everything recorded so far (also done in the background)."""
        if self._writer is None:
            return
        drained = _native.drain()
        counters = _native.counters()
        overhead = _native._overhead_counters()
        totals = self._writer.manifest["counters"]
        totals["events_sampled_out"] = overhead["sampled_out"]
        totals["events_rate_limited"] = overhead["rate_limited"]
        self._writer.write(drained, counters)

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _flush_loop(self) -> None:
        while not self._stop_flusher.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception as error:  # keep recording; the manifest says what went wrong
                self._report_flush_error(error)

    def _report_flush_error(self, error: Exception) -> None:
        message = f"flush failed: {type(error).__name__}: {error}"
        errors = self._writer.manifest["errors"] if self._writer else []
        if message not in errors:
            errors.append(message)
            print(f"tbpipe: {self.run_dir}: {message}", file=sys.stderr)

    # -- fork ------------------------------------------------------------

    def _continue_in_child(self) -> Session | None:
        """After fork, in the child: start the child's own run, or stop recording."""
        if self.on_fork != "new_run":
            return None
        child = Session(
            self.out_dir,
            self.labels,
            self.source_names,
            python=self.python,
            native=self.native,
            flush_interval_s=self.flush_interval_s,
            max_buffered_events=self.max_buffered_events,
            on_fork=self.on_fork,
            parent_run_id=self.run_id,
            sample_rate=self.sample_rate,
            max_events_per_stack_per_s=self.max_events_per_stack_per_s,
        )
        return child.start()


def session(
    out_dir: str | os.PathLike[str],
    labels: Mapping[str, Any] | None = None,
    sources: Iterable[str] = (),
    **options: Any,
) -> Session:
    """`with tbpipe.capture.session(out_dir, labels={...}, sources=[...]):` records one run."""
    return Session(out_dir, labels, sources, **options)


def _after_fork_in_child() -> None:
    # The native recorder already stopped itself and dropped the parent's
    # buffers (they belong to the parent's run). Locks a parent thread may have
    # held are remade, never waited on.
    global _active, _active_lock
    parent = _active
    _active = None
    _active_lock = threading.Lock()
    if parent is None or parent._closed:
        return
    try:
        parent._continue_in_child()
    except Exception as error:  # the child runs on, just unrecorded
        print(f"tbpipe: not recording forked child {os.getpid()}: {error}", file=sys.stderr)


def _close_at_exit() -> None:
    if _active is not None:
        _active.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_at_exit)
