"""Opening the tbpipe database: where it is, the ingest lock, migrations on a read-write open.

DuckDB lets one process write a database file, or several processes read it. Ingests serialize on
a lock file beside the database (`<db>.lock`, holding the writer's pid), so a second ingest waits
for the first instead of failing on DuckDB's own lock; a reader that holds the file makes a
writer wait too, up to the same limit.

A service that stays the database's only writer while it runs (`tbpipe serve`) takes the same lock
for its whole life with a `holder` description: other ingests name it in their messages, and the
ingests the service runs itself do not take the lock a second time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb

from tbpipe.capture import __version__
from tbpipe.pipeline.db import schema
from tbpipe.pipeline.errors import TbpipeError, first_line

DEFAULT_DB_NAME = "tbpipe.duckdb"
DB_ENV = "TBPIPE_DB"
_POLL_S = 0.1


class DatabaseError(TbpipeError):
    """The database cannot be opened or used: names the file and the reason."""


class DatabaseBusyError(DatabaseError):
    """Another process holds the database (an ingest writing it, or readers while we want to write)."""


def default_db_path() -> Path:
    """$TBPIPE_DB, else ./tbpipe.duckdb."""
    return Path(os.environ.get(DB_ENV) or DEFAULT_DB_NAME)


def resolve_db_path(path: Path | str | None) -> Path:
    return Path(path) if path else default_db_path()


def _tbpipe_version() -> str:

    return __version__


# Lock files this process holds for its whole life (`ingest_lock(..., holder=...)`).
_HELD_FOR_PROCESS: set[str] = set()


@contextlib.contextmanager
def ingest_lock(
    db_path: Path, wait_s: float, on_wait: Callable[[str], None] | None = None, *, holder: str | None = None
) -> Iterator[None]:
    """Holds `<db>.lock` (flock) for the duration; waits up to `wait_s` for another ingest.

    The kernel drops the lock when its holder dies, so a killed ingest never leaves it stuck.
    With `holder` (e.g. 'tbpipe serve on http://127.0.0.1:8000'), the lock is this process's until
    the block ends: its text goes into the lock file for other processes' messages, and ingests
    that this process runs meanwhile (the holder serializes them itself) go on without waiting.
    """
    lock_path = db_path.with_name(db_path.name + ".lock")
    if holder is None and os.path.abspath(lock_path) in _HELD_FOR_PROCESS:
        yield
        return
    if not lock_path.parent.is_dir():
        raise DatabaseError(f"cannot create the database {db_path}: folder {lock_path.parent} does not exist")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise DatabaseError(f"cannot create the ingest lock {lock_path}: {error.strerror or error}") from None
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid, service = _lock_holder(fd)
                if time.monotonic() >= deadline:
                    if service:
                        raise DatabaseBusyError(
                            f"{db_path}: {service}{pid} holds it while it runs; gave up after waiting {wait_s:g} s "
                            "(--wait sets how long to wait)"
                        ) from None
                    raise DatabaseBusyError(
                        f"{db_path}: another ingest{pid} is writing it; gave up after waiting {wait_s:g} s "
                        "(--wait sets how long to wait)"
                    ) from None
                if not told and on_wait is not None:
                    if service:
                        on_wait(f"waiting for {service}{pid} to release {db_path} (it holds it while it runs) ...")
                    else:
                        on_wait(f"waiting for another ingest{pid} to finish writing {db_path} ...")
                    told = True
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{holder or ''}\n".encode(), 0)
        if holder is not None:
            _HELD_FOR_PROCESS.add(os.path.abspath(lock_path))
        try:
            yield
        finally:
            if holder is not None:
                _HELD_FOR_PROCESS.discard(os.path.abspath(lock_path))
            # Cleared while still held: a waiter that reads the file in the moment between the next
            # holder's lock and its write sees no holder rather than this, finished, one.
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _lock_holder(fd: int) -> tuple[str, str]:
    """(' (pid N)' or '', the holder's description or '') from the lock file."""
    try:
        lines = os.pread(fd, 1024, 0).decode().splitlines()
    except (OSError, UnicodeDecodeError):
        return "", ""
    pid = lines[0].strip() if lines else ""
    service = lines[1].strip() if len(lines) > 1 else ""
    if pid == str(os.getpid()):
        # Another thread, or a lock block left open (a generator not run to its end), of the caller's.
        return f" (pid {pid}, this process)", service
    return (f" (pid {pid})" if pid.isdigit() else ""), service


def _new_file_config(path: Path) -> dict[str, str]:
    """A new file is written at least in the first storage format with zstd for strings (schema 8
    stores event attributes with it): DuckDB before 2.0 writes 0.10's unless told, where the
    attributes would keep the default compression. An existing file keeps its format."""

    if path.exists():
        return {}
    with duckdb.connect() as memory:
        (default,) = memory.execute("SELECT current_setting('storage_compatibility_version')").fetchone()
    version = schema.storage_version(default)
    if version is None or version >= schema.ZSTD_STORAGE:
        return {}
    return {"storage_compatibility_version": "v{}.{}.0".format(*schema.ZSTD_STORAGE)}


def _connect(path: Path, read_only: bool, wait_s: float, on_wait: Callable[[str], None] | None):

    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            config = {} if read_only else _new_file_config(path)
            return duckdb.connect(str(path), read_only=read_only, config=config)
        except duckdb.IOException as error:
            message = str(error)
            if "lock" not in message.lower():
                raise DatabaseError(f"{path}: cannot open the database: {first_line(message)}") from None
            if time.monotonic() >= deadline:
                holder = "is writing the database" if read_only else "has the database open"
                raise DatabaseBusyError(f"{path}: another process {holder} ({first_line(message)})") from None
            if not told and on_wait is not None:
                on_wait(f"waiting for another process to close {path} ...")
                told = True
            time.sleep(_POLL_S)
        except duckdb.Error as error:
            raise DatabaseError(f"{path}: cannot open the database: {first_line(error)}") from None


def open_database(
    path: Path | str | None = None,
    *,
    read_only: bool = False,
    wait_s: float = 0.0,
    on_wait: Callable[[str], None] | None = None,
):
    """A DuckDB connection to the tbpipe database at `path` (default: $TBPIPE_DB or ./tbpipe.duckdb).

    Read-write: creates the file if needed, applies missing migrations and (re)installs changed
    view modules. Read-only: the file must exist and be at this tbpipe's schema version.
    """

    db_path = resolve_db_path(path)
    if read_only and not db_path.is_file():
        raise DatabaseError(f"no database at {db_path}: create it with `tbpipe ingest RUNS_DIR --db {db_path}`")
    if not read_only and db_path.parent and not db_path.parent.is_dir():
        raise DatabaseError(f"cannot create the database {db_path}: folder {db_path.parent} does not exist")
    con = _connect(db_path, read_only, wait_s, on_wait)
    try:
        # DuckDB's own bar would land in the middle of `tbpipe query`'s CSV or JSON on stdout.
        con.execute("SET enable_progress_bar = false")
        if read_only:
            _check_version(con, db_path)
        else:
            schema.apply_migrations(con, _tbpipe_version())
            _check_version(con, db_path)
            schema.install_modules(con)
    except duckdb.Error as error:
        con.close()
        raise DatabaseError(f"{db_path}: {first_line(error)}") from None
    except BaseException:
        con.close()
        raise
    return con


def _check_version(con, db_path: Path) -> None:
    applied = schema.applied_versions(con)
    latest = schema.latest_version()
    if not applied:
        raise DatabaseError(f"{db_path} is not a tbpipe database (it has no schema_versions table)")
    current = max(applied)
    if current > latest:
        raise DatabaseError(
            f"{db_path} has schema version {current}, newer than this tbpipe's {latest}: upgrade tbpipe to read it"
        )
    if current < latest:
        raise DatabaseError(
            f"{db_path} has schema version {current}, older than this tbpipe's {latest}: "
            "run `tbpipe ingest` on it once to upgrade it"
        )


def query_arrow(con, sql: str, params: list | None = None):
    """The result of `sql` as a pyarrow Table, without the DB-API result's extra copy."""
    relation = con.sql(sql, params=params) if params is not None else con.sql(sql)
    fetch = getattr(relation, "to_arrow_table", None) or relation.arrow
    return fetch()


def query_rows(con, sql: str, params: list | None = None) -> list[tuple]:
    """Every row of `sql` (fetched to the end: DuckDB 2 keeps a partly fetched result open)."""
    return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()


def query_value(con, sql: str, params: list | None = None):
    """The first column of the first row of `sql`, or None."""
    rows = query_rows(con, sql, params)
    return rows[0][0] if rows else None
