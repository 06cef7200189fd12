"""Capture sessions: start recording, flush in the background, close cleanly.

At most one session is active per process. While it is, `record()` (and the
switched-on sources) append events to per-thread native buffers; a background
thread drains them about once a second into a new set of Parquet files, so a
process killed with SIGKILL loses at most its last second of events.

A forked child continues into a run of its own (`on_fork="new_run"`). Such
children often end without running atexit handlers: multiprocessing's fork
workers (DataLoader workers among them) leave through `os._exit` after their
own exit routine, and many live for less than a flush interval. So the last
write is hooked into every exit Python lets us see: atexit (normal exit,
SystemExit), multiprocessing's exit finalizers in its children, and
`os._exit` itself. A process killed by a signal (SIGKILL, or SIGTERM without
a handler) or crashing loses at most its last flush interval of events.
"""

from __future__ import annotations

import atexit
import functools
import operator
import os
import shutil
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tbpipe import _native
from tbpipe.capture import ranks
from tbpipe.capture.deferred import DeferredWriter
from tbpipe.capture.errors import SessionError
from tbpipe.capture.manifest import initial_manifest, mark_closed, new_run_id, write_manifest
from tbpipe.capture.sources import COMPILE_AWARE_SOURCES, reset_sources_after_fork_in_child, resolve_sources

DEFAULT_FLUSH_INTERVAL_S = 1.0
# Per thread, between two flushes: past it events are dropped (and counted)
# rather than let a stalled writer grow memory without bound.
DEFAULT_MAX_BUFFERED_EVENTS = 1 << 22
ON_FORK_CHOICES = ("new_run", "stop")
# The stack of an op called inside another op (torch-ops' observer): "own", gathered for it (the
# frames between the two ops included); "outermost", the enclosing op's, reused with no walk while
# no Python code ran in between (an op called from Python inside an op still gets its own). The same
# call sites and nesting, fewer torch-internal frames, up to a third less overhead on small-op steps.
OP_STACKS_CHOICES = ("own", "outermost")
# How long a forked child's session waits for its last write when it closes.
# That write normally holds at most one flush interval of events and takes
# milliseconds; the bound is there because only in a forked child can the
# flush thread be stuck for good (on a lock that another thread of the parent
# held at the fork, inside a library), and a child must never hang on its way
# out. Past it the run stays incomplete with what it had. The original
# process waits as long as its last write takes, as it always has.
FORKED_CLOSE_TIMEOUT_S = 10.0
# Longest wait for the session registry's lock while closing; its holders keep
# it for microseconds, unless the closing thread interrupted one of them (an
# exit from a signal handler) and would otherwise wait for itself.
_ACTIVE_LOCK_TIMEOUT_S = 5.0

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
        op_stacks: str = "own",
    ):
        self.out_dir = Path(out_dir)
        # The labels given win over those read from the launchers' environment (capture/ranks.py).
        self._given_labels = _validate_labels(labels)
        self.labels = dict(self._given_labels)
        # The rank labels a forked child takes from its parent (None: read at start).
        self._rank_labels: dict[str, str] | None = None
        self.source_names = list(sources)
        self._sources = resolve_sources(self.source_names)  # fails early on an unknown name
        if on_fork not in ON_FORK_CHOICES:
            raise SessionError(f"on_fork must be one of {', '.join(ON_FORK_CHOICES)}, not {on_fork!r}")
        if op_stacks not in OP_STACKS_CHOICES:
            raise SessionError(f"op_stacks must be one of {', '.join(OP_STACKS_CHOICES)}, not {op_stacks!r}")
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
        self.op_stacks = op_stacks
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
        self._writer: DeferredWriter | None = None
        # The recorder's counters before the last drain: unchanged, nothing was recorded since, and a
        # session without sources skips the drain (whose arrays would import numpy in an idle process).
        self._counters_drained: dict[str, int] | None = None
        self._source_handles: list[tuple[Any, Any]] = []
        # torch.compile awareness (tbpipe.capture.torch_compile), on with the sources that record
        # from inside compiled code; the number of its code_origins rows this run has written.
        self._follows_compile = any(name in COMPILE_AWARE_SOURCES for name in self.source_names)
        self._origins_written = 0
        self._stop_flusher = threading.Event()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._close_timeout_s: float | None = None  # default of close(); set in forked children
        self._pid: int | None = None  # the process that started the session
        self._git: dict[str, Any] | None = None  # the checkout's state a forked child takes from its parent
        # In a forked child, on the parent's session as the child inherited it:
        # the child's own run, which close() and flush() there act on instead.
        self._continued_by: Session | None = None

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
                "op_stacks": self.op_stacks,
            }
            found = self._rank_labels
            if found is None:
                found = ranks.labels_at_start(self.run_id, self.parent_run_id)
            self.labels = {**found, **self._given_labels}
            manifest = initial_manifest(
                self.run_id, self.labels, self.source_names, settings, self.parent_run_id, self._git
            )
            write_manifest(self.run_dir, manifest)
            self._writer = DeferredWriter(self.run_dir, manifest)
            self._pid = os.getpid()
            _native._set_overhead_limits(self.sample_rate, self.max_events_per_stack_per_s)
            _native._set_nested_op_stacks(self.op_stacks == "outermost")
            _native.start(self.python, self.native, self.max_buffered_events)
            self._counters_drained = _native.counters()
            _active = self
        _close_before_os_exit()
        if "rank" not in self.labels and self.labels.get(ranks.ROLE_KEY) != ranks.LAUNCHER:
            ranks.watch_torch(_process_group_made, _launching_ranks)
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
        self._update_source_status()
        if self._follows_compile:
            try:
                from tbpipe.capture import torch_compile

                compile_status = torch_compile.start().status
            except Exception as error:  # the sources record on; only compiled code goes unexplained
                compile_status = f"not following torch.compile: {type(error).__name__}: {error}"
            self._writer.manifest["torch_compile_status"] = compile_status
        write_manifest(self.run_dir, self._writer.manifest)

    def add_labels(self, labels: Mapping[str, str]) -> None:
        """Labels learnt while recording (a process group's rank), for those keys the run has none of;
        a rank ends a launcher's role. The next flush writes them."""
        merged = dict(self.labels)
        if "rank" in labels and ranks.ROLE_KEY not in self._given_labels:
            merged.pop(ranks.ROLE_KEY, None)
        merged.update({k: str(v) for k, v in labels.items() if k not in merged and v not in (None, "")})
        self.labels = merged
        if self._writer is not None:
            self._writer.manifest["labels"] = dict(merged)  # a new dict: the flush thread may be reading the old

    def _update_source_status(self) -> None:
        """Each source's status line into the manifest; read again at every flush, since a source
        waiting for its package's import says how it records once the import has happened."""
        status = self._writer.manifest.setdefault("source_status", {})
        for source, handle in self._source_handles:
            status[source.name] = str(getattr(handle, "status", "recording"))

    def close(self, timeout: float | None = None) -> None:
        """Stop recording, write what is left and mark the run complete.

        The last write runs on the flush thread; `timeout` bounds the wait for
        it (None: as long as it takes, except in a forked child, where it is
        FORKED_CLOSE_TIMEOUT_S). A run whose last write did not finish in time,
        or failed, stays incomplete and keeps what was written before.
        """
        global _active
        if timeout is None:
            timeout = self._close_timeout_s
        if self._writer is None:
            return
        if self._pid != os.getpid():
            # The parent's session as a forked child inherited it (the child
            # leaves a `with capture.session()` block, say): the parent writes
            # its own run; here, end the child's run instead.
            if self._continued_by is not None:
                self._continued_by.close(timeout)
            return
        if self._closed:
            return
        self._closed = True
        try:
            for source, handle in reversed(self._source_handles):
                source.stop(handle)
            if self._follows_compile:
                from tbpipe.capture import torch_compile

                torch_compile.stop()
        finally:
            _native.stop()
            self._stop_flusher.set()
            flusher = self._flusher
            if flusher is not None and flusher.is_alive() and flusher is not threading.current_thread():
                flusher.join(timeout)  # it makes the last write on its way out (_flush_loop)
                if flusher.is_alive():
                    print(
                        f"tbpipe: {self.run_dir}: the last write did not finish within {timeout:g} s; "
                        "the run stays incomplete",
                        file=sys.stderr,
                    )
            else:
                self._write_last()
            locked = _active_lock.acquire(timeout=_ACTIVE_LOCK_TIMEOUT_S)
            try:
                if _active is self:
                    _active = None
            finally:
                if locked:
                    _active_lock.release()

    def flush(self) -> None:
        """Write everything recorded so far (also done in the background)."""
        if self._writer is None:
            return
        if self._pid != os.getpid():
            if self._continued_by is not None:  # see close()
                self._continued_by.flush()
            return
        before = _native.counters()
        drained = None
        if self._source_handles or before != self._counters_drained:
            drained = _native.drain()
            self._counters_drained = before
        counters = _native.counters()
        overhead = _native._overhead_counters()
        gpu = _native._gpu_activity_drain()  # None unless the cuda source records GPU activity
        totals = self._writer.manifest["counters"]
        totals["events_sampled_out"] = overhead["sampled_out"]
        totals["events_rate_limited"] = overhead["rate_limited"]
        # Stacks reused from an earlier event at the same place, checks of them, and checks that
        # found another stack (Recorder::set_stack_reuse).
        totals["stacks_reused"] = overhead.get("stacks_reused", 0)
        totals["stacks_reuse_checked"] = overhead.get("reuse_checked", 0)
        totals["stacks_reuse_mismatched"] = overhead.get("reuse_mismatched", 0)
        self._update_source_status()
        self._writer.write(drained, counters, gpu, self._compile_parts())

    def _compile_parts(self) -> dict[str, Any]:
        """The code_origins rows found since the last flush, and the generated-code folders."""
        if not self._follows_compile or "tbpipe.capture.torch_compile" not in sys.modules:
            return {}
        from tbpipe.capture import torch_compile
        from tbpipe.schemas.raw import code_origins_schema

        dirs = torch_compile.generated_code_dirs()
        if dirs:
            self._writer.manifest.setdefault("generated_code", {}).update(dirs)
        if torch_compile.notes():
            self._writer.manifest["torch_compile_notes"] = torch_compile.notes()
        rows, self._origins_written = torch_compile.rows_since(self._origins_written)
        if not rows:
            return {}
        from tbpipe.capture.columns import table_from_rows

        return {"code_origins": table_from_rows(rows, code_origins_schema())}

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
        # close() asked for the end. The last write happens here, not on the
        # closing thread, so that a process on its way out only ever waits for
        # it with a bound and never itself blocks inside the writer.
        self._write_last()

    def _write_last(self) -> None:
        try:
            self.flush()
        except Exception as error:  # incomplete: the manifest says why
            self._report_flush_error(error)
            try:
                write_manifest(self.run_dir, self._writer.manifest)
            except OSError:
                pass
            return
        mark_closed(self._writer.manifest)
        write_manifest(self.run_dir, self._writer.manifest)

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
            self._given_labels,
            self.source_names,
            python=self.python,
            native=self.native,
            flush_interval_s=self.flush_interval_s,
            max_buffered_events=self.max_buffered_events,
            on_fork=self.on_fork,
            parent_run_id=self.run_id,
            sample_rate=self.sample_rate,
            max_events_per_stack_per_s=self.max_events_per_stack_per_s,
            op_stacks=self.op_stacks,
        )
        child._close_timeout_s = FORKED_CLOSE_TIMEOUT_S
        # A forked child works for its parent's rank; a launcher's child launches nothing.
        child._rank_labels = {
            k: v for k, v in self.labels.items() if k not in self._given_labels and k != ranks.ROLE_KEY
        }
        child._git = self._writer.manifest.get("git") if self._writer is not None else None
        return child.start()


def session(
    out_dir: str | os.PathLike[str],
    labels: Mapping[str, Any] | None = None,
    sources: Iterable[str] = (),
    **options: Any,
) -> Session:
    """`with tbpipe.capture.session(out_dir, labels={...}, sources=[...]):` records one run."""
    return Session(out_dir, labels, sources, **options)


# The writer held across a fork by `_before_fork` (released on both sides after it).
_held_for_fork: list[DeferredWriter] = []
_FORK_WAIT_S = 5.0


def _before_fork() -> None:
    session = _active
    writer = session._writer if session is not None and not session._closed else None
    if writer is not None and writer.hold_for_fork(_FORK_WAIT_S):
        _held_for_fork.append(writer)


def _after_fork_in_parent() -> None:
    while _held_for_fork:
        _held_for_fork.pop().release_after_fork()


def _after_fork_in_child() -> None:
    # Only the forking thread exists now. The native recorder already stopped
    # itself and dropped the parent's buffers (they belong to the parent's
    # run). Locks a parent thread may have held are remade, never waited on;
    # the writer lock this thread took before the fork is given back.
    _after_fork_in_parent()
    global _active, _active_lock
    parent = _active
    _active = None
    _active_lock = threading.Lock()
    reset_sources_after_fork_in_child()
    compile_module = sys.modules.get("tbpipe.capture.torch_compile")
    if compile_module is not None:
        compile_module._after_fork_in_child()
    if parent is None or parent._closed:
        return
    try:
        child = parent._continue_in_child()
    except Exception as error:  # the child runs on, just unrecorded
        print(f"tbpipe: not recording forked child {os.getpid()}: {error}", file=sys.stderr)
        return
    parent._continued_by = child
    if child is not None:
        _close_at_multiprocessing_exit(child)


def _process_group_made(c10d: Any) -> None:
    """torch.distributed's default group exists: the active session's rank labels from it."""
    session = _active
    if session is not None and not session._closed:
        session.add_labels(ranks.labels_from_process_group(c10d, os.environ, session.parent_run_id))


def _launching_ranks(nprocs: int) -> str | None:
    """torch.multiprocessing starts `nprocs` processes: unless this one is a rank itself, it is their
    launcher; returns the job id they are to share."""
    session = _active
    if session is None or session._closed or "rank" in session.labels:
        return None
    session.add_labels({ranks.ROLE_KEY: ranks.LAUNCHER, "job": os.environ.get(ranks.ENV_JOB) or session.run_id})
    return session.labels.get("job")


def _close_at_exit() -> None:
    session = _active
    if session is not None:
        session.close()


def _close_at_multiprocessing_exit(child: Session) -> None:
    """In a forked child: if it turns out to be a multiprocessing process, close at its exit.

    multiprocessing's fork children (Pool workers, DataLoader workers) run its
    exit routine (`multiprocessing.util._exit_function`: the registered
    Finalize callbacks) and then leave through `os._exit`, skipping atexit.
    A Finalize registered now would be dropped: the child clears the registry
    right after fork, then calls the after-fork callbacks, so the finalizer is
    registered from one of those.
    """
    util = sys.modules.get("multiprocessing.util")  # imported by multiprocessing before it forks
    if util is None:
        return
    try:
        util.register_after_fork(child, _register_multiprocessing_finalizer)
    except Exception:
        pass  # the os._exit hook still closes the run


def _register_multiprocessing_finalizer(_session: Session) -> None:
    util = sys.modules["multiprocessing.util"]
    # Priority 0 runs in the first pass of the exit routine; the callback closes
    # whichever session is active then, so registering it twice is harmless.
    util.Finalize(None, _close_at_exit, exitpriority=0)


def _close_before_os_exit() -> None:
    """Wraps os._exit so that the active session is closed first.

    os._exit skips atexit and every other exit hook, and Python offers no
    hook of its own for it; yet it is how forked children end: multiprocessing's
    workers after their exit routine, plain `os.fork()` children by convention,
    and programs that want to skip a slow teardown. Installed when a session
    starts, unless os._exit already is this wrapper (a forked child inherits
    it); with no active session it only forwards the call.
    """
    current = os._exit
    if getattr(current, "_tbpipe_closes_session", False):
        return

    # Named and documented as os._exit, but its module stays ours: whoever inspects it sees who wrapped it.
    @functools.wraps(current, assigned=("__name__", "__qualname__", "__doc__"))
    def _exit(status: int) -> None:
        try:
            operator.index(status)  # an invalid status raises below, leaving the session running
            _close_at_exit()
        except BaseException:  # the process is leaving; nothing of ours may stop it
            pass
        current(status)

    _exit._tbpipe_closes_session = True  # type: ignore[attr-defined]
    os._exit = _exit


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
atexit.register(_close_at_exit)
