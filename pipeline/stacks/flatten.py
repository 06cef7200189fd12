"""A raw run's stacks made columnar: modules keyed, stacks hashed, frames at hand (`flatten_run`).

Every raw stack of every run is hashed (its portable identity), but only the few stacks the
database has not seen yet are laid out, so the frames are not flattened up front: `FlatRun.frames`
gives the frames of the stacks asked for. The hash is `schemas/identity.py`'s fast path
(`hash_stack_lists`, one pass over the Arrow columns in the extension); the module keys and code
objects it refers to are hashed by that module's rules, from the Arrow columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.stacks.origins import splice_origins
from tbpipe.schemas import raw
from tbpipe.schemas.identity import code_hash_column, hash_stack_lists, md5_low64
from tbpipe.schemas.modulekey import module_key_column


@dataclass
class StackFrames:
    """The frames of chosen stacks, laid end to end in the order asked for, innermost first."""

    status: np.ndarray  # uint32 per stack
    native_lengths: np.ndarray  # int64 per stack
    python_lengths: np.ndarray  # int64 per stack
    native_ref: np.ndarray  # int64: row of `modules`, -1 when the run does not describe it
    native_address: np.ndarray  # uint64: ELF address (a marker's stop reason)
    native_flags: np.ndarray  # uint32
    python_ref: np.ndarray  # int64: row of `code`, -1 when the run does not describe it
    python_line: np.ndarray  # int32, -1 unknown
    python_flags: np.ndarray  # uint32

    def slot_arguments(self) -> dict[str, np.ndarray]:
        """These columns as `layout.combined_slots` takes them (with `modules` and `code` added by the caller)."""
        return dict(self.__dict__)


@dataclass
class FlatRun:
    """One run's distinct raw stacks (or several runs', `concat_flat_runs`), with the module and code
    tables they refer to."""

    modules: pa.Table  # module_index, module_key, path, load_bias, exec_ranges
    code: pa.Table  # code_id, filename, qualname, first_line (distinct code ids)
    raw_ids: np.ndarray  # uint64, sorted distinct raw stack ids (each run's own)
    status: np.ndarray  # uint32 per distinct raw stack
    native_lengths: np.ndarray  # int64 per distinct raw stack
    python_lengths: np.ndarray  # int64 per distinct raw stack
    hashes: np.ndarray  # uint64 per distinct raw stack: the portable identity
    # Where the frames come from: one run's raw columns, or the runs laid end to end; None for a
    # run read without its frames (`known_stacks_run`).
    _source: _RunFrames | _BatchFrames | None = field(repr=False)

    @property
    def has_frames(self) -> bool:
        return self._source is not None and (
            not isinstance(self._source, _BatchFrames) or all(run.has_frames for run in self._source.runs)
        )

    def frames(self, chosen: np.ndarray) -> StackFrames:
        """The frames of stacks `chosen` (indices of this FlatRun's stacks, in the order given)."""
        chosen = np.asarray(chosen, dtype=np.int64)
        if self._source is None:
            raise ValueError("the frames of a run read without them (known_stacks_run)")
        native_ref, native_address, native_flags, python_ref, python_line, python_flags = self._source.select(chosen)
        return StackFrames(
            status=self.status[chosen],
            native_lengths=self.native_lengths[chosen],
            python_lengths=self.python_lengths[chosen],
            native_ref=native_ref,
            native_address=native_address,
            native_flags=native_flags,
            python_ref=python_ref,
            python_line=python_line,
            python_flags=python_flags,
        )


def _flat(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _numpy(column: pa.ChunkedArray | pa.Array, dtype) -> np.ndarray:
    """The column as a numpy array of `dtype` (a view of Arrow's buffer where the types allow)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if len(column) == 0:
        return np.zeros(0, dtype=dtype)
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=dtype)


def _rows_of(keys: np.ndarray, wanted: np.ndarray, dtype) -> np.ndarray:
    """Row of each wanted key among `keys` (the first row of equal keys; -1 where absent), found by
    hashing (Arrow's index_in): a binary search per frame cost more than the rest of the selection."""
    if not len(keys):
        return np.full(len(wanted), -1, dtype=np.int64)
    found = pc.index_in(pa.array(wanted, dtype), value_set=pa.array(keys, dtype))
    return np.asarray(pc.fill_null(found, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def _is_identity(rows: np.ndarray, count: int) -> bool:
    return len(rows) == count and bool(np.array_equal(rows, np.arange(count)))


@dataclass
class _RunFrames:
    """One run's raw `native` and `python` list columns, and how their references map to table rows."""

    native: pa.ChunkedArray  # list<NATIVE_FRAME>, one row per row of the run's stacks table
    python: pa.ChunkedArray  # list<PYTHON_FRAME>
    stack_rows: np.ndarray  # int64: row of the stacks table of each distinct stack
    module_index: np.ndarray  # int64 module index of each row of `modules`
    code_ids: np.ndarray  # uint64 distinct code ids, sorted (row i of `code`)

    def select(self, chosen: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = self.stack_rows[chosen]
        native_module, native_offset, native_flags = _list_frames(
            self.native, rows, (("module", np.int64), ("offset", np.uint64), ("flags", np.uint32))
        )
        python_code, python_line, python_flags = _list_frames(
            self.python, rows, (("code_id", np.uint64), ("line", np.int32), ("flags", np.uint32))
        )
        return (
            _rows_of(self.module_index, native_module, pa.int64()),
            native_offset,
            native_flags,
            _rows_of(self.code_ids, python_code, pa.uint64()),
            python_line,
            python_flags,
        )


def _list_frames(
    column: pa.ChunkedArray, rows: np.ndarray, fields: tuple[tuple[str, type], ...]
) -> tuple[np.ndarray, ...]:
    """The named fields of the frames of list rows `rows` (in the order given), laid end to end:
    gathered from each chunk's offsets and struct children read in place, not by taking the nested
    rows (which copies every child) and flattening them."""
    names = tuple(name for name, _dtype in fields)
    dtypes = tuple(dtype for _name, dtype in fields)
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    bounds = np.cumsum([0, *(len(chunk) for chunk in chunks)])
    chunk_of = np.searchsorted(bounds, rows, side="right") - 1
    starts = np.empty(len(rows), dtype=np.int64)
    lengths = np.empty(len(rows), dtype=np.int64)
    children = []
    for index, chunk in enumerate(chunks):
        mine = np.flatnonzero(chunk_of == index)
        offsets, *columns = _list_parts(chunk, names, dtypes)
        local = rows[mine] - bounds[index]
        starts[mine] = offsets[local]
        lengths[mine] = offsets[local + 1] - offsets[local]
        children.append(columns)
    source = _spans(starts, lengths)
    if len(children) == 1:
        return tuple(child[source] for child in children[0])
    frame_chunk = np.repeat(chunk_of, lengths)
    out = [np.empty(len(source), dtype=dtype) for dtype in dtypes]
    for index, columns in enumerate(children):
        mine = np.flatnonzero(frame_chunk == index)
        for target, child in zip(out, columns):
            target[mine] = child[source[mine]]
    return tuple(out)


@dataclass
class _BatchFrames:
    """Several runs' frames, their stacks and table rows numbered on from one run to the next."""

    runs: list[FlatRun]
    stack_base: np.ndarray  # int64: first stack of each run
    module_base: np.ndarray  # int64: first `modules` row of each run
    code_base: np.ndarray  # int64: first `code` row of each run

    def select(self, chosen: np.ndarray) -> tuple[np.ndarray, ...]:
        if not len(chosen):
            return self.runs[0]._source.select(chosen)
        run_of = np.searchsorted(self.stack_base, chosen, side="right") - 1
        # Each run's chosen stacks in one go, then the frames put back in the order asked for.
        by_run = np.argsort(run_of, kind="stable")
        pieces, native_lengths, python_lengths = [], [], []
        for run in np.unique(run_of).tolist():
            local = chosen[by_run[run_of[by_run] == run]] - self.stack_base[run]
            n_ref, n_address, n_flags, p_ref, p_line, p_flags = self.runs[run]._source.select(local)
            n_ref = np.where(n_ref >= 0, n_ref + self.module_base[run], -1)
            p_ref = np.where(p_ref >= 0, p_ref + self.code_base[run], -1)
            pieces.append((n_ref, n_address, n_flags, p_ref, p_line, p_flags))
            native_lengths.append(self.runs[run].native_lengths[local])
            python_lengths.append(self.runs[run].python_lengths[local])
        joined = [np.concatenate(column) for column in zip(*pieces)]
        if np.all(by_run[:-1] < by_run[1:]):
            return tuple(joined)
        place = np.empty(len(by_run), dtype=np.int64)
        place[by_run] = np.arange(len(by_run), dtype=np.int64)  # position of each chosen stack in run order
        native = _frames_of(np.concatenate(native_lengths), place)
        python = _frames_of(np.concatenate(python_lengths), place)
        return (*(column[native] for column in joined[:3]), *(column[python] for column in joined[3:]))


def _frames_of(lengths: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Positions, in frame arrays laid end to end by `lengths`, of the frames of lists `chosen` (in that order)."""
    lengths = lengths.astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    return _spans(starts[chosen], lengths[chosen])


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions start, start + 1, ... of each span (int64 starts and lengths), one span after another."""
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def _list_parts(chunk: pa.Array, fields: tuple[str, ...], dtypes: tuple) -> tuple[np.ndarray, ...]:
    """A list<struct> chunk's offsets (int32) and the named child columns, as numpy views."""
    offsets = np.asarray(chunk.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    values = chunk.values
    return (offsets, *(_numpy(pc.struct_field(values, name), dtype) for name, dtype in zip(fields, dtypes)))


def _hash_stacks(
    stacks: pa.Table, module_index: np.ndarray, module_hash: np.ndarray, code_ids: np.ndarray, code_hash: np.ndarray
) -> np.ndarray:
    """The portable hash of every row of a raw `stacks` table (schemas/identity.py's fast path)."""
    out = [
        hash_stack_lists(
            batch.column("status"),
            batch.column("native"),
            batch.column("python"),
            module_index,
            module_hash,
            code_ids,
            code_hash,
        )
        for batch in stacks.to_batches()
    ]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)


def flatten_run(tables: dict[str, pa.Table]) -> FlatRun:
    """Hashes a run's `stacks` (with the frames of its `code_origins`, when it has that table, placed
    inside the generated frames: `origins`) and keys its `modules` and `code` (schemas.raw)."""
    tables = splice_origins(tables)
    stacks = tables["stacks"]

    # Modules: key and hash per row; frames find their row by module_index.
    raw_modules = tables["modules"]
    modules = _keyed_modules(raw_modules)
    module_hash = md5_low64(modules["module_key"])
    module_index = _numpy(raw_modules["module_index"], np.int64)

    # Code objects: distinct ids, hash over (file, qualname, first line).
    code_table = tables["code"]
    code_ids, first_rows = np.unique(_numpy(code_table["code_id"], np.uint64), return_index=True)
    code = (
        code_table
        if _is_identity(first_rows, code_table.num_rows)
        else code_table.take(pa.array(first_rows, pa.int64()))
    )
    code_hash = code_hash_column(code["filename"], code["qualname"], code["first_line"])

    # Distinct raw stacks (a run holds each once; duplicates would be harmless but are dropped).
    raw_ids, stack_rows = np.unique(_numpy(stacks["stack_id"], np.uint64), return_index=True)
    stack_rows = stack_rows.astype(np.int64)
    hashes = _hash_stacks(stacks, module_index, module_hash, code_ids, code_hash)
    lengths = [_numpy(pc.list_value_length(stacks[name]), np.int64) for name in ("native", "python")]

    return FlatRun(
        modules=modules,
        code=code,
        raw_ids=raw_ids,
        status=_numpy(stacks["status"], np.uint32)[stack_rows],
        native_lengths=lengths[0][stack_rows],
        python_lengths=lengths[1][stack_rows],
        hashes=hashes[stack_rows],
        _source=_RunFrames(
            native=stacks["native"],
            python=stacks["python"],
            stack_rows=stack_rows,
            module_index=module_index,
            code_ids=code_ids,
        ),
    )


def differing_written_hashes(tables: dict[str, pa.Table], flat: FlatRun) -> int:
    """How many of a run's stacks carry a hash written by the capture (`stack_hash`) other than the
    one their frames give (`flat`, from `flatten_run(tables)`): none unless the run is damaged. A
    run with code origins is not checked: its hashes are taken with the origin frames spliced in,
    which the capture does not do."""
    stacks = tables["stacks"]
    origins = tables.get("code_origins")
    if "stack_hash" not in stacks.column_names or (origins is not None and origins.num_rows):
        return 0
    written = _flat(stacks["stack_hash"])
    if written.null_count == len(written):  # parts written before raw schema 4
        return 0
    rows = np.searchsorted(flat.raw_ids, _numpy(stacks["stack_id"], np.uint64))
    has = ~np.asarray(written.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    values = _numpy(written.fill_null(0), np.uint64)
    return int(np.count_nonzero(has & (values != flat.hashes[rows])))


def known_stacks_run(stacks: pa.Table, raw_modules: pa.Table) -> FlatRun:
    """A run whose stacks the database already holds, read without their frames: its raw stack ids
    and the hashes the capture wrote (`stack_hash`, none null), and its modules keyed. Its stacks
    are never laid out (their status and frame counts are left 0)."""
    raw_ids, stack_rows = np.unique(_numpy(stacks["stack_id"], np.uint64), return_index=True)
    zeros = np.zeros(len(raw_ids), dtype=np.int64)
    return FlatRun(
        modules=_keyed_modules(raw_modules),
        code=raw.code_schema().empty_table(),
        raw_ids=raw_ids,
        status=zeros.astype(np.uint32),
        native_lengths=zeros,
        python_lengths=zeros,
        hashes=_numpy(stacks["stack_hash"], np.uint64)[stack_rows],
        _source=None,
    )


def _keyed_modules(raw_modules: pa.Table) -> pa.Table:
    """A raw `modules` table with each row's module key, as `FlatRun.modules` holds it."""
    return pa.table(
        {
            "module_index": raw_modules["module_index"],
            "module_key": module_key_column(_flat(raw_modules["build_id"]), _flat(raw_modules["path"])),
            "path": raw_modules["path"],
            "load_bias": raw_modules["load_bias"],
            "exec_ranges": raw_modules["exec_ranges"],
        }
    )


def concat_flat_runs(runs: list[FlatRun]) -> tuple[FlatRun, np.ndarray]:
    """Several runs' flattened stacks as one (modules and code tables appended, references shifted),
    and the index in `runs` of each stack's run. Raw stack ids stay each run's own."""
    if len(runs) == 1:
        return runs[0], np.zeros(len(runs[0].raw_ids), dtype=np.int64)
    stacks = [len(r.raw_ids) for r in runs]
    flat = FlatRun(
        modules=pa.concat_tables([r.modules for r in runs]),
        code=pa.concat_tables([r.code for r in runs]),
        raw_ids=np.concatenate([r.raw_ids for r in runs]),
        status=np.concatenate([r.status for r in runs]),
        native_lengths=np.concatenate([r.native_lengths for r in runs]),
        python_lengths=np.concatenate([r.python_lengths for r in runs]),
        hashes=np.concatenate([r.hashes for r in runs]),
        _source=_BatchFrames(
            runs=runs,
            stack_base=np.cumsum([0, *stacks[:-1]]).astype(np.int64),
            module_base=np.cumsum([0, *[r.modules.num_rows for r in runs][:-1]]).astype(np.int64),
            code_base=np.cumsum([0, *[r.code.num_rows for r in runs][:-1]]).astype(np.int64),
        ),
    )
    return flat, np.repeat(np.arange(len(runs)), stacks)
