"""The served database: one DuckDB instance at a time, shared by every request, written only by the service.

DuckDB lets one process write a file, and its settings are per instance, not per connection. The
service therefore keeps the file in one of two modes:

- **locked** (the usual one): the file opened read-only with `enable_external_access = false` and
  then `lock_configuration = true`. Every request reads on a cursor of that one connection, the
  SQL sandbox included: no statement on it can write the database, read or write any other file,
  install or load an extension, or change a setting. Other processes may read the file meanwhile
  (`tbpipe query`, `tbpipe report`).
- **writing** (while the ingest service loads runs): the file opened read-write as `tbpipe ingest`
  opens it, and `ingest_runs` adds its own connection to that same instance. The service's fixed
  reads go on, on cursors of it, and see each run once its transaction commits; the SQL sandbox
  waits for the locked mode to come back (`sandbox()`), because this instance can reach files.

Switching closes one instance and opens the other; readers hold a shared lock while they use a
cursor and a switch takes it exclusively, so no cursor outlives its instance. The ingest lock
(`<db>.lock`) is held for the service's whole life, naming it, so a `tbpipe ingest` from outside
waits with a message saying who holds the database instead of meeting DuckDB's file lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tbpipe.pipeline.db.connection import DatabaseError, ingest_lock, open_database

log = logging.getLogger("tbpipe.serve")

LOCKED, WRITING, CLOSED = "locked", "writing", "closed"


class DatabaseUnavailable(DatabaseError):
    """The database cannot serve this request now (an ingest is switching it, or it could not be reopened)."""

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _SharedExclusive:
    """Many readers or one switcher; a waiting switcher goes first, so readers cannot starve it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def wait_for(self, predicate, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout_s)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


def open_locked(path: Path) -> Any:
    """The file read-only, unable to reach any other file or change its configuration."""
    con = open_database(path, read_only=True)
    try:
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


class ServedDatabase:
    def __init__(self, path: Path, holder: str, open_wait_s: float = 10.0):
        self.path = Path(path)
        self.holder = holder
        self.open_wait_s = open_wait_s
        self.mode = CLOSED
        self.generation = 0  # bumped whenever the data may have changed (after every writing block)
        self._con: Any = None
        self._lock = _SharedExclusive()
        self._stack = contextlib.ExitStack()
        self._problem: str | None = None

    # ------------------------------------------------------------------ life

    def open(self) -> None:
        """Takes the ingest lock for the service's life, brings the schema up to date, opens it locked."""
        self._stack.enter_context(
            ingest_lock(self.path, self.open_wait_s, on_wait=lambda text: log.warning(text), holder=self.holder)
        )
        try:
            # A read-write open creates the file or applies missing migrations, as an ingest would.
            open_database(self.path, wait_s=self.open_wait_s, on_wait=lambda text: log.warning(text)).close()
            self._con = open_locked(self.path)
        except BaseException:
            self._stack.close()
            raise
        self.mode = LOCKED

    def close(self) -> None:
        with self._lock.exclusive():
            self._close_current()
            self.mode = CLOSED
        self._stack.close()

    def _close_current(self) -> None:
        if self._con is not None:
            con, self._con = self._con, None
            con.close()

    def _reopen_locked(self) -> None:
        try:
            self._con = open_locked(self.path)
            self.mode = LOCKED
            self._problem = None
        except DatabaseError as error:
            self.mode = CLOSED
            self._problem = str(error)
            log.error("cannot reopen the database: %s", error)

    def state_key(self) -> tuple | None:
        """What identifies the data readers see now, for results kept between requests: None while
        an ingest writes (each of its commits changes the data)."""
        return (str(self.path), self.generation) if self.mode == LOCKED else None

    # ------------------------------------------------------------------ readers

    @contextlib.contextmanager
    def read(self) -> Iterator[Any]:
        """A cursor for the service's own (parameterised) reads, in either mode."""
        self._ensure_open()
        with self._lock.shared():
            if self._con is None:
                raise DatabaseUnavailable(f"the database is not open: {self._problem or 'the service is stopping'}")
            cursor = self._con.cursor()
            try:
                yield cursor
            finally:
                cursor.close()

    @contextlib.contextmanager
    def sandbox(self, wait_s: float) -> Iterator[Any]:
        """A cursor of the locked instance for SQL from users; waits up to `wait_s` for an ingest to end."""
        self._ensure_open()
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock.shared():
                if self.mode == LOCKED and self._con is not None:
                    cursor = self._con.cursor()
                    try:
                        yield cursor
                    finally:
                        cursor.close()
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._lock.wait_for(lambda: self.mode == LOCKED, min(remaining, 0.5)):
                if time.monotonic() >= deadline:
                    raise DatabaseUnavailable(
                        "an ingest is writing the database; SQL queries run again when it ends (retry in a few seconds)"
                    )

    def _ensure_open(self) -> None:
        if self.mode == CLOSED and self._problem is not None:
            with self._lock.exclusive():
                if self.mode == CLOSED and self._problem is not None:
                    self._reopen_locked()

    # ------------------------------------------------------------------ the writer

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The database read-write for the block (the ingest service's); locked again afterwards."""
        with self._lock.exclusive():
            self._close_current()
            try:
                self._con = open_database(self.path, wait_s=self.open_wait_s, on_wait=lambda text: log.warning(text))
            except BaseException:
                self._reopen_locked()
                raise
            self.mode = WRITING
        try:
            yield
        finally:
            with self._lock.exclusive():
                self._close_current()  # the last connection: DuckDB checkpoints and releases the file
                self.generation += 1
                self._reopen_locked()
            self._lock.notify()
