"""A rich progress bar that only appears once work has lasted about a second.

Short symbolizations (the common, warm case) print nothing; long ones (a cold libtorch, a big
ingest) show what they are doing on stderr. Off when stderr is not a terminal unless forced.
"""

from __future__ import annotations

import sys
import time
from typing import Any

_SHOW_AFTER_S = 1.0


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
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
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
