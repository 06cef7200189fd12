"""The ingest's handle on the database: Arrow tables in as named views, inserts, transactions.

Errors inside a transaction that come from a run's data (attributes that are not JSON, an events
part DuckDB cannot read) become `QuarantineRun`; any other DuckDB error is a `DatabaseError`.

A night of small runs pays for every statement of every run, so a few facts the ingest would
otherwise ask for once per run are kept here (`IngestDb.kept`): the next run number and event id,
the event names and module keys stored. The ingest lock keeps every other writer out, so only the
ingest's own statements change them; a rolled-back transaction forgets them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import duckdb

from tbpipe.pipeline.db.connection import DatabaseError
from tbpipe.pipeline.db.schema import sql_text  # noqa: F401 - the ingest's modules take it from here
from tbpipe.pipeline.errors import first_line

if TYPE_CHECKING:  # annotations only: an ingest with nothing to load imports no pyarrow
    import pyarrow as pa


class QuarantineRun(Exception):
    """The run's data cannot be loaded (found while loading, e.g. attributes that are not JSON)."""


@dataclass
class _Shared:
    """What the ingest's handles on its connections share."""

    kept: dict[str, Any] = field(default_factory=dict)
    # Whether the ingest deleted rows (a run loaded again, sites or symbols rebuilt): their space
    # is reclaimed by the checkpoint that closes the database (`flow`).
    rows_deleted: bool = False


class IngestDb:
    def __init__(self, con: Any, shared: _Shared | None = None):
        self.con = con
        self._shared = shared or _Shared()

    def on(self, con: Any) -> IngestDb:
        """The same handle on another connection to the database, sharing what is kept (the ingest
        loads two transactions at a time, and numbers their rows in one sequence)."""
        return IngestDb(con, self._shared)

    @property
    def kept(self) -> dict[str, Any]:
        return self._shared.kept

    @property
    def rows_deleted(self) -> bool:
        return self._shared.rows_deleted

    def keep(self, name: str, read: Callable[[], Any]) -> Any:
        """The kept fact `name`, read with `read()` the first time (or after a rollback)."""
        if name not in self.kept:
            self.kept[name] = read()
        return self.kept[name]

    def next_ids(self, column: str, count: int, read_next: Callable[[], int]) -> int:
        """The first of `count` new values of an increasing id column, counted on from the kept next
        value (read with `read_next()` the first time)."""
        first = self.keep(f"next {column}", read_next)
        self.kept[f"next {column}"] = first + count
        return first

    def register(self, name: str, table: pa.Table) -> None:
        self.con.register(name, table)

    def unregister(self, name: str) -> None:

        # Inside a failed transaction DuckDB refuses even this; the name is registered anew
        # (replacing the view) the next time it is used, so leaving it is harmless.
        try:
            self.con.unregister(name)
        except duckdb.Error:
            pass

    def delete(self, sql: str, params: list[Any] | None = None) -> None:
        """Runs a DELETE statement, noting whether it deleted any row."""
        (count,) = self.con.execute(sql, params or []).fetchone()
        self._shared.rows_deleted = self._shared.rows_deleted or count > 0

    def insert(self, sql: str, table: pa.Table, params: list[Any] | None = None) -> None:
        """Runs `sql` with `{}` naming `table` (e.g. 'INSERT INTO t BY NAME SELECT * FROM {}')."""
        # DuckDB finds the Arrow table by this local variable's name (a replacement scan): for one
        # statement that costs half of registering and unregistering a view.
        ingest_rows = table  # noqa: F841 - read by DuckDB
        self.con.execute(sql.format("ingest_rows"), params or [])

    def transaction(self, *, begun: bool = False) -> Transaction:
        return Transaction(self, begun=begun)


class Transaction:
    """BEGIN ... COMMIT, or ROLLBACK on any exception (data errors quarantine the run). With
    `begun`, the connection's transaction is already open (its first statements ran before)."""

    def __init__(self, db: IngestDb, *, begun: bool = False):
        self.db = db
        self.con = db.con
        self.begun = begun

    def __enter__(self) -> Any:
        if not self.begun:
            self.con.execute("BEGIN TRANSACTION")
        return self.con

    def __exit__(self, kind, error, _traceback) -> None:
        if error is None:
            try:
                self.con.execute("COMMIT")
            except BaseException:
                self.db.kept.clear()
                raise
            return
        self.db.kept.clear()
        self.con.execute("ROLLBACK")
        raise_for_data_error(error)


def run_numbers_filter(column: str, numbers: list[int]) -> tuple[str, list[Any]]:
    """A WHERE condition (and its parameters) for rows of the given runs: the range first, which
    DuckDB checks against each row group's bounds and so skips the older runs' rows unread."""
    if len(numbers) == 1:
        return f"{column} = ?", [numbers[0]]
    return f"{column} BETWEEN ? AND ? AND list_contains(?, {column})", [min(numbers), max(numbers), numbers]


def raise_for_data_error(error: BaseException) -> None:
    """Errors that come from the run's data (not the database) quarantine the run."""

    text = first_line(error)
    if isinstance(error, (duckdb.ConversionException, duckdb.InvalidInputException)) and "JSON" in text:
        raise QuarantineRun(f"events have attributes that are not JSON ({text})") from None
    if isinstance(error, (duckdb.IOException, duckdb.InvalidInputException)) and ".parquet" in str(error).lower():
        raise QuarantineRun(f"events unreadable ({text})") from None
    if isinstance(error, (duckdb.ConversionException, duckdb.InvalidInputException)):
        raise QuarantineRun(f"cannot load the run's data ({text})") from None
    if isinstance(error, duckdb.Error):
        raise DatabaseError(f"the database failed while loading a run: {text}") from None
