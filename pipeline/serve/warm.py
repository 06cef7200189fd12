"""Reading ahead after each ingest: the service's first pages should not wait for what every one of
them needs (`queries.warm`: run numbers, the site directory, event counts, the newest runs' leading
sites). A thread watches the database's state and warms each new one once, on a cursor of its own,
while requests go on; a request that comes first computes the same facts itself."""

from __future__ import annotations

import logging
import threading
import time

from tbpipe.pipeline.serve import queries
from tbpipe.pipeline.serve.database import ServedDatabase

log = logging.getLogger("tbpipe.serve.warm")


class Warmer:
    def __init__(self, database: ServedDatabase, poll_s: float = 0.5):
        self.database = database
        self.poll_s = poll_s
        self.warmed: tuple | None = None  # the last state warmed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tbpipe-warm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            state = self.database.state_key()
            if state is not None and state != self.warmed:
                try:
                    started = time.perf_counter()
                    with self.database.read() as cursor:
                        runs = queries.warm(cursor, state)
                    log.info("read ahead for %d run(s) in %.0f ms", runs, (time.perf_counter() - started) * 1000)
                except Exception as error:  # a closing or reopening database: tried again with the next state
                    log.warning("reading ahead failed: %s", error)
                self.warmed = state
            self._stop.wait(self.poll_s)
