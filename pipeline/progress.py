"""Progress bars on stderr (rich), for the long steps of the pipeline.

- `DelayedProgress`: named tasks that show only once work has lasted about a second, so short
  symbolizations (the common, warm case) print nothing and a cold libtorch shows what it does.
- `RunProgress`: one bar over the runs of an ingest, with what the current run is doing.
- `DownloadProgress`: bytes of debug files downloaded at once from debuginfod servers.
- `StepProgress`: one bar over a long command's work (an export's events, a report's steps, a lake
  export's tables) with what it does now.

All are off when stderr is not a terminal or under CI (`on_terminal`), unless forced on or off.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_SHOW_AFTER_S = 1.0


def on_terminal(enabled: bool | None = None) -> bool:
    """Whether to draw a bar: as asked (True/False), else when stderr is a terminal and no CI job
    (`CI` set, as CI services do) would keep its redraws in a log."""
    if enabled is not None:
        return enabled
    return sys.stderr.isatty() and not os.environ.get("CI")


def _started_bar(title: str, detail: str | None) -> Any:
    """A transient rich Progress on stderr: title, bar, done/total, optional detail, elapsed time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn(title), BarColumn(), MofNCompleteColumn()]
    if detail is not None:
        columns.append(TextColumn(detail))
    bar = Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    bar.start()
    return bar


class DelayedProgress:
    def __init__(self, enabled: bool | None = None, show_after: float = _SHOW_AFTER_S):
        self._enabled = on_terminal(enabled)
        self._show_after = show_after
        self._started = time.monotonic()
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._totals: dict[str, list[float]] = {}  # name -> [completed, total]

    def add(self, name: str, total: float) -> None:
        done_total = self._totals.setdefault(name, [0.0, 0.0])
        done_total[1] += total
        if self._progress is not None:
            self._sync(name)
        else:
            self.poll()

    def advance(self, name: str, amount: float = 1.0) -> None:
        self._totals.setdefault(name, [0.0, 0.0])[0] += amount
        if self._progress is not None:
            self._sync(name)
        else:
            self.poll()

    def poll(self) -> None:
        """Call now and then: shows the bar once the work has lasted long enough."""
        if self._progress is None and self._enabled and time.monotonic() - self._started >= self._show_after:
            self._progress = _started_bar("[bold]{task.description}", None)
            for name in self._totals:
                self._sync(name)

    def _sync(self, name: str) -> None:
        completed, total = self._totals[name]
        task = self._tasks.get(name)
        if task is None:
            task = self._tasks[name] = self._progress.add_task(name, total=total)
        self._progress.update(task, completed=completed, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> DelayedProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunProgress:
    """A bar over an ingest's runs: how many are done, events so far, what the current run is doing."""

    def __init__(self, enabled: bool | None, total: int):
        self.enabled = on_terminal(enabled) and total > 0
        self.total = total
        self._progress: Any = None
        self._task: Any = None
        self._events = 0

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._progress = _started_bar(
                "[bold]ingest[/]", "runs · {task.fields[events]} events · {task.fields[doing]}"
            )
            self._task = self._progress.add_task("ingest", total=self.total, events="0", doing="")
        return self

    def start(self, run_dir: Any) -> None:
        self.describe(f"reading {run_dir.name}")

    def describe(self, doing: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, doing=doing)

    def finish(self, events: int) -> None:
        self._events += events
        if self._progress is not None:
            self._progress.update(self._task, advance=1, events=f"{self._events:,}", doing="")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


class StepProgress:
    """A bar over one command's work, `total` units of it (events, steps, tables), with what it does
    now. Disabled, every method does nothing: a library function takes one whether or not it draws."""

    def __init__(self, title: str, total: float = 0, enabled: bool | None = False):
        self.enabled = on_terminal(enabled)
        self.title = title
        self.total = total
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> StepProgress:
        if self.enabled:
            self._progress = _started_bar(f"[bold]{self.title}[/]", "{task.fields[doing]}")
            self._task = self._progress.add_task(self.title, total=self.total or None, doing="")
        return self

    def describe(self, doing: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, doing=doing)

    def step(self, doing: str) -> None:
        """One unit done, and what the next is."""
        if self._progress is not None:
            self._progress.update(self._task, advance=1, doing=doing)

    def advance(self, amount: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=amount)

    def set_total(self, total: float) -> None:
        self.total = total
        if self._progress is not None:
            self._progress.update(self._task, total=total or None)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def size_text(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


class DownloadProgress:
    """Bytes of several files downloaded at once: on a terminal a bar with sizes and speed (once the
    transfers have lasted about a second), or a line of text handed to `describe` (the ingest's own
    bar shows it). Transfers run on a pool of threads: every method takes a lock."""

    def __init__(
        self,
        enabled: bool | None = None,
        describe: Callable[[str], None] | None = None,
        show_after: float = _SHOW_AFTER_S,
    ):
        self._enabled = on_terminal(enabled) and describe is None
        self._describe = describe
        self._show_after = show_after
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._files = self._files_done = 0
        self._total = self._done = 0
        self._said_at = 0.0

    def start_file(self, expected: int | None) -> None:
        with self._lock:
            self._files += 1
            self._total += expected or 0
            self._show()

    def advance(self, amount: int) -> None:
        with self._lock:
            self._done += amount
            self._show()

    def finish_file(self, expected: int | None, received: int) -> None:
        """A transfer ended (complete or not): its share of the total becomes what came."""
        with self._lock:
            self._files_done += 1
            self._total += received - (expected or 0)
            self._show(force=True)

    def text(self) -> str:
        total = max(self._total, self._done)
        return (
            f"downloading debug info: {self._files_done} of {self._files} files, "
            f"{size_text(self._done)} of {size_text(total)}"
        )

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._describe is not None:
            if force or now - self._said_at >= 0.2:
                self._said_at = now
                self._describe(self.text())
            return
        if self._progress is None:
            if not self._enabled or now - self._started < self._show_after:
                return
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]downloading debug info"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[files]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("download", total=None, files="")
        self._progress.update(
            self._task,
            completed=self._done,
            total=max(self._total, self._done) or None,
            files=f"{self._files_done}/{self._files} files",
        )

    def close(self) -> None:
        with self._lock:
            if self._describe is not None and self._files:
                self._describe("")
            if self._progress is not None:
                self._progress.stop()
                self._progress = None

    def __enter__(self) -> DownloadProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
