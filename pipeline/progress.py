"""Progress bars on stderr (rich), for the long steps of the pipeline.

- `DelayedProgress`: named tasks that show only once work has lasted about a second, so short
  symbolizations (the common, warm case) print nothing and a cold libtorch shows what it does.
- `RunProgress`: one bar over the runs of an ingest, with what the current run is doing.

Both are off when stderr is not a terminal, unless forced on.
"""

from __future__ import annotations

import sys
import time
from typing import Any

_SHOW_AFTER_S = 1.0


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
        self._enabled = sys.stderr.isatty() if enabled is None else enabled
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
        self.enabled = (sys.stderr.isatty() if enabled is None else enabled) and total > 0
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
