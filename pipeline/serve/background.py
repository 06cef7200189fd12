"""A thread of the service that does one step every `poll_s` seconds until the service stops
(the watcher's scans, the warmer's read-ahead); a step that fails is logged and the next one runs."""

from __future__ import annotations

import logging
import threading


class PollingThread:
    name = "tbpipe-background"
    failure = "a background step failed"  # what the log says when a step raises
    log = logging.getLogger("tbpipe.serve")

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:
                self.log.exception(self.failure)
            self._stop.wait(self.poll_s)
