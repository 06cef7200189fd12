"""Generated code followed back to the user's lines: a run's `code_origins` placed into its stacks.

torch.compile runs a program's ops and kernels from code it generated (Inductor's wrappers, FX and
AOTAutograd code); the capture records, per range of generated lines, the user frames the graph
node came from (`schemas.raw.code_origins_schema`). Here, before a run's stacks are hashed, each
Python frame of a generated line that has such a row gets those frames placed right inside it,
innermost first, flagged ORIGIN_FLAG: the layout marks them inlined (a user line compiled into the
generated frame), and the siting finds the user's line there as in an eager run. Stacks that hold
no generated frame with a row are left as they are; their raw ids do not change either way.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.schemas import raw

# Python frame flag of a frame placed from `code_origins` (never written by the capture: above the
# bits schemas.raw defines for Python frames).
ORIGIN_FLAG = 1 << 16
# Synthetic code ids of the origin frames' functions start here (a range the capture's ids never reach).
_ORIGIN_CODE_BASE = 0xF0F0_0000_0000_0000


def splice_origins(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """`tables` (a run's stacks, code and code_origins) with the origin frames placed into the stacks."""
    origins = tables.get("code_origins")
    if origins is None or origins.num_rows == 0:
        return tables
    stacks, code = tables["stacks"], tables["code"]
    python = stacks["python"].combine_chunks() if isinstance(stacks["python"], pa.ChunkedArray) else stacks["python"]
    frames = pc.list_flatten(python)
    if len(frames) == 0 or code.num_rows == 0:
        return tables
    code_ids = pc.struct_field(frames, "code_id").to_numpy(zero_copy_only=False).astype(np.uint64)
    lines = pc.struct_field(frames, "line").to_numpy(zero_copy_only=False).astype(np.int64)

    # Which frames run a generated line that has a row: looked up once per distinct (code, line).
    ranges = _ranges_by_file(origins)
    code_file = dict(zip(code["code_id"].to_pylist(), code["filename"].to_pylist()))
    generated_codes = np.array([i for i, f in code_file.items() if f in ranges], dtype=np.uint64)
    candidates = np.flatnonzero(np.isin(code_ids, generated_codes))
    if not len(candidates):
        return tables
    origin_of = np.full(len(frames), -1, dtype=np.int64)
    pairs, inverse = np.unique(
        np.stack([code_ids[candidates], lines[candidates].astype(np.uint64)]), axis=1, return_inverse=True
    )
    found = np.array(
        [_row_for(ranges[code_file[int(c)]], int(line)) for c, line in zip(pairs[0], pairs[1].astype(np.int64))],
        dtype=np.int64,
    )
    origin_of[candidates] = found[inverse.ravel()]
    if not (origin_of >= 0).any():
        return tables

    # The origin frames of each row (innermost first), with a code row per distinct function.
    origin_lists = (
        origins["origin"].combine_chunks() if isinstance(origins["origin"], pa.ChunkedArray) else origins["origin"]
    )
    origin_lengths = pc.list_value_length(origin_lists).to_numpy(zero_copy_only=False).astype(np.int64)
    origin_starts = np.cumsum(origin_lengths) - origin_lengths
    flat_origin = pc.list_flatten(origin_lists)
    functions = pa.table(
        {
            "filename": pc.struct_field(flat_origin, "filename"),
            "qualname": pc.struct_field(flat_origin, "qualname"),
            "first_line": pc.struct_field(flat_origin, "first_line"),
        }
    )
    keys = list(zip(*(functions[c].to_pylist() for c in ("filename", "qualname", "first_line"))))
    distinct = list(dict.fromkeys(keys))
    taken = set(code_file)
    new_ids, next_id = [], _ORIGIN_CODE_BASE
    for _ in distinct:
        while next_id in taken:
            next_id += 1
        new_ids.append(next_id)
        next_id += 1
    id_of = dict(zip(distinct, new_ids))
    origin_code = np.array([id_of[k] for k in keys], dtype=np.uint64)
    origin_line = pc.struct_field(flat_origin, "line").to_numpy(zero_copy_only=False).astype(np.int32)

    # Each frame becomes its origin frames (if any) followed by itself.
    extra = np.where(origin_of >= 0, origin_lengths[np.maximum(origin_of, 0)], 0)
    sizes = extra + 1
    out_start = np.cumsum(sizes) - sizes
    total = int(sizes.sum())
    owner = np.repeat(np.arange(len(frames)), sizes)
    within = np.arange(total) - out_start[owner]
    is_origin = within < extra[owner]
    source_origin = origin_starts[np.maximum(origin_of[owner], 0)] + within
    source_origin = np.where(is_origin, source_origin, 0)
    out_code = np.where(is_origin, origin_code[source_origin], code_ids[owner])
    out_line = np.where(is_origin, origin_line[source_origin], lines[owner].astype(np.int32))
    offsets_in = pc.struct_field(frames, "offset").to_numpy(zero_copy_only=False).astype(np.int32)
    flags_in = pc.struct_field(frames, "flags").to_numpy(zero_copy_only=False).astype(np.uint32)
    out_offset = np.where(is_origin, np.int32(-1), offsets_in[owner])
    out_flags = np.where(is_origin, np.uint32(ORIGIN_FLAG), flags_in[owner])
    frame_struct = pa.StructArray.from_arrays(
        [
            pa.array(out_code, pa.uint64()),
            pa.array(out_offset, pa.int32()),
            pa.array(out_line.astype(np.int32), pa.int32()),
            pa.array(out_flags.astype(np.uint32), pa.uint32()),
        ],
        fields=list(raw.PYTHON_FRAME),
    )
    list_offsets = python.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    list_offsets = list_offsets - list_offsets[0]
    grown = np.concatenate([[0], np.cumsum(sizes)])[list_offsets]
    new_python = pa.ListArray.from_arrays(pa.array(grown, pa.int32()), frame_struct)
    new_stacks = stacks.set_column(stacks.schema.get_field_index("python"), stacks.schema.field("python"), new_python)

    new_code = pa.table(
        {
            "code_id": pa.array(new_ids, pa.uint64()),
            "filename": pa.array([k[0] for k in distinct], pa.string()),
            "qualname": pa.array([k[1] for k in distinct], pa.string()),
            "first_line": pa.array([k[2] for k in distinct], pa.int32()),
        },
        schema=code.schema,
    )
    return {**tables, "stacks": new_stacks, "code": pa.concat_tables([code, new_code])}


def _ranges_by_file(origins: pa.Table) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Per generated file: its rows' (line_lo, line_hi, row) sorted by line_lo; of rows with equal ranges
    the last written is kept."""
    by_file: dict[str, dict[tuple[int, int], int]] = {}
    for row, (file, lo, hi) in enumerate(
        zip(origins["file"].to_pylist(), origins["line_lo"].to_pylist(), origins["line_hi"].to_pylist())
    ):
        by_file.setdefault(file, {})[(lo, hi)] = row
    out = {}
    for file, rows in by_file.items():
        ordered = sorted(rows.items())
        out[file] = ([lo for (lo, _hi), _r in ordered], [hi for (_lo, hi), _r in ordered], [r for _k, r in ordered])
    return out


def _row_for(ranges: tuple[list[int], list[int], list[int]], line: int) -> int:
    """The row whose range holds `line` (the one starting last), -1 when none does."""
    los, his, rows = ranges
    at = bisect.bisect_right(los, line) - 1
    while at >= 0:
        if his[at] >= line:
            return rows[at]
        at -= 1
    return -1
