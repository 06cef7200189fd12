"""Chrome trace JSON (the Trace Event Format PyTorch's profiler writes; Perfetto UI and chrome://tracing open it).

    {"displayTimeUnit": "ms", "otherData": {...},
     "stackFrames": {"12:0": {"name": "launch (train.py:40)", "category": "python", "parent": "12:1"}, ...},
     "traceEvents": [
       {"name": "process_name", "ph": "M", "pid": 4242, "tid": 0, "args": {"name": "..."}},
       {"name": "thread_name", "ph": "M", "pid": 4242, "tid": 4243, "args": {"name": "MainThread"}},
       {"name": "gemm", "cat": "kernel_launch", "ph": "i", "s": "t", "pid": 4242, "tid": 4243,
        "ts": 1767225600000123, "args": {"event_id": 7, "attrs": {...}, "stack_id": 12,
        "site": "train.py:40:launch"}, "sf": "12:0"}, ...]}

Every event is an instant event of its thread (`pid` the run's process id, `tid` the OS thread
id; `ts` in microseconds since the Unix epoch, as recorded), named by the event's name with its
kind as category. Its combined traceback is its stack frame `sf`: the format's `stackFrames`
table holds each chosen stack once as a chain of frames (`"STACK:DEPTH"`, depth 0 innermost,
each naming its caller as `parent`), so a stack costs its frames once however many events share
it. `args` carries the event id, the event's attributes (null when it has none), the stack id
(`tbpipe show --stack ID`) and the call site; `traceback_args=True` also copies the whole traceback (innermost first)
into every event's args, for viewers that show args but not `sf`, at the price of the
traceback's size per event.

Runs that share a process id get ids of their own above Linux's largest pid (2**22 + run
number). The JSON text is assembled column-wise with Arrow, one pass per batch of the source's
record batches, and written from Arrow's buffers on a second thread while the next batch is
assembled; strings from the database go through `json.dumps` (event names, frames, sites) or
are JSON already (attributes).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.export.frames import location_labels, stack_texts
from tbpipe.pipeline.export.source import BATCH_ROWS, ExportSource

_FAKE_PID_BASE = 1 << 22
_STACKS_PER_CHUNK = 4096  # stacks whose frames are rendered at once (bounds the memory it takes)


def _text(values: Any) -> pa.Array:
    return pc.cast(values, pa.large_string())


def _join(*parts: Any) -> pa.Array:
    """Element-wise concatenation of string arrays and scalars (nulls must be filled before)."""
    pieces = [pa.scalar(p, pa.large_string()) if isinstance(p, str) else p for p in parts]
    return pc.binary_join_element_wise(*pieces, pa.scalar("", pa.large_string()))


class _BackgroundWriter:
    """Writes to `out` on a second thread, one write in flight, so writing a batch overlaps
    rendering the next (both release the GIL); `write` returns once the previous write is done."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tbpipe-export-write")
        self._pending: Future | None = None

    def write(self, data: Any, keep: Any = None) -> None:
        """Writes `data` (bytes or a buffer; `keep` holds what owns the buffer until it is written)."""
        self.wait()
        self._pending = self._pool.submit(lambda: (self._out.write(data), keep))

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


class _JsonItems:
    """Writes the items of one JSON array or object, comma-separated, straight from Arrow string buffers."""

    def __init__(self, out: _BackgroundWriter) -> None:
        self.out = out
        self.count = 0

    def write(self, values: pa.Array) -> None:
        """`values`: the items' JSON texts (a large_string array without nulls)."""
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if len(values) == 0:
            return
        if self.count == 0:
            self.out.write(values[0].as_py().encode())
            values = values.slice(1)
            self.count = 1
        if len(values):
            self._write_buffer(_join(",\n", values))
            self.count += len(values)

    def _write_buffer(self, values: pa.Array) -> None:
        self.out.write(_buffer(values), keep=values)


def process_ids(source: ExportSource) -> dict[int, int]:
    """run_number -> the pid the trace shows for the run."""
    seen = Counter(run.pid for run in source.runs)
    return {
        run.run_number: run.pid if run.pid is not None and seen[run.pid] == 1 else _FAKE_PID_BASE + run.run_number
        for run in source.runs
    }


def _metadata(source: ExportSource, pids: dict[int, int]) -> list[str]:
    runs = {run.run_number: run for run in source.runs}
    events = []
    for run in source.runs:
        name = f"tbpipe run {run.run_id}" + (f" (pid {run.pid})" if run.pid is not None else "")
        events.append(
            {"name": "process_name", "ph": "M", "pid": pids[run.run_number], "tid": 0, "args": {"name": name}}
        )
    for run_number, thread_id in source.event_threads():
        name = runs[run_number].threads.get(thread_id) or f"thread {thread_id}"
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pids[run_number], "tid": thread_id, "args": {"name": name}}
        )
    return [json.dumps(event, ensure_ascii=False) for event in events]


def _stack_frames(items: _JsonItems, stack_ids: np.ndarray, frames: pa.LargeListArray) -> None:
    """The `stackFrames` entries: `"STACK:DEPTH": {..., "parent": "STACK:DEPTH+1"}`, depth 0 innermost."""
    lengths = pc.list_value_length(frames).to_numpy(zero_copy_only=False).astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return
    offsets = frames.offsets.to_numpy()
    depth = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)
    owner = _text(pa.array(np.repeat(stack_ids, lengths)))
    outermost = pa.array(depth == np.repeat(lengths, lengths) - 1)
    parent = pc.if_else(
        outermost, pa.scalar("", pa.large_string()), _join(',"parent":"', owner, ":", _text(pa.array(depth + 1)), '"')
    )
    items.write(_join('"', owner, ":", _text(pa.array(depth)), '":', frames.flatten(), parent, "}"))


def _stack_parts(source: ExportSource, stack_ids: np.ndarray, located: Any, traceback_args: bool) -> pa.Array:
    """Per stack, how its events end: the stack's part of `args`, then `"sf"`. The last entry
    (index len(stack_ids)) ends the events without a stack (or without frames)."""
    sites = source.stack_sites()
    site_of = dict(zip(sites["stack_id"].to_pylist(), sites["site"].to_pylist()))
    tracebacks = None
    if traceback_args:
        texts = [location_labels(location) for location in located.locations.to_pylist()]
        _, tracebacks = stack_texts(located.locations, located.stacks, texts)
    parts = []
    for index, stack_id in enumerate(stack_ids.tolist()):
        part = f',"stack_id":{stack_id}'
        site = site_of.get(stack_id)
        if site is not None:
            part += f',"site":{json.dumps(site, ensure_ascii=False)}'
        if tracebacks is not None:
            part += f',"traceback":{json.dumps(tracebacks[index].as_py(), ensure_ascii=False)}'
        parts.append(part + f'}},"sf":"{stack_id}:0"}}')
    parts.append("}}")
    return pa.array(parts, pa.large_string())


def _heads(source: ExportSource, pids: dict[int, int]) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """How the events of each (run, name) begin, up to `"tid":`: (run numbers, name ids, texts);
    the text of the i-th run and j-th name is at i * len(name ids) + j."""
    run_numbers = np.array(sorted(pids), dtype=np.int64)
    name_ids = np.array(sorted(source.names), dtype=np.int64)
    texts = []
    for run_number in run_numbers.tolist():
        for name_id in name_ids.tolist():
            kind, name = source.names[name_id]
            texts.append(
                f',\n{{"name":{json.dumps(name, ensure_ascii=False)},"cat":{json.dumps(kind, ensure_ascii=False)},'
                f'"ph":"i","s":"t","pid":{pids[run_number]},"tid":'
            )
    return run_numbers, name_ids, pa.array(texts, pa.large_string())


class _Index:
    """Positions of integer keys (ids: small, dense numbers) in a sorted array, looked up per batch."""

    _TABLE_LIMIT = 1 << 26  # largest key answered by a direct table (else a binary search)

    def __init__(self, sorted_keys: np.ndarray, missing: int) -> None:
        self.keys = np.asarray(sorted_keys, dtype=np.int64)
        self.missing = missing
        self.table = None
        if len(self.keys) and 0 <= self.keys[0] and self.keys[-1] < self._TABLE_LIMIT:
            self.table = np.full(int(self.keys[-1]) + 2, missing, np.int64)
            self.table[self.keys] = np.arange(len(self.keys))

    def positions(self, values: pa.Array) -> np.ndarray:
        """Index of each value in the keys (`missing` for nulls and values not there)."""
        found = pc.fill_null(values, -1).to_numpy().astype(np.int64, copy=False)
        if self.table is not None:
            where = self.table[np.clip(found, -1, len(self.table) - 1)]  # -1 and beyond: the last entry, missing
        elif len(self.keys):
            where = np.minimum(np.searchsorted(self.keys, found), len(self.keys) - 1)
            where = np.where(self.keys[where] == found, where, self.missing)
        else:
            where = np.full(len(found), self.missing, np.int64)
        if values.null_count:
            where = np.where(values.is_null().to_numpy(zero_copy_only=False), self.missing, where)
        return where


def write_chrome_trace(source: ExportSource, out: BinaryIO, traceback_args: bool = False) -> int:
    """Writes the source's events as a Chrome trace JSON object to `out`; returns how many events it holds."""
    pids = process_ids(source)
    located = source.stack_locations()
    # Each location's frames as `{"name": ..., "category": ...` (closed by the writer, after the parent).
    fragments = [
        [
            f'{{"name":{json.dumps(label, ensure_ascii=False)},"category":{json.dumps(location["kind"])}'
            for label in location_labels(location)
        ]
        for location in located.locations.to_pylist()
    ]
    stack_ids, frames = stack_texts(located.locations, located.stacks, fragments)
    del fragments
    stack_parts = _stack_parts(source, stack_ids, located, traceback_args)
    del located

    writer = _BackgroundWriter(out)
    try:
        other = {"exporter": "tbpipe", "runs": source.run_ids}
        if source.choice.describe():
            other["filter"] = source.choice.describe()
        writer.write(b'{"displayTimeUnit":"ms","otherData":' + json.dumps(other, ensure_ascii=False).encode())
        writer.write(b',\n"stackFrames":{\n')
        frame_items = _JsonItems(writer)
        for start in range(0, len(stack_ids), _STACKS_PER_CHUNK):
            chunk = slice(start, start + _STACKS_PER_CHUNK)
            _stack_frames(frame_items, stack_ids[chunk], frames.slice(start, _STACKS_PER_CHUNK))
        del frames
        writer.write(b'},\n"traceEvents":[\n')
        # The metadata events come first, so every event can be written after a separator.
        writer.write(",\n".join(_metadata(source, pids)).encode())
        total = _write_events(source, writer, pids, stack_ids, stack_parts)
        writer.write(b"\n]}\n")
        return total
    finally:
        writer.close()


def _write_events(
    source: ExportSource, writer: _BackgroundWriter, pids: dict[int, int], stack_ids: np.ndarray, stack_parts: pa.Array
) -> int:
    """Each event: `,\n{"name":..,"cat":..,"ph":"i","s":"t","pid":..,"tid":..,"ts":..,"args":{"event_id":..,
    "attrs":..,<the stack's part>}` joined column-wise in one pass per batch."""
    run_numbers, name_ids, heads = _heads(source, pids)
    runs, names = _Index(run_numbers, 0), _Index(name_ids, 0)
    stacks = _Index(stack_ids, len(stack_ids))
    total = 0
    for batch in source.event_batches(BATCH_ROWS, numbers_as_text=True):
        event_id, run_number, ts_us, thread_id, name_id, stack_id, attrs = batch.columns
        head = runs.positions(run_number) * len(name_ids) + names.positions(name_id)
        events = _join(
            heads.take(pa.array(head)),
            _text(thread_id),
            ',"ts":',
            _text(ts_us),
            ',"args":{"event_id":',
            _text(event_id),
            ',"attrs":',
            pc.fill_null(pc.cast(attrs, pa.large_string()), "null"),
            stack_parts.take(pa.array(stacks.positions(stack_id))),
        )
        writer.write(_buffer(events), keep=events)
        total += batch.num_rows
    return total


def _buffer(values: pa.Array) -> memoryview:
    """The characters of a large_string array without nulls, end to end, without a copy."""
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64, count=len(values) + 1, offset=values.offset * 8)
    return memoryview(values.buffers()[2])[int(offsets[0]) : int(offsets[-1])]
