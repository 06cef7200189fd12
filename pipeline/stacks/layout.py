"""Stack frames in combined order with inline chains, built over whole batches of stacks.

Two steps, both over whole runs at once:

- `combined_slots`: where each raw frame goes, by the combined order (`order`: its reference and
  the fast path used here, one pass over each stack's frames in the extension). So the Python
  frames of a stack fall into groups ended by entry frames, and the k-th eval-loop frame (markers
  never count) takes the k-th group; eval-loop frames beyond the last group stay native frames;
  groups left over follow a native walk that stopped early, and without such a stop they mean the
  two walks disagree and the stack is shown as its Python frames alone. Each placed frame is a
  *slot*; the slots' columns are gathered in the extension too (`slot_columns`, one pass).
- `expand`: each native slot becomes its address's inline chain from the symbols rows (innermost
  first); the result is shaped like the `stack_frames` table.

Per-row work is numpy over integer columns; a frame's text is taken once per distinct frame.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe import _native
from tbpipe.pipeline.stacks.order import combined_orders
from tbpipe.pipeline.stacks.origins import ORIGIN_FLAG
from tbpipe.schemas.raw import NATIVE_FRAME_EXACT_PC, NATIVE_FRAME_MARKER, STOP_REASONS

PYTHON, NATIVE, MARKER = 0, 1, 2
KINDS = ("python", "native", "marker")  # a frame's kind, by its code in the slots


@functools.cache
def kind_names() -> pa.Array:
    """`KINDS` as an Arrow column, made when first needed: `pa.array` at import time would import
    pandas (pyarrow asks it about every value it converts), a cost every command paid at start."""
    return pa.array(KINDS, pa.string())


NO_MODULE_REASON = "the run does not describe this frame's module"
NOT_SYMBOLIZED_REASON = "not symbolized"


@dataclass
class Slots:
    """Frames in combined order before inline expansion, stack after stack, slot after slot."""

    stack_id: np.ndarray  # int64
    slot: np.ndarray  # int32, 0-based within the stack
    kind: np.ndarray  # int8: PYTHON, NATIVE, MARKER
    # The text columns may be dictionary arrays (combined_slots writes each text once, not per slot).
    function: pa.Array  # Python qualname; marker: what stopped the walk; native: null
    file: pa.Array  # Python file
    line: np.ndarray  # int32 Python line, -1 unknown
    first_line: np.ndarray  # int32 first line of the Python frame's function, -1 unknown or not Python
    module: pa.Array  # native: path
    module_key: pa.Array  # native: `modules.module_key`, null when the run did not describe the module
    address: np.ndarray  # uint64 native address (marker: stop reason code)
    exact: np.ndarray  # bool, native: not a return address
    reason: pa.Array  # marker: the stop reason
    # Python: a frame placed from `code_origins` (a user line compiled into the generated frame outside it)
    inlined: np.ndarray | None = None  # bool; None: none is

    def __len__(self) -> int:
        return len(self.stack_id)


@dataclass
class StackShapes:
    """Per stack (in the order given to `combined_slots`)."""

    problem: pa.Array  # string, null when the combined order can be trusted


def _flat(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _take(values: pa.Array, rows: np.ndarray) -> pa.Array:
    """values[rows], null where rows < 0."""
    missing = rows < 0
    if len(values) == 0:
        return pa.nulls(len(rows), values.type)
    return values.take(pa.array(np.where(missing, 0, rows), pa.int64(), mask=missing))


def _dictionary(values: pa.Array | pa.ChunkedArray, rows: np.ndarray) -> pa.DictionaryArray:
    """values[rows] (null where rows < 0) as a dictionary array: the texts of a table's few rows
    are not copied once per slot."""
    return pa.DictionaryArray.from_arrays(pa.array(rows.astype(np.int32), pa.int32(), mask=rows < 0), _flat(values))


def _plain(values: pa.Array) -> pa.Array:
    """A dictionary array's values written out (other arrays as they are)."""
    return values.cast(values.type.value_type) if pa.types.is_dictionary(values.type) else values


def _stop_texts(codes: np.ndarray) -> tuple[pa.Array, pa.Array, np.ndarray]:
    """(marker function text, reason) per distinct stop-reason code, and the distinct code of each code."""
    distinct, inverse = np.unique(codes, return_inverse=True)
    reasons = [STOP_REASONS.get(int(code), f"stop reason {int(code)}") for code in distinct.tolist()]
    texts = [f"<native walk stopped: {r}>" for r in reasons]
    return pa.array(texts, pa.string()), pa.array(reasons, pa.string()), inverse.ravel().astype(np.int64)


def _arrays(buffers: tuple[bytes, ...], dtypes: tuple) -> tuple[np.ndarray, ...]:
    """The extension's columns (bytes) as numpy arrays of the given types (read-only views)."""
    return tuple(np.frombuffer(data, dtype) for data, dtype in zip(buffers, dtypes))


def combined_slots(
    stack_ids: np.ndarray,
    status: np.ndarray,
    native_lengths: np.ndarray,
    python_lengths: np.ndarray,
    native_ref: np.ndarray,
    native_address: np.ndarray,
    native_flags: np.ndarray,
    python_ref: np.ndarray,
    python_line: np.ndarray,
    python_flags: np.ndarray,
    modules: pa.Table,
    code: pa.Table,
) -> tuple[Slots, StackShapes]:
    """Slots of the given stacks; frames arrays hold each stack's frames contiguously, innermost first.

    `native_ref` / `python_ref` are rows of `modules` (module_key, path) / `code` (filename,
    qualname), -1 for a module or code object the run does not describe.
    """
    native_flags = np.ascontiguousarray(native_flags, dtype=np.uint32)
    python_flags = np.ascontiguousarray(python_flags, dtype=np.uint32)
    # Where each frame goes: the combined order's fast path (order.py).
    ordered = combined_orders(status, native_lengths, python_lengths, native_flags, python_flags)
    owner, source, is_python = ordered.owner, ordered.source, ordered.is_python
    code_first_line = (
        _flat(code["first_line"]).to_numpy(zero_copy_only=False).astype(np.int32)
        if code.num_rows
        else np.zeros(0, np.int32)
    )
    # What each slot shows, gathered from the frame columns in one pass, also in the extension.
    kind, module_row, code_row, address, exact, line, inlined, first_line = _arrays(
        _native.slot_columns(
            source,
            is_python.view(np.uint8),
            np.ascontiguousarray(native_ref, dtype=np.int64),
            np.ascontiguousarray(native_address, dtype=np.uint64),
            native_flags,
            np.ascontiguousarray(python_ref, dtype=np.int64),
            np.ascontiguousarray(python_line, dtype=np.int32),
            python_flags,
            code_first_line,
            NATIVE_FRAME_MARKER,
            NATIVE_FRAME_EXACT_PC,
            ORIGIN_FLAG,
            PYTHON,
            NATIVE,
            MARKER,
        ),
        (np.int8, np.int64, np.int64, np.uint64, np.bool_, np.int32, np.bool_, np.int32),
    )
    qualnames = code["qualname"] if code.num_rows else pa.array([], pa.string())
    function = _dictionary(qualnames, code_row)
    file = _dictionary(code["filename"] if code.num_rows else pa.array([], pa.string()), code_row)
    reason = pa.nulls(len(owner), pa.string())
    markers = np.flatnonzero(kind == MARKER)
    if len(markers):
        # A marker's function is its stop text: one more dictionary entry per distinct reason.
        texts, reasons, text_of = _stop_texts(address[markers])
        function_row = code_row.copy()
        function_row[markers] = len(qualnames) + text_of
        function = _dictionary(pa.concat_arrays([_flat(qualnames).cast(pa.string()), texts]), function_row)
        reason_row = np.full(len(owner), -1, dtype=np.int64)
        reason_row[markers] = text_of
        reason = _dictionary(reasons, reason_row)
    empty = pa.array([], pa.string())
    slots = Slots(
        stack_id=stack_ids[owner].astype(np.int64),
        slot=ordered.slot.astype(np.int32),
        kind=kind,
        function=function,
        file=file,
        line=line,
        first_line=first_line,
        module=_dictionary(modules["path"] if modules.num_rows else empty, module_row),
        module_key=_dictionary(modules["module_key"] if modules.num_rows else empty, module_row),
        address=address,
        exact=exact,
        reason=reason,
        inlined=inlined if inlined.any() else None,
    )
    return slots, StackShapes(problem=ordered.problem)


def slots_from_table(table: pa.Table) -> Slots:
    """Slots read back from `stack_frames` rows with chain_depth 0 (ordered by stack_id, slot)."""
    kind = pc.index_in(table["kind"], value_set=kind_names()).to_numpy(zero_copy_only=False).astype(np.int8)
    native = kind == NATIVE

    def column(name: str) -> pa.Array:
        values = table[name]
        return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values

    return Slots(
        stack_id=column("stack_id").to_numpy(zero_copy_only=False).astype(np.int64),
        slot=column("slot").to_numpy(zero_copy_only=False).astype(np.int32),
        kind=kind,
        function=pc.if_else(pa.array(native), pa.scalar(None, pa.string()), column("function")),
        file=pc.if_else(pa.array(native), pa.scalar(None, pa.string()), column("file")),
        line=pc.fill_null(column("line"), -1).to_numpy(zero_copy_only=False).astype(np.int32),
        first_line=pc.fill_null(column("first_line"), -1).to_numpy(zero_copy_only=False).astype(np.int32),
        module=column("module"),
        module_key=column("module_key"),
        address=pc.fill_null(column("address"), 0).to_numpy(zero_copy_only=False).astype(np.uint64),
        exact=pc.fill_null(column("exact"), False).to_numpy(zero_copy_only=False).astype(bool),
        reason=pc.if_else(pa.array(kind == MARKER), column("reason"), pa.scalar(None, pa.string())),
        inlined=_python_inlined(kind, table),
    )


def _python_inlined(kind: np.ndarray, table: pa.Table) -> np.ndarray | None:
    """Python rows of `stack_frames` marked inlined (placed from `code_origins`); None when there are none."""
    if "inlined" not in table.column_names or not len(kind):
        return None
    inlined = (kind == PYTHON) & pc.fill_null(table["inlined"], False).to_numpy(zero_copy_only=False).astype(bool)
    return inlined if inlined.any() else None


def _distinct_rows(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, an id of its combination of values over the integer columns (ids in order of first
    appearance), and the first row of each id: exact, found by hashing the rows in the extension
    (`tbpipe._native.distinct_rows`) rather than by sorting. The columns are laid side by side in
    one integer type (a contiguous copy; a record type would copy field by field)."""
    width = max(column.dtype.itemsize for column in columns)
    packed = np.empty((len(columns[0]), len(columns)), dtype=np.int64 if width > 4 else np.int32)
    for i, column in enumerate(columns):
        packed[:, i] = column
    ids, first = _native.distinct_rows(packed.reshape(-1).view(np.uint8), packed.shape[1] * packed.itemsize)
    return np.frombuffer(ids, dtype=np.int64), np.frombuffer(first, dtype=np.int64)


@dataclass
class Frames:
    """Laid-out stacks: a row per frame of each stack, and each distinct frame's content once."""

    rows: pa.Table  # stack_id, depth, slot, chain_depth, frame (row of `frames`): ints only
    frames: pa.Table  # kind, function, file, line, first_line, module, module_key, address, exact, inlined, reason
    per_stack_frames: np.ndarray  # int64 frames per stack, for the stacks in order of first appearance
    stack_order: np.ndarray  # int64 the stack ids those counts belong to
    symbolized_depth: np.ndarray  # int32 depth of the innermost symbolized frame per stack, -1 none

    def table(self) -> pa.Table:
        """The rows with their frames' columns: what the database's `stack_frames` view shows."""
        index = self.rows["frame"].combine_chunks()
        columns = {name: self.rows[name] for name in ("stack_id", "depth", "slot", "chain_depth")}
        columns.update({name: self.frames[name].take(index) for name in self.frames.column_names})
        return pa.table(columns)


FRAME_COLUMNS = (
    "kind",
    "function",
    "file",
    "line",
    "first_line",
    "module",
    "module_key",
    "address",
    "exact",
    "inlined",
    "reason",
)


def _codes(values: pa.Array) -> np.ndarray:
    """A dense integer per distinct string (nulls -1), for keys built with numpy."""
    if len(values) == 0:
        return np.zeros(0, np.int64)
    values = _flat(values)
    if pa.types.is_dictionary(values.type):
        # A dictionary may hold one text twice (two code rows of one function): one code for both.
        return _per_index(values, _codes(values.dictionary))
    encoded = pc.dictionary_encode(values)
    return pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def _per_index(values: pa.DictionaryArray, per_value: np.ndarray) -> np.ndarray:
    """Each entry's integer from the one computed per dictionary value (-1 for nulls): one gather
    from the per-value integers with a -1 appended, nulls pointing at it."""
    lookup = np.append(np.asarray(per_value, dtype=np.int64), -1)
    indices = values.indices
    if indices.type.bit_width < 32:  # room for the extra index
        indices = indices.cast(pa.int32())
    return lookup[pc.fill_null(indices, len(per_value)).to_numpy(zero_copy_only=False)]


def _index_in(values: pa.Array, value_set: pa.Array) -> np.ndarray:
    """Position of each value in `value_set` (-1 null or absent); a dictionary array's few values are
    looked up once."""
    values = _flat(values)
    if pa.types.is_dictionary(values.type):
        return _per_index(values, _index_in(values.dictionary, value_set))
    return pc.fill_null(pc.index_in(values, value_set=value_set), -1).to_numpy(zero_copy_only=False).astype(np.int64)


def distinct_native_slots(slots: Slots) -> np.ndarray:
    """The first of the native slots of each distinct (module key, address, exact) whose module the
    run describes: what the symbols are looked up for (most addresses recur in many stacks)."""
    codes = _codes(slots.module_key)
    rows = np.flatnonzero((slots.kind == NATIVE) & (codes >= 0))
    _, first = _distinct_rows(slots.address[rows].astype(np.int64), codes[rows] * 2 + slots.exact[rows])
    return rows[first]


def expand(slots: Slots, symbols: pa.Table) -> Frames:
    """Stack rows: native slots replaced by their inline chains from `symbols`; each distinct frame once.

    Only integers are computed per row, in one pass in the extension (native/inline_rows.cpp): a
    native slot's chain is found by (module key, address, exact) and its rows get their symbols rows;
    distinct frames are found by the codes that determine them (a symbols row and module path for a
    symbolized native frame; module, address and reason for an unsymbolized one; function, file, line
    and first line for a Python frame; the stop reason for a marker). The text of a frame is taken
    once per distinct frame.
    """
    sym_build = symbols["module_key"].combine_chunks() if symbols.num_rows else pa.array([], pa.string())
    slot_keys = _flat(slots.module_key)
    slot_key_values = slot_keys.dictionary if pa.types.is_dictionary(slot_keys.type) else slot_keys
    # One code per module key over slots and symbols rows, so that the two can be matched by integers.
    dictionary = pc.unique(
        pa.concat_arrays([sym_build.cast(pa.string()), slot_key_values.cast(pa.string())]).drop_null()
    )
    slot_codes = _index_in(slot_keys, dictionary)
    sym_codes = _index_in(sym_build, dictionary) if len(sym_build) else np.zeros(0, np.int64)

    def symbol_column(name: str, dtype: type) -> np.ndarray:
        if not symbols.num_rows:
            return np.zeros(0, dtype)
        return np.ascontiguousarray(symbols[name].to_numpy(zero_copy_only=False), dtype=dtype)

    stack, depth, slot, chain_depth, frame_of_row, frame_slot, frame_sym_row = _native.inline_rows(
        np.ascontiguousarray(slots.stack_id, dtype=np.int64),
        np.ascontiguousarray(slots.slot, dtype=np.int32),
        np.ascontiguousarray(slots.kind, dtype=np.int8),
        slot_codes,
        np.ascontiguousarray(slots.address, dtype=np.uint64),
        np.ascontiguousarray(slots.exact, dtype=np.uint8),
        _codes(slots.module),
        _codes(slots.function),
        _codes(slots.file),
        np.ascontiguousarray(slots.line, dtype=np.int32),
        np.ascontiguousarray(slots.first_line, dtype=np.int32),
        np.zeros(0, np.uint8) if slots.inlined is None else np.ascontiguousarray(slots.inlined, dtype=np.uint8),
        sym_codes,
        symbol_column("address", np.uint64),
        symbol_column("exact", np.uint8),
        symbol_column("depth", np.int32),
        PYTHON,
        NATIVE,
    )
    frames, symbolized_frame = _frame_contents(slots, symbols, frame_slot, frame_sym_row, slot_codes)

    rows = pa.table(
        {
            "stack_id": pa.array(stack, pa.int64()),
            "depth": pa.array(depth, pa.int32()),
            "slot": pa.array(slot, pa.int32()),
            "chain_depth": pa.array(chain_depth, pa.int32()),
            "frame": pa.array(frame_of_row, pa.int32()),
        }
    )

    # Per stack: frame count and the innermost symbolized frame (the call site without a user frame).
    stacks, first, counts = _unique(stack)
    symbolized = symbolized_frame[frame_of_row] if len(frame_of_row) else np.zeros(0, bool)
    sym_depth_out = np.full(len(stacks), -1, dtype=np.int32)
    if symbolized.any():
        with_frame, first_symbolized, _ = _unique(stack[symbolized])
        sym_depth_out[np.searchsorted(stacks, with_frame)] = depth[np.flatnonzero(symbolized)[first_symbolized]]
    return Frames(rows, frames, counts.astype(np.int64), stacks.astype(np.int64), sym_depth_out)


def _frame_contents(
    slots: Slots, symbols: pa.Table, owner: np.ndarray, sym_row: np.ndarray, slot_codes: np.ndarray
) -> tuple[pa.Table, np.ndarray]:
    """The content of frames (one per distinct frame), each given by an expanded row showing it: the
    row's slot and symbols row (-1 for a slot's own row); and whether each has a function name
    (markers never count)."""
    chain = sym_row >= 0
    kind_codes = slots.kind[owner]
    n_sym = symbols.num_rows
    slot_row = np.where(chain, -1, owner)

    def choose(symbol_column: str, slot_values: pa.Array) -> pa.Array:
        sym_values = _flat(symbols[symbol_column]).cast(pa.string()) if n_sym else pa.array([], pa.string())
        from_symbols = _take(sym_values, np.where(chain, sym_row, -1))
        from_slots = _plain(_take(_flat(slot_values), slot_row)).cast(pa.string())
        return pc.if_else(pa.array(chain), from_symbols, from_slots)

    native = kind_codes == NATIVE
    function = choose("function", slots.function)
    file = choose("file", slots.file)
    sym_line = pc.fill_null(symbols["line"], 0).to_numpy().astype(np.int64) if n_sym else np.zeros(0, np.int64)
    sym_line[sym_line <= 0] = -1
    line = np.where(chain, sym_line[np.maximum(sym_row, 0)] if n_sym else -1, slots.line[owner])
    slot_inlined = slots.inlined[owner] if slots.inlined is not None else False
    inlined = np.where(
        chain,
        symbols["inlined"].to_numpy(zero_copy_only=False)[np.maximum(sym_row, 0)] if n_sym else False,
        slot_inlined,
    )
    unresolved = np.where(slot_codes[owner] < 0, NO_MODULE_REASON, NOT_SYMBOLIZED_REASON)
    slot_reason = _plain(_take(_flat(slots.reason), owner)).cast(pa.string())
    slot_reason = pc.if_else(pa.array(native & ~chain), pa.array(unresolved, pa.string()), slot_reason)
    sym_reason = _flat(symbols["reason"]).cast(pa.string()) if n_sym else pa.array([], pa.string())
    reason = pc.if_else(pa.array(chain), _take(sym_reason, np.where(chain, sym_row, -1)), slot_reason)
    first_line = np.where(kind_codes == PYTHON, slots.first_line[owner], -1).astype(np.int32)
    is_native = kind_codes != PYTHON
    frames = pa.table(
        {
            "kind": kind_names().take(pa.array(kind_codes.astype(np.int64))),
            "function": function,
            "file": file,
            "line": pa.array(line.astype(np.int32), pa.int32(), mask=line < 0),
            "first_line": pa.array(first_line, pa.int32(), mask=first_line < 0),
            "module": _plain(_take(_flat(slots.module), np.where(is_native, owner, -1))),
            "module_key": _plain(_take(_flat(slots.module_key), np.where(is_native, owner, -1))),
            "address": pa.array(slots.address[owner], pa.uint64(), mask=~is_native),
            "exact": pa.array(slots.exact[owner], pa.bool_(), mask=~native),
            "inlined": pa.array(inlined.astype(bool), pa.bool_()),
            "reason": reason,
        }
    )
    symbolized = (kind_codes != MARKER) & pc.is_valid(function).to_numpy(zero_copy_only=False)
    return frames, symbolized


def _unique(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.unique(values, return_index=True, return_counts=True), in one pass where the values are
    already in order (a layout's rows come stack after stack, by increasing id) rather than a sort."""
    if len(values) and not np.all(values[1:] >= values[:-1]):
        return np.unique(values, return_index=True, return_counts=True)
    first = (
        np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]])) if len(values) else np.zeros(0, np.int64)
    )
    counts = np.diff(np.append(first, len(values)))
    return values[first], first, counts
