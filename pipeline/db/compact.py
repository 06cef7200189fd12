"""Compacting the database file: the same database, written afresh without free blocks.

DuckDB reuses the blocks a file has freed but never gives them back to the file system. An ingest
of many runs leaves some (row groups written during each run's transaction are merged at the
checkpoint), and a migration that rebuilds a table (schema 8 rebuilt the events) frees the whole
old table: a 10M-event database went from 519 MB to 627 MB on that migration, with half its blocks
free. `compact_database` copies every table, view, macro, index and comment into a new file beside
the old one (DuckDB's `COPY FROM DATABASE`), checks that every table has the same rows, and puts it in
the old one's place with a rename. It holds the ingest lock throughout, so no ingest or service
writes meanwhile; a reader that had the file open goes on reading the old one. Any failure leaves
the database as it was.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from tbpipe.pipeline.db.connection import DatabaseError, ingest_lock, open_database, resolve_db_path
from tbpipe.pipeline.db.schema import sql_text, storage_tag
from tbpipe.pipeline.errors import first_line


@dataclass
class CompactResult:
    path: Path
    bytes_before: int
    bytes_after: int
    tables: int
    rows: int


def _row_counts(con: Any, database: str) -> dict[str, int]:
    tables = [
        row[0]
        for row in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = ? AND NOT temporary ORDER BY table_name",
            [database],
        ).fetchall()
    ]
    return {name: con.execute(f'SELECT count(*) FROM {database}."{name}"').fetchone()[0] for name in tables}


def compact_database(path: Path | str | None = None, wait_s: float = 0.0) -> CompactResult:
    """Rewrites the database at `path` (default: $TBPIPE_DB or ./tbpipe.duckdb) without free blocks."""
    db_path = resolve_db_path(path)
    if not db_path.is_file():
        raise DatabaseError(f"no database at {db_path}")
    # The lock and the write-ahead log are beside the path as given, as for every other command; the
    # file replaced is the one it names, at the end of any symbolic link.
    target = db_path.resolve()
    fresh = target.with_name(f".{target.name}.compacting")
    with ingest_lock(db_path, wait_s):
        # A read-write open brings the schema up to date, and closing it checkpoints: the whole
        # database is then in the file, none of it in a write-ahead log beside it.
        open_database(db_path).close()
        wal = db_path.with_name(db_path.name + ".wal")
        if wal.exists():
            raise DatabaseError(f"cannot compact {db_path}: {wal} is still there after a checkpoint; nothing changed")
        before = target.stat().st_size
        for leftover in (fresh, fresh.with_name(fresh.name + ".wal")):
            leftover.unlink(missing_ok=True)  # from a compaction that was killed
        try:
            expected = _copy(db_path, fresh, shutil.disk_usage(target.parent).free)
            _keep_access(target, fresh)
            with open(fresh, "rb+") as handle:
                os.fsync(handle.fileno())  # on disk before it takes the old file's name
            os.replace(fresh, target)
        finally:
            for leftover in (fresh, fresh.with_name(fresh.name + ".wal")):
                leftover.unlink(missing_ok=True)
    return CompactResult(db_path, before, target.stat().st_size, len(expected), sum(expected.values()))


def _keep_access(original: Path, fresh: Path) -> None:
    """The original's permissions, and its owner where this user may give it, on the copy: a service
    running as another user must still open the database after a compaction run from cron."""
    status = original.stat()
    os.chmod(fresh, stat.S_IMODE(status.st_mode))
    if (status.st_uid, status.st_gid) != (os.getuid(), os.getgid()):
        try:
            os.chown(fresh, status.st_uid, status.st_gid)
        except PermissionError:
            raise DatabaseError(
                f"cannot compact {original}: it belongs to user {status.st_uid}, group {status.st_gid}, and the "
                "copy could not be given to them; run tbpipe compact as its owner. Nothing changed"
            ) from None


def _copy(db_path: Path, fresh: Path, free: int) -> dict[str, int]:
    """Copies the database into `fresh` and returns its tables' row counts, checked equal in both."""

    con = duckdb.connect()
    try:
        con.execute(f"ATTACH {sql_text(str(db_path))} AS original (READ_ONLY)")
        used = con.execute(
            "SELECT block_size * used_blocks FROM pragma_database_size() WHERE database_name = 'original'"
        ).fetchone()[0]
        if used > free:
            raise DatabaseError(
                f"cannot compact {db_path}: its {used / 1e6:,.0f} MB of data do not fit in the "
                f"{free / 1e6:,.0f} MB free in {db_path.parent}"
            )
        # The copy in the original's storage format: what it stores, and which DuckDB reads it, stay the same.
        version = storage_tag(con, "original")
        version_option = f" (STORAGE_VERSION '{version.rstrip('+')}')" if version else ""
        con.execute(f"ATTACH {sql_text(str(fresh))} AS compacted{version_option}")
        con.execute("COPY FROM DATABASE original TO compacted")
        con.execute("CHECKPOINT compacted")
        expected, copied = _row_counts(con, "original"), _row_counts(con, "compacted")
        if copied != expected:
            different = sorted(n for n in expected.keys() | copied.keys() if expected.get(n) != copied.get(n))
            raise DatabaseError(f"compacting {db_path}: the copy differs in {', '.join(different)}; nothing changed")
        con.execute("DETACH compacted")
        con.execute("DETACH original")
        return expected
    except duckdb.Error as error:
        raise DatabaseError(f"cannot compact {db_path}: {first_line(error)}; nothing changed") from None
    finally:
        con.close()
