"""A raw run's stacks made columnar: frames flattened, modules keyed, stacks hashed (`flatten_run`).

Everything here works on whole columns (pyarrow compute and numpy); nothing loops per event,
stack or frame in Python. Only each distinct module key and code object is hashed one by one
(`identity.md5_low64`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.stacks import identity
from tbpipe.pipeline.stacks.origins import splice_origins
from tbpipe.pipeline.symbols.modulekey import module_key_column
from tbpipe.schemas.raw import NATIVE_FRAME_BY_FRAME_POINTER, NATIVE_FRAME_EVAL_LOOP, PYTHON_FRAME_LINE_RESOLVED


@dataclass
class FrameColumns:
    """Flattened frames of the run's distinct raw stacks (innermost first within each stack)."""

    parent: np.ndarray  # int64: index into FlatRun's per-stack arrays
    idx: np.ndarray  # int32: position within the stack's native or Python list
    ref: np.ndarray  # int64: row of `modules` / `code`, -1 when the run does not describe it
    value: np.ndarray  # native: ELF address (uint64); Python: line (int32, -1 unknown)
    flags: np.ndarray  # uint32


@dataclass
class FlatRun:
    """One run's distinct raw stacks, flattened, with the module and code tables they refer to."""

    modules: pa.Table  # module_index, module_key, path, load_bias, exec_ranges
    code: pa.Table  # code_id, filename, qualname, first_line (distinct code ids)
    raw_ids: np.ndarray  # uint64, sorted distinct raw stack ids
    status: np.ndarray  # uint32 per distinct raw stack
    native_lengths: np.ndarray  # int64 per distinct raw stack
    python_lengths: np.ndarray  # int64 per distinct raw stack
    hashes: np.ndarray  # uint64 per distinct raw stack: identity.stack_hashes
    native: FrameColumns
    python: FrameColumns


def _flat(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _numpy(column: pa.ChunkedArray | pa.Array, dtype) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if len(column) == 0:
        return np.zeros(0, dtype=dtype)
    return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


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


def flatten_run(tables: dict[str, pa.Table]) -> FlatRun:
    """Flattens and hashes a run's `stacks`, `modules` and `code` tables (schemas.raw), with the frames
    of its `code_origins` (when it has that table) placed inside the generated frames (`origins`)."""
    tables = splice_origins(tables)
    stacks = tables["stacks"]

    # Modules: key and hash per row, and a dense map from module_index to row.
    raw_modules = tables["modules"]
    keys = module_key_column(_flat(raw_modules["build_id"]), _flat(raw_modules["path"]))
    modules = pa.table(
        {
            "module_index": raw_modules["module_index"],
            "module_key": keys,
            "path": raw_modules["path"],
            "load_bias": raw_modules["load_bias"],
            "exec_ranges": raw_modules["exec_ranges"],
        }
    )
    module_hash = identity.md5_low64(keys.to_pylist())
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
    code_hash = identity.md5_low64(_flat(code_text).to_pylist())

    # Distinct raw stacks (a run holds each once; duplicates would be harmless but are dropped).
    raw_ids_all = _numpy(stacks["stack_id"], np.uint64)
    raw_ids, stack_rows = np.unique(raw_ids_all, return_index=True)
    status = _numpy(stacks["status"], np.uint32)[stack_rows]

    n_parent, n_idx, n_len, n_module, n_offset, n_flags = _frames(stacks["native"], stack_rows, "module", "offset")
    n_offset = _numpy(n_offset, np.uint64)
    n_ref = _lookup(module_index[module_order], module_order, n_module)
    n_hash = np.where(
        n_ref >= 0, module_hash[np.maximum(n_ref, 0)] if len(module_hash) else identity.MISSING, identity.MISSING
    )
    # An eval-loop frame is replaced by the Python frames it ran; where in the eval loop it was
    # (which specialized instruction) is noise that must not split one stack into several.
    hashed_offset = np.where((n_flags & NATIVE_FRAME_EVAL_LOOP) != 0, np.uint64(0), n_offset)
    native_keys = identity.native_frame_keys(n_hash, hashed_offset, n_flags & ~np.uint32(NATIVE_FRAME_BY_FRAME_POINTER))

    p_parent, p_idx, p_len, p_code, p_line, p_flags = _frames(stacks["python"], stack_rows, "code_id", "line")
    p_line = _numpy(p_line, np.int32)
    p_ref = _lookup(code_ids, np.arange(len(code_ids), dtype=np.int64), p_code)
    p_hash = np.where(
        p_ref >= 0,
        code_hash[np.maximum(p_ref, 0)] if len(code_hash) else identity.MISSING,
        identity.mix64(p_code ^ identity.MISSING),
    )
    python_keys = identity.python_frame_keys(p_hash, p_line, p_flags & ~np.uint32(PYTHON_FRAME_LINE_RESOLVED))

    hashes = identity.stack_hashes(native_keys, n_len, python_keys, p_len, status)

    return FlatRun(
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


def concat_flat_runs(runs: list[FlatRun]) -> tuple[FlatRun, np.ndarray]:
    """Several runs' flattened stacks as one (modules and code tables appended, references shifted),
    and the index in `runs` of each stack's run. Raw stack ids stay each run's own."""
    if len(runs) == 1:
        return runs[0], np.zeros(len(runs[0].raw_ids), dtype=np.int64)

    def shifted(columns: list[FrameColumns], stacks: list[int], tables: list[int]) -> FrameColumns:
        stack_base = np.cumsum([0, *stacks[:-1]])
        table_base = np.cumsum([0, *tables[:-1]])
        return FrameColumns(
            parent=np.concatenate([c.parent + b for c, b in zip(columns, stack_base)]),
            idx=np.concatenate([c.idx for c in columns]),
            ref=np.concatenate([np.where(c.ref >= 0, c.ref + b, -1) for c, b in zip(columns, table_base)]),
            value=np.concatenate([c.value for c in columns]),
            flags=np.concatenate([c.flags for c in columns]),
        )

    stacks = [len(r.raw_ids) for r in runs]
    flat = FlatRun(
        modules=pa.concat_tables([r.modules for r in runs]),
        code=pa.concat_tables([r.code for r in runs]),
        raw_ids=np.concatenate([r.raw_ids for r in runs]),
        status=np.concatenate([r.status for r in runs]),
        native_lengths=np.concatenate([r.native_lengths for r in runs]),
        python_lengths=np.concatenate([r.python_lengths for r in runs]),
        hashes=np.concatenate([r.hashes for r in runs]),
        native=shifted([r.native for r in runs], stacks, [r.modules.num_rows for r in runs]),
        python=shifted([r.python for r in runs], stacks, [r.code.num_rows for r in runs]),
    )
    return flat, np.repeat(np.arange(len(runs)), stacks)
