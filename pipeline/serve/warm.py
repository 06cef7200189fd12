"""Reading ahead after each ingest: the service's first pages should not wait for what every one of
them needs (`queries.warm`: run numbers, the site directory, event counts, the newest runs' leading
sites). A thread watches the database's state and warms each new one once, on a cursor of its own,
while requests go on; a request that comes first computes the same facts itself."""

from __future__ import annotations

import logging
import time

from tbpipe.pipeline.serve import queries
from tbpipe.pipeline.serve.background import PollingThread
from tbpipe.pipeline.serve.database import ServedDatabase

log = logging.getLogger("tbpipe.serve.warm")


class Warmer(PollingThread):
    name = "tbpipe-warm"
    failure = "reading ahead failed"
    log = log

    def __init__(self, database: ServedDatabase, poll_s: float = 0.5):
        super().__init__(poll_s)
        self.database = database
        self.warmed: tuple | None = None  # the last state warmed

    def step(self) -> None:
        if self.database.state_key() in (None, self.warmed):
            return
        started = time.perf_counter()
        with self.database.read() as cursor:
            # Asked again under the read lock: an ingest may have ended between, and the facts must
            # be kept under the state whose data they are read from.
            state = self.database.state_key()
            if state in (None, self.warmed):
                return
            self.warmed = state  # once per state: a failure (the database closing) waits for the next one
            runs = queries.warm(cursor, state)
        log.info("read ahead for %d run(s) in %.0f ms", runs, (time.perf_counter() - started) * 1000)
