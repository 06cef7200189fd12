"""An op event's attributes: typed columns in raw parts (schema 5 on), JSON text in the database.

The torch-ops observer records an op's attributes as the events table's `op_*` columns (formatting
JSON text for each op was most of what recording an op cost); the database and the lake keep every
event's attributes as JSON text in `attrs`. This module is the one home of the rule that makes that
text from the columns: OP_ATTRIBUTES (each key and its column, in the text's order), the reference
`op_attrs_text` for one event, and the same rule as DuckDB SQL, which both the database's ingest and
the lake's (its prepare step writes each run's events through DuckDB) use and the tests hold to the
reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# (key in the JSON text, column of the events table), in the order the text lists them: the order the
# observer wrote them in raw schema 4 and before, when they were JSON text in `attrs`.
OP_ATTRIBUTES = (
    ("id", "op_id"),
    ("depth", "op_depth"),
    ("parent", "op_parent"),
    ("seq", "op_seq"),
    ("seq_thread", "op_seq_thread"),
    ("bwd_seq", "op_bwd_seq"),
    ("fwd_thread", "op_fwd_thread"),
    ("bwd_node", "op_bwd_node"),
    ("scope", "op_scope"),
)
OP_COLUMNS = tuple(column for _key, column in OP_ATTRIBUTES)
_TEXT_KEYS = {"bwd_node", "scope"}  # string values; the others are integers


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _json_string(text: str) -> str:
    """`text` as a JSON string, escaped as DuckDB and Spark escape it (other control characters as
    \\u00XX, in capitals; everything else as it is)."""
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if c < " " else c) for c in text) + '"'


def op_attrs_text(row: Mapping[str, Any]) -> str | None:
    """The attributes' JSON text of an event whose op_* columns hold `row`'s values (a missing or
    None value: null): compact, keys in OP_ATTRIBUTES' order, null ones left out; None for an event
    that is not an op (no op_id)."""
    if row.get("op_id") is None:
        return None
    members = [
        f'"{key}":' + (_json_string(row[column]) if key in _TEXT_KEYS else str(int(row[column])))
        for key, column in OP_ATTRIBUTES
        if row.get(column) is not None
    ]
    return "{" + ",".join(members) + "}"


def event_attrs_text(row: Mapping[str, Any]) -> str | None:
    """An event's attributes as the database keeps them: an op's from its op_* columns, any other
    event's `attrs` as written."""
    return op_attrs_text(row) if row.get("op_id") is not None else row.get("attrs")


def event_attrs_sql(alias: str, attrs: str) -> str:
    """DuckDB SQL of `event_attrs_text` for the raw event `alias` (read from an events part, its op_*
    columns NULL in parts older than raw schema 5), `attrs` being the SQL of its other attributes."""
    members = ", ".join(
        f"'\"{key}\":' || "
        + (f"to_json({alias}.{column})" if key in _TEXT_KEYS else f"CAST({alias}.{column} AS VARCHAR)")
        for key, column in OP_ATTRIBUTES
    )
    # `||` with a NULL is NULL and concat_ws skips NULLs: null attributes are left out.
    return f"CASE WHEN {alias}.op_id IS NULL THEN {attrs} ELSE '{{' || concat_ws(',', {members}) || '}}' END"
