"""The database schema as the `tbpipe.sql` package data defines it: migrations, view/macro modules, docs.

- `sql/migrations/NNN_name.sql` are applied in order, each once, each in its own transaction, and
  recorded in `schema_versions`; the highest applied number is the schema version.
- `sql/*.sql` are modules of views and macros. They are (re)installed when their text changed, in
  the order their `-- @requires NAME` lines ask for; objects a module no longer defines are dropped.
- The comment block right above each CREATE (`-- description`, `-- @column NAME text`, `-- @arg`,
  `-- @returns`) becomes a DuckDB `COMMENT ON`, so the database documents itself.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from tbpipe.pipeline.errors import TbpipeError

_MIGRATION_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")
_CREATE = re.compile(
    r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP\s+|TEMPORARY\s+)?(TABLE|VIEW|MACRO)\s+(?:IF\s+NOT\s+EXISTS\s+)?"
    r"([A-Za-z_][A-Za-z0-9_]*)",
    re.IGNORECASE,
)
_TABLE_MACRO = re.compile(r"\)\s+AS\s+TABLE\b", re.IGNORECASE)
_CATALOG_KIND = {"table": "TABLE", "view": "VIEW", "macro": "MACRO", "table macro": "MACRO TABLE"}


class SchemaError(TbpipeError):
    """The packaged SQL is inconsistent (a bug in tbpipe, not in the user's data)."""


@dataclass(frozen=True)
class SqlObject:
    """A table, view or macro created by a statement, with its documentation."""

    kind: str  # 'table', 'view', 'macro' or 'table macro'
    name: str
    doc: str
    columns: dict[str, str] = field(default_factory=dict)  # @column (and @arg) name -> text
    returns: str | None = None


@dataclass(frozen=True)
class Statement:
    sql: str
    created: SqlObject | None


@dataclass(frozen=True)
class SqlFile:
    name: str  # file name without .sql
    text: str
    requires: tuple[str, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def statements(self) -> list[Statement]:
        return [_parse_statement(chunk) for chunk in split_statements(self.text)]


@dataclass(frozen=True)
class Migration(SqlFile):
    version: int = 0


def split_statements(text: str) -> list[str]:
    """SQL text -> statements (each with the comments above it), split at `;` outside quotes/comments."""
    statements, start, i, n = [], 0, 0, len(text)
    quote: str | None = None
    while i < n:
        c = text[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "-" and text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        elif c == ";":
            statements.append(text[start : i + 1])
            start = i + 1
        i += 1
    if _strip_comments(text[start:]).strip():
        raise SchemaError(f"SQL text ends without ';': {text[start:].strip()[:80]!r}")
    return [s for s in statements if _strip_comments(s).strip(" \n;")]


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("--"))


def _parse_statement(chunk: str) -> Statement:
    lines = chunk.strip("\n").splitlines()
    first_code = next(i for i, line in enumerate(lines) if line.strip() and not line.strip().startswith("--"))
    code = "\n".join(lines[first_code:]).strip()
    match = _CREATE.match(code)
    if match is None:
        return Statement(code, None)
    kind, name = match.group(1).lower(), match.group(2)
    if kind == "macro" and _TABLE_MACRO.search(code):
        kind = "table macro"
    # The doc block is the run of comment lines right above the CREATE.
    block: list[str] = []
    for line in reversed(lines[:first_code]):
        stripped = line.strip()
        if not stripped.startswith("--"):
            break
        block.insert(0, stripped[2:].strip())
    description, columns, returns = [], {}, None
    for line in block:
        if line.startswith("@column ") or line.startswith("@arg "):
            _tag, column, *text = line.split(None, 2)
            columns[column] = text[0] if text else ""
        elif line.startswith("@returns"):
            returns = line[len("@returns") :].strip()
        elif line.startswith("@requires"):
            continue
        elif line:
            description.append(line)
    return Statement(code, SqlObject(kind, name, " ".join(description), columns, returns))


def _requires(text: str) -> tuple[str, ...]:
    return tuple(m.group(1) for m in re.finditer(r"^--\s*@requires\s+([a-z0-9_]+)\s*$", text, re.MULTILINE))


def _package():
    return resources.files("tbpipe.sql")


def migrations() -> list[Migration]:
    """Every packaged migration, in version order."""
    found = []
    for entry in (_package() / "migrations").iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            text = entry.read_text(encoding="utf-8")
            found.append(Migration(match.group(2), text, _requires(text), int(match.group(1))))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(len(found))):
        raise SchemaError(f"migrations must be numbered 000, 001, ... without gaps; found {versions}")
    return found


def latest_version() -> int:
    return migrations()[-1].version


def modules() -> list[SqlFile]:
    """The view/macro modules, dependencies first."""
    files = {}
    for entry in _package().iterdir():
        if entry.name.endswith(".sql") and entry.is_file():
            text = entry.read_text(encoding="utf-8")
            files[entry.name[:-4]] = SqlFile(entry.name[:-4], text, _requires(text))
    ordered: list[SqlFile] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if any(f.name == name for f in ordered):
            return
        if name not in files:
            raise SchemaError(f"SQL module requires unknown module {name!r}")
        if name in visiting:
            raise SchemaError(f"SQL modules require each other in a cycle through {name!r}")
        visiting.add(name)
        for dependency in files[name].requires:
            visit(dependency)
        ordered.append(files[name])

    for name in sorted(files):
        visit(name)
    return ordered


def sql_text(text: str) -> str:
    """`text` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def correlation_id_in_attrs(attrs: str) -> str:
    """SQL of the correlation id that a CUDA call's attributes `attrs` held before raw schema 3 (and
    the database before schema 10): an unsigned 32-bit integer, 0 meaning none; else NULL. The
    ingest moves it out of old runs' attributes, and the lake (which keeps it there) reads it so."""
    return (
        f"CASE WHEN json_type({attrs}, '$.correlation_id') IN ('UBIGINT', 'BIGINT') "
        f"THEN NULLIF(TRY_CAST(json_extract_string({attrs}, '$.correlation_id') AS UINTEGER), 0) END"
    )


def comment_statements(obj: SqlObject) -> list[str]:
    """`COMMENT ON` statements that store an object's documentation in the catalog."""
    if obj.kind in ("macro", "table macro"):
        parts = [obj.doc]
        parts += [f"{name}: {text}" for name, text in obj.columns.items()]
        if obj.returns:
            parts.append(f"returns {obj.returns}")
        return [f"COMMENT ON {_CATALOG_KIND[obj.kind]} {obj.name} IS {sql_text(' | '.join(p for p in parts if p))}"]
    out = [f"COMMENT ON {_CATALOG_KIND[obj.kind]} {obj.name} IS {sql_text(obj.doc)}"]
    out += [f"COMMENT ON COLUMN {obj.name}.{column} IS {sql_text(text)}" for column, text in obj.columns.items()]
    return out


def applied_versions(con: Any) -> set[int]:
    exists = con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'schema_versions' AND NOT temporary"
    ).fetchall()[0][0]
    if not exists:
        return set()
    return {row[0] for row in con.execute("SELECT version FROM schema_versions").fetchall()}


_COMPRESSION = re.compile(r"\s+USING\s+COMPRESSION\s+zstd\b", re.IGNORECASE)
# The first storage format with zstd for strings (DuckDB 1.2's).
ZSTD_STORAGE = (1, 2)


def storage_version(text: str | None) -> tuple[int, int] | None:
    """A DuckDB storage format or compatibility setting ('v2.0.0+', 'v0.10.2') as (major, minor);
    None for anything else ('latest', no value)."""
    found = re.match(r"v(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def storage_tag(con: Any, database: str) -> str | None:
    """The storage format of an attached database file as DuckDB names it ('v1.2.0+'), or None."""
    rows = con.execute(
        "SELECT tags['storage_version'] FROM duckdb_databases() WHERE database_name = ?", [database]
    ).fetchall()
    return rows[0][0] if rows else None


def _within_storage_format(con: Any, sql: str) -> str:
    """`sql` without its `USING COMPRESSION zstd` clauses when the file's storage format predates
    zstd for strings: the column then keeps DuckDB's default compression (a larger file, the same data)."""
    if not _COMPRESSION.search(sql):
        return sql
    (database,) = con.execute("SELECT current_database()").fetchone()
    version = storage_version(storage_tag(con, database))
    return sql if version is None or version >= ZSTD_STORAGE else _COMPRESSION.sub("", sql)


def apply_migrations(con: Any, tbpipe_version: str) -> list[int]:
    """Applies the migrations this database lacks, each in its own transaction; returns their versions."""
    done = applied_versions(con)
    applied = []
    for migration in migrations():
        if migration.version in done:
            continue
        con.execute("BEGIN TRANSACTION")
        try:
            for statement in migration.statements:
                con.execute(_within_storage_format(con, statement.sql))
                if statement.created is not None:
                    for comment in comment_statements(statement.created):
                        con.execute(comment)
            con.execute(
                "INSERT INTO schema_versions VALUES (?, ?, ?, now(), ?)",
                [migration.version, migration.name, migration.sha256, tbpipe_version],
            )
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        applied.append(migration.version)
    return applied


def install_modules(con: Any) -> list[str]:
    """(Re)installs view/macro modules whose text changed; returns the modules installed."""
    installed = {name: (sha, objects) for name, sha, objects in con.execute("SELECT * FROM sql_modules").fetchall()}
    wanted = modules()
    if all(installed.get(m.name, (None,))[0] == m.sha256 for m in wanted) and len(installed) == len(wanted):
        return []
    con.execute("BEGIN TRANSACTION")
    try:
        # Dependents are dropped before what they use: reverse install order, stale modules first.
        stale = [name for name in installed if name not in {m.name for m in wanted}]
        for name in stale + [m.name for m in reversed(wanted) if m.name in installed]:
            for entry in reversed(installed[name][1]):
                kind, _, object_name = entry.rpartition(" ")
                con.execute(f"DROP {_CATALOG_KIND[kind]} IF EXISTS {object_name}")
        con.execute("DELETE FROM sql_modules")
        for module in wanted:
            objects = []
            for statement in module.statements:
                con.execute(statement.sql)
                if statement.created is not None:
                    objects.append(f"{statement.created.kind} {statement.created.name}")
                    for comment in comment_statements(statement.created):
                        con.execute(comment)
            con.execute("INSERT INTO sql_modules VALUES (?, ?, ?)", [module.name, module.sha256, objects])
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    return [m.name for m in wanted]
