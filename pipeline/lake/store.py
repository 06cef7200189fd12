"""The lake's folder: where each table's files are, replacing a table or a run's partition, and a
DuckDB connection whose tables are views over the files.

    con = connect(Path("lake"))          # views over read_parquet(..., hive_partitioning = true)
    con.sql("SELECT * FROM call_sites")  # and the packaged views and macros (sql/*.sql) on top

A table is replaced by writing its new files into a staging folder beside it and swapping the two
folders; a run's partition likewise. Readers that list the files while a swap happens may see
neither; nothing is ever half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from tbpipe.pipeline.db import schema
from tbpipe.pipeline.db.schema import correlation_id_in_attrs, sql_text
from tbpipe.pipeline.errors import TbpipeError
from tbpipe.schemas.lake import LAKE_FILE, LAKE_FORMAT, LAKE_VERSION, PARTITION, TABLES, LakeTable
from tbpipe.schemas.raw import CORRELATED_KINDS

STAGING = "_staging"


class LakeError(TbpipeError):
    """The folder is not a lake this tbpipe reads, or a lake operation cannot proceed."""


def table_dir(root: Path, name: str) -> Path:
    return Path(root) / name


def partition_dir(root: Path, name: str, run_number: int) -> Path:
    return table_dir(root, name) / f"{PARTITION}={int(run_number)}"


def data_files(path: Path) -> list[Path]:
    """The Parquet files under a table's (or partition's) folder, without engines' side files."""
    if not path.is_dir():
        return []
    return sorted(
        p for p in path.rglob("*.parquet") if not any(part.startswith(("_", ".")) for part in p.relative_to(path).parts)
    )


def is_lake(root: Path) -> bool:
    return (Path(root) / LAKE_FILE).is_file()


def check_lake(root: Path) -> None:
    """LakeError unless `root` is a lake of this version."""
    path = Path(root) / LAKE_FILE
    if not path.is_file():
        raise LakeError(
            f"{root} is not a tbpipe lake (no {LAKE_FILE}): build one with `tbpipe ingest --engine spark --lake {root}` or `tbpipe lake export`"
        )
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise LakeError(f"{path}: unreadable ({error})") from None
    if info.get("format") != LAKE_FORMAT or info.get("version") != LAKE_VERSION:
        raise LakeError(
            f"{path}: format {info.get('format')!r} version {info.get('version')!r}; this tbpipe reads {LAKE_FORMAT} {LAKE_VERSION}"
        )


def create_lake(root: Path) -> None:
    """Makes `root` a lake (an existing lake is left as it is)."""
    root = Path(root)
    if is_lake(root):
        check_lake(root)
        return
    root.mkdir(parents=True, exist_ok=True)
    (root / LAKE_FILE).write_text(json.dumps({"format": LAKE_FORMAT, "version": LAKE_VERSION}) + "\n")


def staging_dir(root: Path) -> Path:
    path = Path(root) / STAGING / uuid.uuid4().hex
    path.mkdir(parents=True)
    return path


def swap_in(new: Path, target: Path) -> None:
    """Puts folder `new` where `target` is (replacing it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
    if target.exists():
        os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------ DuckDB over the lake

_DUCKDB_TYPES = {
    pa.string(): "VARCHAR",
    pa.int64(): "BIGINT",
    pa.int32(): "INTEGER",
    pa.bool_(): "BOOLEAN",
    pa.float64(): "DOUBLE",
    pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ",
}

# Columns the DuckDB file holds as JSON (the lake as text): the views give them back as JSON.
_JSON_COLUMNS = {("runs", "capture"), ("runs", "manifest"), ("event_rows", "attrs")}


# Macros that mean less on the lake than in the DuckDB file, by how the lake stores the data: their
# parameters and body there (DuckDB SQL; `sparksql` translates it like the rest).
LAKE_MACRO_BODIES = {
    # The lake keeps a CUDA call's correlation id inside the attributes, where this macro puts it back.
    "event_attrs": (("attrs", "correlation_id"), "CAST(attrs AS VARCHAR)"),
}

# Columns of the DuckDB file that the lake derives from others, by table: (name, SQL, type).
_DERIVED_COLUMNS = {
    # The stack id's bits, unsigned.
    "stacks": (
        "stack_hash",
        "CAST(CAST(stack_id AS HUGEINT) + CASE WHEN stack_id < 0 THEN 18446744073709551616 ELSE 0 END AS UBIGINT)",
        "UBIGINT",
    ),
    # The lake keeps a CUDA call's correlation id inside `attrs` (`export` and the Spark ingest put it there).
    "event_rows": (
        "correlation_id",
        "CASE WHEN name_id IN (SELECT name_id FROM event_names WHERE kind IN "
        f"({', '.join(sql_text(kind) for kind in CORRELATED_KINDS)})) THEN {correlation_id_in_attrs('attrs')} END",
        "UINTEGER",
    ),
}


def duckdb_type(type_: pa.DataType) -> str:
    if type_ in _DUCKDB_TYPES:
        return _DUCKDB_TYPES[type_]
    if pa.types.is_list(type_):
        return duckdb_type(type_.value_type) + "[]"
    if pa.types.is_map(type_):
        return f"MAP({duckdb_type(type_.key_type)}, {duckdb_type(type_.item_type)})"
    if pa.types.is_struct(type_):
        return "STRUCT(" + ", ".join(f"{f.name} {duckdb_type(f.type)}" for f in type_) + ")"
    raise LakeError(f"no DuckDB type for {type_}")


def _stored_columns(table: LakeTable, files: list[Path]) -> tuple[set[str], bool] | None:
    """The columns an unpartitioned table's files hold, and whether some file lacks one of them: a
    lake written before a column was added (`runs.rolled_up_at`) reads it as NULL. None: not looked at."""
    if table.partitioned or not files:
        return None

    held = [set(pq.read_schema(path).names) for path in files]
    every = set().union(*held)
    return every, any(names != every for names in held)


def table_view_sql(root: Path, table: LakeTable) -> str:
    """SELECT over a lake table's files (or over no rows, when it has none), in its columns and types."""
    files = data_files(table_dir(root, table.name))
    stored = _stored_columns(table, files)
    columns = []
    for field_ in table.schema:
        type_ = "JSON" if (table.name, field_.name) in _JSON_COLUMNS else duckdb_type(field_.type)
        if stored is not None and field_.name not in stored[0]:
            columns.append(f"CAST(NULL AS {type_}) AS {field_.name}")
        else:
            columns.append(f"CAST({field_.name} AS {type_}) AS {field_.name}")
    derived = _DERIVED_COLUMNS.get(table.name)
    if derived:
        columns.append(f"{derived[1]} AS {derived[0]}")
    if not files:
        nulls = ", ".join(
            f"CAST(NULL AS {'JSON' if (table.name, f.name) in _JSON_COLUMNS else duckdb_type(f.type)}) AS {f.name}"
            for f in table.schema
        )
        extra = f", CAST(NULL AS {derived[2]}) AS {derived[0]}" if derived else ""
        return f"SELECT {nulls}{extra} WHERE false"
    pattern = str(table_dir(root, table.name).resolve()) + ("/*/*.parquet" if table.partitioned else "/*.parquet")
    options = "hive_partitioning = true"
    if stored is not None and stored[1]:
        options += ", union_by_name = true"
    if table.partitioned:
        options += f", hive_types = {{'{PARTITION}': BIGINT}}"
    return f"SELECT {', '.join(columns)} FROM read_parquet({sql_text(pattern)}, {options})"


def install_views(con: Any, root: Path) -> None:
    """Views named like the database's tables over the lake's files, then the packaged views and macros."""

    for table in TABLES.values():
        con.execute(f"CREATE OR REPLACE VIEW {table.name} AS {table_view_sql(root, table)}")
    for module in schema.modules():
        for statement in module.statements:
            created = statement.created
            if created is not None and created.kind == "macro" and created.name in LAKE_MACRO_BODIES:
                params = ", ".join(LAKE_MACRO_BODIES[created.name][0])
                con.execute(f"CREATE OR REPLACE MACRO {created.name}({params}) AS {LAKE_MACRO_BODIES[created.name][1]}")
                continue
            con.execute(statement.sql)


def connect(root: Path) -> Any:
    """An in-memory DuckDB connection whose tables are views over the lake at `root`."""

    root = Path(root)
    check_lake(root)
    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    install_views(con, root)
    return con
