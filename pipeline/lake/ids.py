"""Content-derived 64-bit ids of the lake's rows, the same whichever engine or machine computes them.

The DuckDB file numbers runs, names, frames and sites as it meets them; executors of a distributed
job cannot share a counter, so the lake names each thing by a hash of what it is:

- a stack: its portable hash (`schemas.identity`), the uint64's bits as a signed int64;
- a run: the low 63 bits of the MD5 of its run id (non-negative: it names partition folders);
- an event name: the low 63 bits of the MD5 of kind + US + name;
- a frame: the low 63 bits of the MD5 of all its columns (`frame_ids`);
- a site: the 16 hex digits of its `site_key` (already an MD5 prefix) as a signed int64.

63 and 64 bits make collisions negligible at any size the lake will see (a billion distinct
frames collide with probability ~5e-2 only past 2**31.5 of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.schemas.identity import md5_low64

_LOW63 = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_NULL = "\x00"
_SEP = "\x1f"


def signed(values: np.ndarray) -> np.ndarray:
    """uint64 values as int64 with the same bits."""
    return np.asarray(values, dtype=np.uint64).view(np.int64)


def unsigned(values: np.ndarray) -> np.ndarray:
    """int64 values as uint64 with the same bits."""
    return np.asarray(values, dtype=np.int64).view(np.uint64)


def _low63(texts: Sequence[str]) -> np.ndarray:
    return (md5_low64(texts) & _LOW63).astype(np.int64)


def run_numbers(run_ids: Sequence[str]) -> np.ndarray:
    return _low63(list(run_ids))


def run_number(run_id: str) -> int:
    return int(run_numbers([run_id])[0])


def name_ids(kinds: Sequence[str], names: Sequence[str]) -> np.ndarray:
    return _low63([f"{kind}{_SEP}{name}" for kind, name in zip(kinds, names)])


def site_ids(site_keys: pa.Array | Sequence[str | None]) -> pa.Array:
    """int64 per site key (16 hex digits); null for a null key."""
    keys = site_keys.to_pylist() if isinstance(site_keys, (pa.Array, pa.ChunkedArray)) else list(site_keys)
    values = np.array([int(k, 16) if k else 0 for k in keys], dtype=np.uint64)
    return pa.array(signed(values), pa.int64(), mask=np.array([not k for k in keys], dtype=bool))


# The columns that make a frame what it is, with the types their text is taken in.
FRAME_CONTENT = (
    ("kind", pa.string()),
    ("function", pa.string()),
    ("file", pa.string()),
    ("line", pa.int64()),
    ("first_line", pa.int64()),
    ("module", pa.string()),
    ("module_key", pa.string()),
    ("address", pa.uint64()),
    ("exact", pa.bool_()),
    ("inlined", pa.bool_()),
    ("reason", pa.string()),
)


def _text(column: pa.Array | pa.ChunkedArray, type_: pa.DataType) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_integer(type_) and column.type != type_:
        # Addresses are stored signed in the lake and unsigned in DuckDB: the same bits.
        if pa.types.is_uint64(type_) and pa.types.is_int64(column.type):
            column = pa.Array.from_buffers(pa.uint64(), len(column), column.buffers(), offset=column.offset)
        else:
            column = column.cast(type_)
    return pc.fill_null(column.cast(pa.string()), _NULL)


def frame_ids(frames: pa.Table) -> pa.Array:
    """The id of each frame (a table with the FRAME_CONTENT columns: `layout.Frames.frames`, the
    database's `frames` or the lake's)."""
    if frames.num_rows == 0:
        return pa.array([], pa.int64())
    texts = pc.binary_join_element_wise(*(_text(frames[name], type_) for name, type_ in FRAME_CONTENT), _SEP)
    return pa.array(_low63(texts.to_pylist()), pa.int64())
