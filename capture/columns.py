"""Arrow columns for the run's parts, built from buffers rather than by `pa.array`, `pa.scalar` or
`pa.Table.from_pylist`.

Those three first ask pyarrow's pandas shim whether the value is a pandas object, and the shim
answers by importing pandas when it is installed (PySpark's extra brings it). In a recorded program
that does not use pandas, that costs ~0.2 s of CPU and tens of MB at the first flush, runs the
imports of pandas's dependencies on the flush thread (while the program may fork), and, at
interpreter exit, registers a threading exit hook that Python refuses by then. The recorder's
buffers are already laid out as Arrow's, so the columns are made from them directly; the few
small tables of Python rows (modules, code, code origins) go through Arrow's JSON reader, which
never looks at pandas.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json


def _bitmap(valid: np.ndarray) -> pa.Buffer:
    return pa.py_buffer(np.packbits(np.asarray(valid, dtype=bool), bitorder="little"))


def fixed_width(data: bytes | np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """A column of a fixed-width type over `data` (little-endian values, no copy)."""
    width = arrow_type.bit_width // 8
    buffer = pa.py_buffer(data)
    return pa.Array.from_buffers(arrow_type, buffer.size // width, [None, buffer])


def booleans(values: np.ndarray) -> pa.Array:
    values = np.asarray(values, dtype=bool)
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, _bitmap(values)])


def values_of(array: pa.Array) -> np.ndarray:
    """The values of a fixed-width column as unsigned integers of its width (nulls included as they
    lie in the buffer), without a copy; `Array.to_numpy` would import pandas."""
    width = array.type.bit_width // 8
    return np.frombuffer(array.buffers()[1], dtype=f"<u{width}", count=len(array), offset=array.offset * width)


def _valid_of(array: pa.Array) -> np.ndarray:
    bitmap = array.buffers()[0]
    if bitmap is None or not array.null_count:
        return np.ones(len(array), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(bool)


def null_where(values: pa.Array, null: np.ndarray) -> pa.Array:
    """`values` with the rows where `null` is true made null (other nulls kept)."""
    null = np.asarray(null, dtype=bool) | ~_valid_of(values)
    if not null.any():
        return values
    if values.offset:
        values = pa.concat_arrays([values])  # a copy starting at offset 0, as the bitmap does
    return pa.Array.from_buffers(
        values.type, len(values), [_bitmap(~null), *values.buffers()[1:]], null_count=int(null.sum())
    )


def with_validity(values: pa.Array, bitmap: np.ndarray) -> pa.Array:
    """A fixed-width column of `values` (offset 0, no nulls) with Arrow's validity `bitmap` (bytes,
    least significant bit first): where a bit is clear, the value is null."""
    return pa.Array.from_buffers(values.type, len(values), [pa.py_buffer(bitmap), values.buffers()[1]])


def null_where_zero(values: pa.Array) -> pa.Array:
    """A fixed-width column with its zeros made null (the recorder writes 0 for "none")."""
    return null_where(values, values_of(values) == 0)


def strings(texts: Sequence[str | None]) -> pa.Array:
    """A string column of `texts` (None: null). Text Python cannot encode as UTF-8 (lone surrogates)
    is written with backslash escapes rather than failing the flush."""
    encoded = [b"" if t is None else t.encode("utf-8", "backslashreplace") for t in texts]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    nulls = np.fromiter((t is None for t in texts), dtype=bool, count=len(encoded))
    validity = _bitmap(~nulls) if nulls.any() else None
    large = pa.Array.from_buffers(
        pa.large_string(), len(encoded), [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )
    return large.cast(pa.string())


def empty_table(schema: pa.Schema) -> pa.Table:
    """A table of `schema` without rows (`schema.empty_table()` imports pandas)."""
    return pa.Table.from_batches([], schema)


def table_from_rows(rows: Sequence[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """A table of `schema` from Python rows (small tables: a JSON line per row through Arrow's reader)."""
    if not rows:
        return empty_table(schema)
    lines = "\n".join(json.dumps(row, ensure_ascii=False) for row in rows).encode("utf-8", "backslashreplace")
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    # The reader keeps the types but not the fields' nullability or the schema's metadata.
    return pa_json.read_json(io.BytesIO(lines), parse_options=options).cast(schema)
