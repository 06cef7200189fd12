"""Read-only SQL from users (`/api/query`, the SQL page): one SELECT, a time limit and a row limit.

Two fences. The statement is parsed by DuckDB itself (`extract_statements`) and refused unless it
is exactly one SELECT (so no ATTACH, COPY, INSTALL/LOAD, SET/RESET, PRAGMA, CALL, EXPORT, DDL or
DML, whatever the spelling) whose table functions (found in DuckDB's own parse tree,
`json_serialize_sql`) are all in `TABLE_FUNCTIONS` (so no `read_csv`, `read_text`, `glob`, nor
`query('...')` around them). It then runs on a cursor of the locked instance
(`database.open_locked`: read-only, no external access, configuration locked), where a SELECT
that reaches for a file or the network is refused by DuckDB itself; that instance still lets its
own database file be read, which the table-function check keeps closed too. A timer interrupts
the query past the time limit; rows past the row limit are not fetched.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import duckdb

MAX_SQL_CHARS = 20_000
# Table functions that compute or read the catalog, never a file: the only ones a query may call.
TABLE_FUNCTIONS = re.compile(
    r"^(range|generate_series|unnest|repeat|repeat_row|json_each|json_tree|duckdb_\w+|pragma_\w+)$"
)


class QueryRefused(Exception):
    """A statement the sandbox does not run, or one DuckDB refused: `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class QueryResult:
    columns: list[str]
    types: list[str]
    rows: list[list[Any]]
    truncated: bool  # more rows than the limit: the first `limit` are here
    limit: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            "types": self.types,
            "rows": self.rows,
            "row_count": len(self.rows),
            "truncated": self.truncated,
            "limit": self.limit,
            "seconds": round(self.seconds, 4),
        }


def check_statement(cursor: Any, sql: str) -> str:
    """The one SELECT statement `sql` holds (its text), or QueryRefused saying why not."""

    text = sql.strip()
    if not text:
        raise QueryRefused("no SQL given: pass a SELECT statement as ?sql=...")
    if len(text) > MAX_SQL_CHARS:
        raise QueryRefused(f"the SQL is {len(text):,} characters long; at most {MAX_SQL_CHARS:,} are accepted")
    try:
        statements = cursor.extract_statements(text)
    except duckdb.Error as error:
        raise QueryRefused(f"the SQL does not parse: {_first_line(error)}") from None
    if len(statements) != 1:
        raise QueryRefused(f"one statement at a time: this SQL holds {len(statements)}")
    (statement,) = statements
    kind = str(statement.type).rsplit(".", 1)[-1]
    first_word = re.match(r"\W*(\w*)", _without_comments(text)).group(1).upper()
    if kind == "SELECT" and first_word not in _QUERY_WORDS:
        kind = first_word  # e.g. PRAGMA, which some DuckDB versions rewrite into a SELECT
    if kind != "SELECT":
        raise QueryRefused(f"only SELECT queries run here (the database is read-only); this is a {kind} statement", 403)
    if statement.named_parameters:
        raise QueryRefused("the query has parameters ($name or ?); write the values into the SQL")
    query = statement.query.strip().rstrip(";")
    for name in sorted(_table_functions(cursor, query)):
        if not TABLE_FUNCTIONS.match(name):
            raise QueryRefused(
                f"refused: table function {name}() is not available here (this SQL can read the database's tables "
                "and views only; range, generate_series, unnest, json_each and the duckdb_*/pragma_* catalog "
                "functions are allowed)",
                403,
            )
    return query


# Words a query may start with (after comments and parentheses).
_QUERY_WORDS = {"SELECT", "WITH", "FROM", "VALUES", "TABLE", "SUMMARIZE", "DESCRIBE", "SHOW", "UNPIVOT"}


def _without_comments(text: str) -> str:
    return re.sub(r"--[^\n]*|/\*.*?\*/", " ", text, flags=re.S)


def _table_functions(cursor: Any, query: str) -> set[str]:
    """Names of the table functions a SELECT calls, anywhere in it (from DuckDB's parse tree)."""
    ((text,),) = cursor.execute("SELECT json_serialize_sql(?)", [query]).fetchall()
    tree = json.loads(text)
    if tree.get("error"):
        raise QueryRefused(f"the SQL cannot be checked: {tree.get('error_message', 'unsupported statement')}")
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if node.get("type") == "TABLE_FUNCTION":
                function = node.get("function") or {}
                found.add(str(function.get("function_name", "?")).lower())
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return found


def run_query(cursor: Any, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:

    query = check_statement(cursor, sql)
    started = time.monotonic()
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        cursor.interrupt()

    timer = threading.Timer(timeout_s, stop)
    timer.daemon = True
    timer.start()
    try:
        relation = cursor.sql(query)
        if relation is None:  # not a query after all
            raise QueryRefused("the statement returns no rows; only SELECT queries run here", 403)
        columns, types = list(relation.columns), [str(t) for t in relation.types]
        rows = relation.limit(max_rows + 1).fetchall()
    except duckdb.InterruptException:
        raise QueryRefused(
            f"the query ran past the time limit of {timeout_s:g} s and was stopped"
            if stopped.is_set()
            else "the query was interrupted",
            408 if stopped.is_set() else 503,
        ) from None
    except duckdb.PermissionException as error:
        raise QueryRefused(f"refused: {_first_line(error)} (this SQL can read the database only)", 403) from None
    except duckdb.Error as error:
        raise QueryRefused(_first_line(error)) from None
    finally:
        timer.cancel()
    truncated = len(rows) > max_rows
    return QueryResult(
        columns, types, [[jsonable(v) for v in row] for row in rows[:max_rows]], truncated, max_rows,
        time.monotonic() - started,
    )  # fmt: skip


def jsonable(value: Any) -> Any:
    """A DuckDB value as JSON can carry it: times as ISO-8601 text, BLOBs as base64, NaN as null."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:500] if lines else type(error).__name__
