"""Turns what the native recorder drained into the run directory's Parquet files.

Columnar all the way: the drained buffers are raw little-endian arrays that
become Arrow arrays without a Python loop per event; only attribute dicts
(from `record(..., **attrs)`) are serialized one by one.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tbpipe import _native
from tbpipe.capture import columns
from tbpipe.capture.manifest import note_counters, write_manifest
from tbpipe.schemas import raw
from tbpipe.schemas.identity import code_hashes, hash_stack_lists, module_hashes

# zstd level 3 keeps the flusher cheap; repeated stack ids and names are
# dictionary-encoded by Parquet, timestamps delta-encoded.
_PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "compression_level": 3, "write_page_checksum": True}
# Parts of timestamped rows (events, GPU graph nodes) at level 1: most of an events part's bytes
# are attributes that differ in every event, which level 3 compresses no better in twice the time,
# and the flusher writes a part per second. Stacks keep level 3 (markedly smaller there, for little
# more time).
_EVENTS_COMPRESSION_LEVEL = 1
# A CUDA call's correlation id counts up across the process: delta-packed, about a byte an event; so
# do an op's id, its parent's and autograd's sequence numbers (each close to the event's before).
_EVENTS_ENCODING = {
    "ts": "DELTA_BINARY_PACKED",
    "thread_id": "DELTA_BINARY_PACKED",
    "correlation_id": "DELTA_BINARY_PACKED",
    "op_id": "DELTA_BINARY_PACKED",
    "op_parent": "DELTA_BINARY_PACKED",
    "op_seq": "DELTA_BINARY_PACKED",
    "op_bwd_seq": "DELTA_BINARY_PACKED",
}
# Attributes are often unique per event (an op's id), and a stack's hash is unique in its part: a
# dictionary would only be built to be dropped.
_NOT_DICTIONARY = {"attrs", "stack_hash"}
# Statistics (each page's min and max, its nulls) cost the flusher a comparison per value and column;
# of a timestamped part's, readers use those of these columns only (the ingest counts the events
# without a stack from the footer).
_STATISTICS = ["ts", "stack_id"]
# A timestamped part's pages hold up to a flush's rows (Arrow's default cuts a page every 20,000):
# fewer page headers, checksums and compression contexts, and its delta-packed ids and mostly-null
# op columns compress better in long pages; values go to the encoders in larger batches too.
_EVENTS_PAGES = {"max_rows_per_page": 1 << 20, "data_page_size": 8 << 20, "write_batch_size": 1 << 16}
# Older pyarrow releases have no row cap per page and refuse the keyword: there, the page size
# alone, and Arrow's default row count a page.
if "max_rows_per_page" not in inspect.signature(pq.ParquetWriter.__init__).parameters:
    del _EVENTS_PAGES["max_rows_per_page"]


def parquet_options(column_names: list[str]) -> dict[str, Any]:
    """`pq.write_table`'s options for a part with these columns, as the capture writes every part."""
    timestamped = "ts" in column_names
    encoding = {c: e for c, e in _EVENTS_ENCODING.items() if c in column_names} if timestamped else None
    return {
        "use_dictionary": [c for c in column_names if c not in _NOT_DICTIONARY and (not encoding or c not in encoding)],
        "column_encoding": encoding,
        **_PARQUET_OPTIONS,
        **({"compression_level": _EVENTS_COMPRESSION_LEVEL} if timestamped else {}),
        **({"write_statistics": [c for c in _STATISTICS if c in column_names]} if timestamped else {}),
        **(_EVENTS_PAGES if timestamped else {}),
    }


def _attrs_column(drained: dict[str, Any], count: int) -> pa.Array:
    """The events' attributes as JSON text, null where an event has none.

    Native sources hand over their JSON as one buffer with offsets, laid out as Arrow's (large)
    string column already; only record()'s dicts from Python are serialized one by one.
    """
    offsets = pa.py_buffer(drained["attr_offsets"])
    texts = pa.LargeStringArray.from_buffers(count, offsets, pa.py_buffer(drained["attr_text"])).cast(pa.string())
    objects = drained["attr_objects"]
    if objects:
        mask = np.zeros(count, dtype=bool)
        mask[[event for event, _ in objects]] = True
        serialized = columns.strings([json.dumps(a, default=str, sort_keys=True) for _, a in objects])
        texts = pc.replace_with_mask(texts, columns.booleans(mask), serialized)
    return columns.null_where(texts, columns.values_of(pc.binary_length(texts)) == 0)


# The bits of capi.h's TBPIPE_OP_* that say which op columns hold a value (the drain gives a validity
# bitmap per bit, op_valid_<bit>).
_OP_ID, _OP_DEPTH, _OP_PARENT, _OP_SEQ, _OP_BACKWARD = 1, 2, 4, 8, 16
_OP_VALUES = (
    ("op_id", _OP_ID, pa.int64()),
    ("op_depth", _OP_DEPTH, pa.int32()),
    ("op_parent", _OP_PARENT, pa.int64()),
    ("op_seq", _OP_SEQ, pa.int64()),
    ("op_seq_thread", _OP_SEQ, pa.int64()),
    ("op_bwd_seq", _OP_BACKWARD, pa.int64()),
    ("op_fwd_thread", _OP_BACKWARD, pa.int64()),
)


def _list_offsets(ends: pa.Array) -> pa.Array:
    zero = columns.fixed_width(np.zeros(1, dtype=np.int32), pa.int32())
    return pa.concat_arrays([zero, ends.cast(pa.int32())])


# The hashes of the modules and code objects a stack's frames refer to (schemas/identity.py's rules),
# made from Python values: Arrow's compute functions would import pandas here (see `columns`).
def _module_hashes(modules: pa.Table) -> np.ndarray:
    return module_hashes(zip(*(modules.column(name).chunk(0).to_pylist() for name in ("build_id", "path"))))


def _code_hashes(code: pa.Table) -> np.ndarray:
    return code_hashes(
        zip(*(code.column(name).chunk(0).to_pylist() for name in ("filename", "qualname", "first_line")))
    )


class RunWriter:
    """Writes one run directory: a part file per table per flush, then the manifest."""

    def __init__(self, run_dir: Path, manifest: dict[str, Any]):
        self.run_dir = run_dir
        self.manifest = manifest
        self._sequence = 0
        # Made on the first write, on the flush thread: a forked child creates
        # its writer in the fork hook, where Arrow is best left untouched
        # (another parent thread may have been inside it at fork time).
        self._strings: pa.Array | None = None
        self._written_codes: set[int] = set()
        self._written_modules: set[int] = set()
        # What the stacks of later flushes hash with (`_with_hashes`): every code object and module
        # written so far, by id and by index, with its hash.
        self._code_hashes = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        self._module_hashes = (np.zeros(0, np.int64), np.zeros(0, np.uint64))
        self._lock = threading.Lock()  # one flush at a time (flusher thread vs. close)
        self._manifest_written: str | None = None  # what the manifest on disk says (write_manifest)

    def hold_for_fork(self, timeout_s: float) -> bool:
        """Waits for a write in progress and keeps the next from starting, until `release_after_fork`:
        a write may import modules (pyarrow's parquet and compute parts on first use), and a child
        forked while another thread holds an import lock deadlocks on its first import of that module."""
        return self._lock.acquire(timeout=timeout_s)

    def release_after_fork(self) -> None:
        self._lock.release()

    def write(
        self,
        drained: dict[str, Any],
        counters: dict[str, int],
        gpu: dict[str, Any] | None = None,
        extra: dict[str, pa.Table] | None = None,
    ) -> None:
        """One flush: `drained` from the recorder, `gpu` from the GPU activity store (None when GPU
        activity never started in this process), and `extra` parts made elsewhere (by table name)."""
        with self._lock:
            self._sequence += 1
            tables = {
                "events": self._events(drained),
                "stacks": self._stacks(drained),
            }
            tables["code"] = self._code(tables["stacks"])
            tables["modules"] = self._modules(tables["stacks"])
            tables["stacks"] = self._with_hashes(tables["stacks"])
            if gpu is not None:
                tables["gpu_activity"] = self._gpu_activity(gpu)
                tables["gpu_graph_nodes"] = self._gpu_graph_nodes(gpu)
            tables.update(extra or {})
            files = self.manifest["files"]
            for name, table in tables.items():
                if table is None or table.num_rows == 0:
                    continue
                file_name = raw.table_file_name(name, self._sequence)
                self._write_parquet(table, file_name)
                files.setdefault(name, []).append(file_name)
            totals = self.manifest["counters"]
            totals["events_written"] += tables["events"].num_rows
            totals["stacks_written"] += tables["stacks"].num_rows
            note_counters(self.manifest, counters)
            if gpu is not None:
                self._gpu_counters(gpu, tables["gpu_activity"].num_rows)
            self._manifest_written = write_manifest(self.run_dir, self.manifest, self._manifest_written)

    def _write_parquet(self, table: pa.Table, file_name: str) -> None:
        # Written under a hidden name and renamed, so a file that exists is whole. A part with
        # dictionary columns (an event's names) keeps no Arrow schema: readers see the strings of the
        # raw schema, whose metadata the file keeps.
        temporary = self.run_dir / f".{file_name}.tmp"
        options = parquet_options(table.column_names)
        if any(pa.types.is_dictionary(field.type) for field in table.schema):
            with pq.ParquetWriter(temporary, table.schema.remove_metadata(), store_schema=False, **options) as parquet:
                parquet.write_table(table)
                parquet.add_key_value_metadata(table.schema.metadata)
        else:
            pq.write_table(table, temporary, **options)
        os.replace(temporary, self.run_dir / file_name)

    def _gpu_activity(self, gpu: dict[str, Any]) -> pa.Table:
        schema = raw.gpu_activity_schema()
        codes = np.frombuffer(gpu["kind"], dtype=np.uint8)
        # Native kind bits (native/cupti_activity.h): 1 kernel, 2 memcpy, 4 memset, 8 sync.
        names = np.array(["", *raw.GPU_ACTIVITY_KINDS], dtype=object)
        kind = columns.strings(names[np.searchsorted([0, 1, 2, 4, 8], codes)].tolist())
        kernel = codes == 1
        transfer = (codes == 2) | (codes == 4)
        time_type = schema.field("gpu_start").type

        def only(mask: np.ndarray, values: pa.Array) -> pa.Array:
            return columns.null_where(values, ~mask)

        def times(key: str) -> pa.Array:
            return columns.null_where_zero(columns.fixed_width(gpu[key], pa.int64())).cast(time_type)

        device = columns.fixed_width(gpu["device"], pa.uint32())
        device = columns.null_where(device, columns.values_of(device) == 0xFFFFFFFF)
        dims = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z")
        int32 = {
            key: columns.fixed_width(gpu[key], pa.int32())
            for key in (*dims, "registers", "static_shared", "dynamic_shared")
        }
        return pa.Table.from_arrays(
            [
                kind,
                self._strings_for(columns.fixed_width(gpu["name_id"], pa.uint32())),
                times("start_ns"),
                times("end_ns"),
                device,
                columns.fixed_width(gpu["context"], pa.uint32()),
                columns.fixed_width(gpu["stream"], pa.uint32()),
                columns.null_where_zero(columns.fixed_width(gpu["correlation_id"], pa.uint32())),
                columns.null_where_zero(columns.fixed_width(gpu["graph_id"], pa.uint32())),
                columns.null_where_zero(columns.fixed_width(gpu["graph_node_id"], pa.uint64())),
                only(transfer, columns.fixed_width(gpu["bytes"], pa.uint64())),
                *(only(kernel, int32[key]) for key in dims),
                only(kernel, int32["registers"]),
                only(kernel, int32["static_shared"]),
                only(kernel, int32["dynamic_shared"]),
            ],
            schema=schema,
        )

    def _gpu_graph_nodes(self, gpu: dict[str, Any]) -> pa.Table:
        schema = raw.gpu_graph_nodes_schema()
        return pa.Table.from_arrays(
            [
                columns.fixed_width(gpu["node_ts_ns"], pa.int64()).cast(schema.field("ts").type),
                columns.fixed_width(gpu["node_thread_id"], pa.int64()),
                columns.fixed_width(gpu["node_id"], pa.uint64()),
                columns.null_where_zero(columns.fixed_width(gpu["original_node_id"], pa.uint64())),
                columns.null_where_zero(columns.fixed_width(gpu["node_graph_id"], pa.uint32())),
                columns.fixed_width(gpu["node_type"], pa.int32()),
                columns.null_where_zero(columns.fixed_width(gpu["node_correlation_id"], pa.uint32())),
            ],
            schema=schema,
        )

    def _gpu_counters(self, gpu: dict[str, Any], written: int) -> None:
        """The GPU activity store's counters (totals since the process started) and what was written."""
        totals = self.manifest["counters"]
        counts = gpu["counters"]
        totals["gpu_records_written"] = totals.get("gpu_records_written", 0) + written
        totals["gpu_records_dropped"] = counts["dropped"]  # by CUPTI: no buffer to put them in
        totals["gpu_records_lost"] = counts["lost"]  # by tbpipe: its store was full between two flushes
        totals["gpu_records_malformed"] = counts["malformed"]  # shorter than their layout
        self.manifest["gpu_activity"] = {"clock_offset_ns": gpu["clock_offset_ns"]}

    def _interned(self) -> pa.Array:
        """Every string interned so far, by id."""
        if self._strings is None:
            self._strings = columns.strings([""])  # id 0 is "no string"
        new = _native.strings_since(len(self._strings))
        if new:
            self._strings = pa.concat_arrays([self._strings, columns.strings(new)])
        return self._strings

    def _strings_for(self, ids: pa.Array) -> pa.Array:
        return self._interned().take(ids)

    def _dictionary(self, drained: dict[str, Any], name: str) -> pa.DictionaryArray:
        """A column of interned strings as the drain laid it out: indices into a dictionary of the
        strings used (null where the drain gives a validity bitmap and its bit is clear). Parquet
        writes the dictionary page from it as it is, where a string column has every value hashed."""
        indices = columns.fixed_width(drained[f"{name}_index"], pa.int32())
        valid = drained.get(f"{name}_valid")
        if valid is not None:
            indices = columns.with_validity(indices, valid)
        strings = self._interned().take(columns.fixed_width(drained[f"{name}_strings"], pa.uint32()))
        return pa.DictionaryArray.from_arrays(indices, strings)

    def _op_columns(self, drained: dict[str, Any], count: int) -> list[pa.Array]:
        """The op_* columns (raw schema 5): null for every event that is not an op."""
        if "op_valid_1" not in drained:  # no op was drained
            dictionary = pa.dictionary(pa.int32(), pa.string())
            return [pa.nulls(count, arrow_type) for _name, _bit, arrow_type in _OP_VALUES] + [
                pa.nulls(count, dictionary),
                pa.nulls(count, dictionary),
            ]
        values = [
            columns.with_validity(columns.fixed_width(drained[name], arrow_type), drained[f"op_valid_{bit}"])
            for name, bit, arrow_type in _OP_VALUES
        ]
        return values + [self._dictionary(drained, "op_bwd_node"), self._dictionary(drained, "op_scope")]

    def _events(self, drained: dict[str, Any]) -> pa.Table:
        schema = raw.events_schema()
        ts = columns.fixed_width(drained["ts_ns"], pa.int64()).view(schema.field("ts").type)
        arrays = [
            ts,
            columns.fixed_width(drained["thread_id"], pa.int64()),
            self._dictionary(drained, "kind"),
            self._dictionary(drained, "name"),
            columns.with_validity(columns.fixed_width(drained["stack_id"], pa.uint64()), drained["stack_id_valid"]),
            _attrs_column(drained, len(ts)),
            columns.with_validity(
                columns.fixed_width(drained["correlation_id"], pa.uint32()), drained["correlation_id_valid"]
            ),
            *self._op_columns(drained, len(ts)),
        ]
        # The raw schema, its strings as the dictionaries they are made as.
        fields = [pa.field(field.name, array.type, nullable=field.nullable) for field, array in zip(schema, arrays)]
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))

    def _stacks(self, drained: dict[str, Any]) -> pa.Table:
        """The drained stacks, without their hashes (`_with_hashes` adds them)."""
        schema = raw.stacks_schema()
        schema = schema.remove(schema.get_field_index("stack_hash"))
        native = pa.StructArray.from_arrays(
            [
                columns.fixed_width(drained["native_module"], pa.int32()),
                columns.fixed_width(drained["native_offset"], pa.uint64()),
                columns.fixed_width(drained["native_flags"], pa.uint32()),
            ],
            fields=list(raw.NATIVE_FRAME),
        )
        lines = _native.resolve_lines(drained["python_code"], drained["python_offset"], drained["python_flags"])
        python = pa.StructArray.from_arrays(
            [
                columns.fixed_width(drained["python_code"], pa.uint64()),
                columns.fixed_width(drained["python_offset"], pa.int32()),
                columns.fixed_width(lines, pa.int32()),
                columns.fixed_width(drained["python_flags"], pa.uint32()),
            ],
            fields=list(raw.PYTHON_FRAME),
        )
        return pa.Table.from_arrays(
            [
                columns.fixed_width(drained["stack_ids"], pa.uint64()),
                columns.fixed_width(drained["stack_thread"], pa.int64()),
                columns.fixed_width(drained["stack_status"], pa.uint32()),
                pa.ListArray.from_arrays(
                    _list_offsets(columns.fixed_width(drained["native_ends"], pa.uint32())), native
                ),
                pa.ListArray.from_arrays(
                    _list_offsets(columns.fixed_width(drained["python_ends"], pa.uint32())), python
                ),
            ],
            schema=schema,
        )

    def _code(self, stacks: pa.Table) -> pa.Table:
        if not stacks.num_rows:  # (combining no chunks would import pandas)
            return columns.empty_table(raw.code_schema())
        referenced = pc.unique(pc.list_flatten(stacks["python"]).combine_chunks().field("code_id"))
        new_ids = sorted(set(referenced.to_pylist()) - self._written_codes)
        rows = [(i, info) for i, info in zip(new_ids, _native.code_info(new_ids)) if info is not None]
        self._written_codes.update(i for i, _ in rows)
        code = columns.table_from_rows(
            [{"code_id": i, "filename": f, "qualname": q, "first_line": line} for i, (f, q, line) in rows],
            schema=raw.code_schema(),
        )
        if code.num_rows:
            ids, hashes = self._code_hashes
            self._code_hashes = (
                np.concatenate([ids, np.array([i for i, _info in rows], dtype=np.uint64)]),
                np.concatenate([hashes, _code_hashes(code)]),
            )
        return code

    def _modules(self, stacks: pa.Table) -> pa.Table:
        if not stacks.num_rows:
            return columns.empty_table(raw.modules_schema())
        referenced = pc.unique(pc.list_flatten(stacks["native"]).combine_chunks().field("module"))
        new_indices = set(referenced.to_pylist()) - self._written_modules - {-1}
        rows = []
        if new_indices:
            for module in _native._modules():
                if module["index"] not in new_indices:
                    continue
                bias = module["load_bias"]
                rows.append(
                    {
                        "module_index": module["index"],
                        "path": module["path"],
                        "build_id": module["build_id"] or None,
                        "load_bias": bias,
                        "exec_ranges": [{"lo": lo - bias, "hi": hi - bias} for lo, hi in module["exec_ranges"]],
                        "eval_ranges": [{"lo": lo - bias, "hi": hi - bias} for lo, hi in module["eval_ranges"]],
                    }
                )
            self._written_modules.update(r["module_index"] for r in rows)
        modules = columns.table_from_rows(rows, raw.modules_schema())
        if modules.num_rows:
            indices, hashes = self._module_hashes
            self._module_hashes = (
                np.concatenate([indices, np.array([r["module_index"] for r in rows], dtype=np.int64)]),
                np.concatenate([hashes, _module_hashes(modules)]),
            )
        return modules

    def _with_hashes(self, stacks: pa.Table) -> pa.Table:
        """The stacks with their portable hash (`stack_hash`), the function the ingest computes over
        the run's modules and code objects: these are all written by now (this flush's with the
        stacks), so the ingest of a run whose stacks it stores already need not read their frames."""
        hashes = hash_stack_lists(
            *(stacks.column(name).chunk(0) for name in ("status", "native", "python")),
            *self._module_hashes,
            *self._code_hashes,
        )
        return pa.Table.from_arrays(
            [*stacks.columns, columns.fixed_width(hashes, pa.uint64())], schema=raw.stacks_schema()
        )
