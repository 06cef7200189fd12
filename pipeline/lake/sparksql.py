"""The packaged views (sql/*.sql) in Spark SQL, translated from their DuckDB text with sqlglot.

The views are written once, for DuckDB. Here each view's SELECT is parsed as DuckDB, the scalar
macros it calls are expanded in place (Spark has no macros: the macro's body is parsed and its
parameters replaced by the call's arguments), the few DuckDB functions that Spark spells or
behaves differently are rewritten (`FUNCTION_MAP`), and sqlglot writes the result as Spark SQL.

    spark_views()                   # [(name, Spark SQL)] in dependency order
    duckdb_only_views()             # {name: why}: the views Spark SQL cannot express (ASOF joins)
    register_lake(spark, lake)      # temp views over the lake's files, then the translated views

A table macro read by a view (`python_files_from(0)`) is expanded the same way, into a subquery
named like the macro; the ingest's own table macro (`stack_sites_from`) runs in DuckDB only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbpipe.pipeline.db import schema
from tbpipe.pipeline.lake import store
from tbpipe.pipeline.lake.spark_ingest import spark_schema
from tbpipe.schemas.lake import TABLES
from tbpipe.schemas.raw import CORRELATED_KINDS

_MACRO = re.compile(
    r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?MACRO\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(([^)]*)\)\s+AS\s+(.*?)\s*;?\s*$",
    re.IGNORECASE | re.DOTALL,
)
_TABLE_BODY = re.compile(r"^\s*TABLE\s+(.*)$", re.IGNORECASE | re.DOTALL)
_VIEW = re.compile(
    r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?VIEW\s+([A-Za-z_][A-Za-z0-9_]*)\s+AS\s+(.*?)\s*;?\s*$", re.IGNORECASE | re.DOTALL
)


@dataclass(frozen=True)
class Macro:
    name: str
    params: tuple[str, ...]
    body: Any  # sqlglot expression
    table: bool = False  # a table macro (its body a SELECT)


# ------------------------------------------------------------------------------------------ the function map
# DuckDB functions that Spark lacks or reads differently, each rewritten into what Spark means by
# the same thing. Everything else sqlglot translates by itself (arg_max -> max_by, string_agg ...
# ORDER BY -> listagg ... WITHIN GROUP, list -> collect_list, ...), and the tests run every
# translated view on Spark against DuckDB's answer.


def _regexp_extract(node: Any) -> Any:
    """DuckDB's regexp_extract(s, p) returns the whole match; Spark's defaults to group 1."""
    import sqlglot.expressions as exp

    if node.args.get("group") is None:
        node.set("group", exp.Literal.number(0))
    return node


def _regexp_replace(node: Any) -> Any:
    """DuckDB replaces the first match unless given 'g'; Spark replaces every match. The views only
    ever pass 'g': the flag is dropped (any other flag is refused)."""
    modifiers = node.args.get("modifiers")
    if modifiers is not None:
        if modifiers.name != "g":
            raise ValueError(f"regexp_replace flags {modifiers.name!r} have no Spark translation")
        node.set("modifiers", None)
    return node


def _md5(node: Any) -> Any:
    """DuckDB's md5 of a string is hex text; so is Spark's, of the string's UTF-8 bytes (a cast to
    BINARY sqlglot adds is kept)."""
    return node


def _array_agg(node: Any) -> Any:
    """DuckDB's list(DISTINCT x ORDER BY x): Spark's collect_list drops the ORDER BY, so a distinct
    list ordered by its own values becomes array_sort(collect_set(x))."""
    import sqlglot.expressions as exp

    order = node.this
    if isinstance(order, exp.Order) and isinstance(order.this, exp.Distinct):
        (value,) = order.this.expressions
        keys = [o.this for o in order.expressions]
        if len(keys) != 1 or keys[0] != value or order.expressions[0].args.get("desc"):
            raise ValueError(f"no Spark translation for {node.sql(dialect='duckdb')}")
        return exp.Anonymous(this="array_sort", expressions=[exp.Anonymous(this="collect_set", expressions=[value])])
    if isinstance(order, exp.Order):
        raise ValueError(f"no Spark translation for {node.sql(dialect='duckdb')}")
    return node


def _unsigned(node: Any) -> Any:
    """Spark has no unsigned integers; the lake stores them signed (schemas/lake.py): a cast to
    UINTEGER or UBIGINT becomes one to BIGINT (the same value below 2**63)."""
    import sqlglot.expressions as exp

    wider = {exp.DataType.Type.UBIGINT: "BIGINT", exp.DataType.Type.UINT: "BIGINT"}
    kind = node.this
    return exp.DataType.build(wider[kind]) if kind in wider else node


FUNCTION_MAP: dict[str, Callable[[Any], Any]] = {
    "DataType": _unsigned,
    "ArrayAgg": _array_agg,
    "RegexpExtract": _regexp_extract,
    "RegexpReplace": _regexp_replace,
    "MD5": _md5,
}


def _map_functions(tree: Any) -> Any:
    def rewrite(node: Any) -> Any:
        handler = FUNCTION_MAP.get(type(node).__name__)
        return handler(node) if handler else node

    return tree.transform(rewrite)


# ------------------------------------------------------------------------------------------ macros and views


def _parse(sql: str) -> Any:
    import sqlglot

    return sqlglot.parse_one(sql, read="duckdb")


def _macros_and_views() -> tuple[dict[str, Macro], list[tuple[str, str]]]:

    macros: dict[str, Macro] = {}
    views: list[tuple[str, str]] = []
    for module in schema.modules():
        for statement in module.statements:
            created = statement.created
            if created is None:
                continue
            if created.kind in ("macro", "table macro"):
                match = _MACRO.match(statement.sql)
                if match is None:
                    raise ValueError(f"cannot read macro {created.name}")
                params = tuple(p.strip() for p in match.group(2).split(",") if p.strip())
                body = match.group(3)
                if created.name in store.LAKE_MACRO_BODIES:  # what it means on the lake
                    body = store.LAKE_MACRO_BODIES[created.name][1]
                if created.kind == "table macro":
                    body = _TABLE_BODY.match(body).group(1)
                macros[created.name.lower()] = Macro(created.name, params, _parse(body), created.kind == "table macro")
            elif created.kind == "view":
                match = _VIEW.match(statement.sql)
                if match is None:
                    raise ValueError(f"cannot read view {created.name}")
                views.append((created.name, match.group(2)))
    return macros, views


def _expand(tree: Any, macros: dict[str, Macro]) -> Any:
    """Every call of a macro replaced by its body, arguments in place of parameters: a scalar
    macro's in parentheses, a table macro's (in a FROM) as a subquery named like the macro."""
    import sqlglot.expressions as exp

    def body(call: Any, table: bool) -> Any:
        macro = macros.get(str(call.name).lower())
        if macro is None or macro.table != table:
            return None
        args = call.expressions
        if len(args) != len(macro.params):
            raise ValueError(f"{macro.name} takes {len(macro.params)} arguments, given {len(args)}")
        bound = dict(zip(macro.params, args))

        def substitute(inner: Any) -> Any:
            if isinstance(inner, exp.Column) and not inner.table and inner.name in bound:
                return exp.Paren(this=bound[inner.name].copy())
            return inner

        return _expand(macro.body.copy().transform(substitute), macros)

    def replace(node: Any) -> Any:
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Anonymous):
            expanded = body(node.this, table=True)
            if expanded is None:
                return node
            return exp.Subquery(
                this=expanded, alias=exp.TableAlias(this=exp.to_identifier(node.alias or node.this.name))
            )
        if isinstance(node, exp.Anonymous):
            expanded = body(node, table=False)
            return node if expanded is None else exp.Paren(this=expanded)
        return node

    return tree.transform(replace)


def _duckdb_only(tree: Any, skipped: dict[str, str]) -> str | None:
    """Why a view cannot run on Spark, or None: an ASOF join (Spark has none), or a view it reads that
    cannot run there."""
    import sqlglot.expressions as exp

    if any(str(join.args.get("method") or "").upper() == "ASOF" for join in tree.find_all(exp.Join)):
        return "an ASOF join (Spark SQL has none)"
    for table in tree.find_all(exp.Table):
        if table.name in skipped:
            return f"it reads {table.name}"
    return None


def spark_views() -> list[tuple[str, str]]:
    """Every packaged view Spark can run, as (name, Spark SQL SELECT), in the order they can be created."""
    return _translated()[0]


def duckdb_only_views() -> dict[str, str]:
    """The packaged views Spark SQL cannot express, each with why (DuckDB over the lake reads them all)."""
    return _translated()[1]


def _translated() -> tuple[list[tuple[str, str]], dict[str, str]]:
    macros, views = _macros_and_views()
    out, skipped = [], {}
    for name, sql in views:
        tree = _map_functions(_expand(_parse(sql), macros))
        reason = _duckdb_only(tree, skipped)
        if reason is not None:
            skipped[name] = reason
            continue
        out.append((name, tree.sql(dialect="spark")))
    return out, skipped


def _derive_correlation_ids(spark: Any) -> None:
    """`event_rows.correlation_id` of the DuckDB file, which the lake keeps inside `attrs`: read out of
    the CUDA calls' attributes as `store.table_view_sql` does for DuckDB over the lake (an unsigned
    32-bit integer, 0 meaning none)."""
    from pyspark.sql import functions as F

    names = spark.table("event_names").where(F.col("kind").isin(*CORRELATED_KINDS))
    correlated = names.select("name_id", F.lit(True).alias("correlated"))
    events = spark.table("event_rows")
    text = F.get_json_object(F.col("attrs"), "$.correlation_id")
    number = F.expr("try_cast(get_json_object(attrs, '$.correlation_id') AS BIGINT)")
    integer = F.col("correlated") & text.rlike("^[0-9]+$") & (number > 0) & (number <= 4294967295)
    derived = events.join(F.broadcast(correlated), "name_id", "left").select(
        *events.columns, F.when(integer, number).alias("correlation_id")
    )
    derived.createOrReplaceTempView("event_rows")


def register_lake(spark: Any, lake: Path, views: list[str] | None = None) -> list[str]:
    """Temp views in `spark` named like the database's tables over the lake's files, then the
    packaged views translated; returns the names of the views created."""

    lake = Path(lake)
    store.check_lake(lake)
    for table in TABLES.values():
        directory = store.table_dir(lake, table.name)
        schema = spark_schema(table.schema)
        if not store.data_files(directory):
            frame = spark.createDataFrame([], schema)
        elif table.partitioned:
            frame = spark.read.schema(schema).option("basePath", str(directory)).parquet(str(directory))
        else:
            frame = spark.read.schema(schema).parquet(*[str(p) for p in store.data_files(directory)])
        frame.select(*schema.names).createOrReplaceTempView(table.name)
    _derive_correlation_ids(spark)
    created = []
    for name, sql in spark_views():
        if views is not None and name not in views:
            continue
        spark.sql(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")
        created.append(name)
    return created
