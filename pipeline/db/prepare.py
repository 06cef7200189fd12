"""A raw run's stacks, columnar and ready to load: frames flattened, stacks hashed.

Everything here works on whole columns (pyarrow compute and numpy); nothing loops per event,
stack or frame in Python. Strings are hashed by DuckDB (`md5_number_lower`), which is fixed by
the MD5 definition and so stable across versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db import stackhash
from tbpipe.pipeline.db.connection import query_arrow
from tbpipe.schemas.raw import NATIVE_FRAME_BY_FRAME_POINTER, NATIVE_FRAME_EVAL_LOOP, PYTHON_FRAME_LINE_RESOLVED

_BUILD_ID = r"^([0-9a-f]{2}){2,64}$"


@dataclass
class FrameColumns:
    """Flattened frames of the run's distinct raw stacks (innermost first within each stack)."""

    parent: np.ndarray  # int64: index into PreparedRun's per-stack arrays
    idx: np.ndarray  # int32: position within the stack's native or Python list
    ref: np.ndarray  # int64: row of `modules` / `code`, -1 when the run does not describe it
    value: np.ndarray  # native: ELF address (uint64); Python: line (int32, -1 unknown)
    flags: np.ndarray  # uint32


@dataclass
class PreparedRun:
    modules: pa.Table  # module_index, build_id (module key), path, load_bias, exec_ranges
    code: pa.Table  # code_id, filename, qualname, first_line (distinct code ids)
    raw_ids: np.ndarray  # uint64, sorted distinct raw stack ids
    status: np.ndarray  # uint32 per distinct raw stack
    native_lengths: np.ndarray  # int64 per distinct raw stack
    python_lengths: np.ndarray  # int64 per distinct raw stack
    hashes: np.ndarray  # uint64 per distinct raw stack: stackhash.stack_hashes
    native: FrameColumns
    python: FrameColumns


def _numpy(column: pa.ChunkedArray | pa.Array, dtype) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if len(column) == 0:
        return np.zeros(0, dtype=dtype)
    return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def md5_lower(con, values: pa.Array) -> np.ndarray:
    """Low 64 bits of each string's MD5, as uint64 (same order as `values`)."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.uint64)
    table = pa.table({"pos": pa.array(np.arange(len(values), dtype=np.int64)), "text": values})
    con.register("prepare_strings", table)
    try:
        result = query_arrow(con, "SELECT md5_number_lower(text) AS h FROM prepare_strings ORDER BY pos")
    finally:
        con.unregister("prepare_strings")
    return _numpy(result["h"], np.uint64)


def module_keys(modules: pa.Table) -> pa.Array:
    """`modules.build_id` of each raw module row: the normalized build-ID, or 'path:'/'invalid:' + text."""
    build_id = modules["build_id"].combine_chunks() if modules.num_rows else pa.array([], pa.string())
    path = modules["path"].combine_chunks() if modules.num_rows else pa.array([], pa.string())
    lowered = pc.utf8_lower(pc.utf8_trim_whitespace(build_id))
    lowered = pc.if_else(pc.starts_with(lowered, "0x"), pc.utf8_slice_codeunits(lowered, 2), lowered)
    valid = pc.fill_null(pc.match_substring_regex(lowered, _BUILD_ID), False)
    absent = pc.or_kleene(pc.is_null(build_id), pc.equal(pc.fill_null(build_id, ""), ""))
    without = pc.binary_join_element_wise("path:", path, "")
    invalid = pc.binary_join_element_wise("invalid:", pc.fill_null(build_id, ""), "")
    return pc.if_else(valid, lowered, pc.if_else(absent, without, invalid))


def _lookup(sorted_keys: np.ndarray, order: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Row (via `order`) of each wanted key in sorted_keys, -1 where absent."""
    if len(sorted_keys) == 0:
        return np.full(len(wanted), -1, dtype=np.int64)
    pos = np.searchsorted(sorted_keys, wanted)
    pos_clipped = np.minimum(pos, len(sorted_keys) - 1)
    found = sorted_keys[pos_clipped] == wanted
    return np.where(found, order[pos_clipped], -1).astype(np.int64)


def _is_identity(rows: np.ndarray, count: int) -> bool:
    return len(rows) == count and bool(np.array_equal(rows, np.arange(count)))


def _frames(lists: pa.ChunkedArray, rows: np.ndarray, ref_field: str, value_field: str) -> tuple[np.ndarray, ...]:
    """(parent, idx, ref values, values, flags) of the frames of `rows` of a list<struct> column."""
    chosen = lists if _is_identity(rows, len(lists)) else lists.take(pa.array(rows, pa.int64()))
    chosen = chosen.combine_chunks() if isinstance(chosen, pa.ChunkedArray) else chosen
    lengths = _numpy(pc.list_value_length(chosen), np.int64)
    flat = pc.list_flatten(chosen)
    parent = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    idx = (np.arange(len(parent), dtype=np.int64) - np.repeat(starts, lengths)).astype(np.int32)
    return (
        parent,
        idx,
        lengths,
        _numpy(pc.struct_field(flat, ref_field), np.int64 if ref_field == "module" else np.uint64),
        pc.struct_field(flat, value_field),
        _numpy(pc.struct_field(flat, "flags"), np.uint32),
    )


def prepare_run(tables: dict[str, pa.Table], con) -> PreparedRun:
    """Hashes and flattens a run's stacks, modules and code; `con` is any DuckDB connection (for MD5)."""
    stacks = tables["stacks"]

    # Modules: key and hash per row, and a dense map from module_index to row.
    raw_modules = tables["modules"]
    keys = module_keys(raw_modules)
    modules = pa.table(
        {
            "module_index": raw_modules["module_index"],
            "build_id": keys,
            "path": raw_modules["path"],
            "load_bias": raw_modules["load_bias"],
            "exec_ranges": raw_modules["exec_ranges"],
        }
    )
    module_hash = md5_lower(con, keys)
    module_index = _numpy(raw_modules["module_index"], np.int64)
    module_order = np.argsort(module_index, kind="stable")

    # Code objects: distinct ids, hash over (file, qualname, first line).
    code_table = tables["code"]
    code_ids_all = _numpy(code_table["code_id"], np.uint64)
    code_ids, first_rows = np.unique(code_ids_all, return_index=True)
    code = (
        code_table
        if _is_identity(first_rows, code_table.num_rows)
        else code_table.take(pa.array(first_rows, pa.int64()))
    )
    code_text = pc.binary_join_element_wise(
        code["filename"], code["qualname"], pc.cast(code["first_line"], pa.string()), "\x1f"
    )
    code_hash = md5_lower(con, code_text.combine_chunks() if isinstance(code_text, pa.ChunkedArray) else code_text)

    # Distinct raw stacks (a run holds each once; duplicates would be harmless but are dropped).
    raw_ids_all = _numpy(stacks["stack_id"], np.uint64)
    raw_ids, stack_rows = np.unique(raw_ids_all, return_index=True)
    status = _numpy(stacks["status"], np.uint32)[stack_rows]

    n_parent, n_idx, n_len, n_module, n_offset, n_flags = _frames(stacks["native"], stack_rows, "module", "offset")
    n_offset = _numpy(n_offset, np.uint64)
    n_ref = _lookup(module_index[module_order], module_order, n_module)
    n_hash = np.where(
        n_ref >= 0, module_hash[np.maximum(n_ref, 0)] if len(module_hash) else stackhash.MISSING, stackhash.MISSING
    )
    # An eval-loop frame is replaced by the Python frames it ran; where in the eval loop it was
    # (which specialized instruction) is noise that must not split one stack into several.
    hashed_offset = np.where((n_flags & NATIVE_FRAME_EVAL_LOOP) != 0, np.uint64(0), n_offset)
    native_keys = stackhash.native_frame_keys(
        n_hash, hashed_offset, n_flags & ~np.uint32(NATIVE_FRAME_BY_FRAME_POINTER)
    )

    p_parent, p_idx, p_len, p_code, p_line, p_flags = _frames(stacks["python"], stack_rows, "code_id", "line")
    p_line = _numpy(p_line, np.int32)
    p_ref = _lookup(code_ids, np.arange(len(code_ids), dtype=np.int64), p_code)
    p_hash = np.where(
        p_ref >= 0,
        code_hash[np.maximum(p_ref, 0)] if len(code_hash) else stackhash.MISSING,
        stackhash.mix64(p_code ^ stackhash.MISSING),
    )
    python_keys = stackhash.python_frame_keys(p_hash, p_line, p_flags & ~np.uint32(PYTHON_FRAME_LINE_RESOLVED))

    hashes = stackhash.stack_hashes(native_keys, n_len, python_keys, p_len, status)

    return PreparedRun(
        modules=modules,
        code=code,
        raw_ids=raw_ids,
        status=status,
        native_lengths=n_len,
        python_lengths=p_len,
        hashes=hashes,
        native=FrameColumns(n_parent, n_idx, n_ref, n_offset, n_flags),
        python=FrameColumns(p_parent, p_idx, p_ref, p_line, p_flags),
    )
