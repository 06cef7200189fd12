"""The ingest's knobs, in one place: how much goes in a batch and a transaction, how many threads
read ahead and at which priority, DuckDB's threads and checkpoints, and transparent huge pages.

None of these changes what is stored; each trades memory, latency or CPU for wall time, and
docs/performance.md says what each was measured to buy.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import duckdb

from tbpipe.pipeline.db.connection import query_value


@dataclass(frozen=True)
class IngestLimits:
    """How the ingest cuts its work. Tests pass smaller ones to reach the cases big inputs reach."""

    # A batch (runs laid out together) closes at this many events or runs; a run past the first
    # limit goes alone.
    batch_events: int = 2_000_000
    batch_runs: int = 64
    # Consecutive runs share a transaction up to this many rows (events and GPU activity records;
    # a run past it goes alone). A transaction's fixed costs (its commit, run rows, each statement's
    # planning) are worth more than loading a small run's events; a kill loses the two transactions
    # under way, which the next ingest loads again.
    rows_per_transaction: int = 250_000
    # Threads reading runs ahead of the loading: a thread per core, up to 4.
    read_threads: int = max(1, min(4, os.cpu_count() or 1))
    # A transaction of fewer events runs DuckDB on one thread: handing a few thousand rows between
    # threads costs more than it saves, while the other cores read the next runs.
    one_thread_below_events: int = 100_000


# The reading threads' nice value above the loading thread's (Linux, where a thread has its own):
# the loading thread is the critical path, and a reading thread that competes with it for a core
# delays every run after it.
READ_NICE = 10


def lower_thread_priority(by: int = READ_NICE) -> None:
    """Raises the calling thread's nice value by `by` (Linux only: elsewhere the call would set a
    whole process's, or fail)."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError:  # a sandbox that forbids it: the ingest runs as before
        pass


class DuckdbThreads:
    """DuckDB's thread count for the ingest's connection: one for batches of small transactions,
    the default for big ones, and the default again for the closing checkpoint."""

    def __init__(self, con: Any):
        self._con = con
        self.default = self._current = int(query_value(con, "SELECT current_setting('threads')"))

    def use(self, threads: int) -> None:
        if threads != self._current:
            self._con.execute(f"SET threads = {int(threads)}")
            self._current = threads

    def reset(self) -> None:
        self.use(self.default)


def checkpoint_at_close(con: Any) -> bool:
    """The ingest's checkpoint settings for this connection's database: one checkpoint, when the
    database closes, without merging row groups. Returns False where the DuckDB version cannot turn
    the merging off.

    Checkpointing after every commit would rewrite the growing tables once per batch; the WAL holds
    the committed batches until the close. That checkpoint would also merge row groups: each run's
    events end in a partial row group, and DuckDB's vacuum rewrites runs of them into fewer full
    ones, leaving the blocks they were in free in the file; without the merge they stay as they are."""
    con.execute("SET checkpoint_threshold = '4GB'")
    try:
        con.execute("SET max_vacuum_tasks = 0")
    except duckdb.Error:
        return False
    return True


@contextmanager
def without_huge_pages() -> Iterator[None]:
    """The process without transparent huge pages while the ingest runs (as before after it). The
    ingest makes and drops buffers of megabytes one after another (numpy's arrays, Arrow's pool,
    DuckDB's copies); backed by huge pages, each fresh 2 MB page is zeroed by the kernel on first
    touch. Linux's prctl covers the whole process; numpy's own switch is turned off too, for
    systems without the prctl."""
    import numpy as np  # entered by the stages that read runs, which import it anyway

    restore = [_thp_disabled(True)]
    try:
        setting = np._core.multiarray._set_madvise_hugepage
    except AttributeError:  # a numpy without the switch (before 2.0 it lived elsewhere)
        setting = None
    if setting is not None:
        before = setting(False)
        restore.append(lambda: setting(before))
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _thp_disabled(disabled: bool) -> Callable[[], None]:
    """Sets Linux's PR_SET_THP_DISABLE for the process; returns what sets it back as it was (a
    no-op where there is no such prctl)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    get_thp_disable, set_thp_disable = 42, 41  # <linux/prctl.h>
    before = prctl(get_thp_disable, 0, 0, 0, 0)
    if before < 0 or prctl(set_thp_disable, int(disabled), 0, 0, 0) < 0:
        return lambda: None
    return lambda: prctl(set_thp_disable, before, 0, 0, 0)
