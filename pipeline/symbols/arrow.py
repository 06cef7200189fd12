"""Symbolization results as an Arrow table, built column by column with numpy (no per-frame
Python objects), for the DuckDB ingest: one row per frame, `columns.arrow_schema()`.

String columns come dictionary-encoded (each build-ID's string table is the dictionary), which
DuckDB scans without copying; `dictionary=False` decodes them to plain strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tbpipe.pipeline.symbols import demangle as demangling
from tbpipe.pipeline.symbols.columns import arrow_schema

INVALID_RETURN_ADDRESS = "invalid address: a return address of 0"


def results_to_arrow(
    lookups: Sequence[tuple[Any, Any, Any, Any, Any]], demangle: bool = True, dictionary: bool = True
) -> Any:
    """lookups: (state, known table, entry per address (-1 invalid), address, exact) per module."""
    import numpy as np
    import pyarrow as pa

    schema = arrow_schema()
    names = [f.name for f in schema]
    tables = []
    for state, known, entries, address, exact in lookups:
        count = len(entries)
        if count == 0:
            continue
        valid = entries >= 0
        safe = np.where(valid, entries, 0)
        strings = list(known.strings)
        if len(known.counts):
            counts = np.where(valid, np.frombuffer(known.counts, dtype=np.uint32)[safe].astype(np.int64), 0)
            starts = np.where(valid, np.frombuffer(known.starts, dtype=np.uint64)[safe].astype(np.int64), 0)
            reasons = np.where(valid, np.frombuffer(known.reasons, dtype=np.int32)[safe], -1).astype(np.int64)
        else:
            counts = np.zeros(count, dtype=np.int64)
            starts = np.zeros(count, dtype=np.int64)
            reasons = np.full(count, -1, dtype=np.int64)
        if not valid.all():
            # The only invalid lookup an array can hold: a return address of 0.
            reasons[~valid] = len(strings)
            strings.append(INVALID_RETURN_ADDRESS)

        rows = np.maximum(counts, 1)  # an unsymbolized address still gets one row
        total = int(rows.sum())
        owner = np.repeat(np.arange(count), rows)
        first_row = np.cumsum(rows) - rows
        depth = np.arange(total, dtype=np.int64) - first_row[owner]
        has_frame = counts[owner] > 0
        frame_index = np.where(has_frame, starts[owner] + depth, 0)
        if len(known.functions):
            functions = np.where(has_frame, np.frombuffer(known.functions, dtype=np.int32)[frame_index], -1)
            files = np.where(has_frame, np.frombuffer(known.files, dtype=np.int32)[frame_index], -1)
            lines = np.where(has_frame, np.frombuffer(known.lines, dtype=np.uint32)[frame_index], 0).astype(np.int32)
            inlined = has_frame & np.frombuffer(known.inlined, dtype=np.uint8)[frame_index].astype(bool)
        else:
            functions = files = np.full(total, -1, dtype=np.int32)
            lines = np.zeros(total, dtype=np.int32)
            inlined = np.zeros(total, dtype=bool)
        reason_rows = np.where(depth == 0, reasons[owner], -1)

        if demangle:
            used = np.unique(functions[functions >= 0]).tolist()
            demangled = demangling.demangle_many(strings[i] for i in used)
            for i in used:
                strings[i] = demangled[strings[i]]
        values = pa.array(strings, type=pa.string())

        def encoded(ids: Any, values: Any = values) -> Any:
            ids = np.asarray(ids, dtype=np.int32)
            array = pa.DictionaryArray.from_arrays(pa.array(ids, mask=ids < 0), values)
            return array if dictionary else array.dictionary_decode()

        build_id = state.status.build_id or ""
        if dictionary:
            build_ids = pa.DictionaryArray.from_arrays(pa.array(np.zeros(total, dtype=np.int32)), pa.array([build_id]))
        else:
            build_ids = pa.array([build_id] * total, type=pa.string())
        columns = [
            build_ids,
            pa.array(np.asarray(address, dtype=np.uint64)[owner]),
            pa.array(np.asarray(exact, dtype=bool)[owner]),
            pa.array(depth.astype(np.int32)),
            encoded(functions),
            encoded(files),
            pa.array(lines, mask=lines == 0),
            pa.array(inlined),
            encoded(reason_rows),
        ]
        tables.append(pa.Table.from_arrays(columns, names=names))
    if not tables:
        return schema.empty_table()
    if dictionary:
        return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    return pa.concat_tables(tables).cast(schema)
