"""The combined order: Python frames put where the C code ran them.

Each native eval-loop frame (CPython's _PyEval_EvalFrameDefault and its clones)
stands for the run of Python frames it executes: from the next unclaimed Python
frame up to and including the next entry frame. CPython 3.11+ runs several
Python frames in one C call, so counting one Python frame per eval-loop frame
(or appending leftovers at the bottom) puts frames in the wrong place.

The reference is `combined_order`, one stack in plain Python (the in-process
rendering uses it too). The fast path is `combined_orders`: a batch of stacks in
one pass each in the extension (native/combined_order.cpp), which the ingest
and the lake lay out with (`layout.combined_slots`). tests/test_rules.py holds
the two equal on random stacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe import _native
from tbpipe.schemas.raw import NATIVE_FRAME_EVAL_LOOP, NATIVE_FRAME_MARKER, PYTHON_FRAME_ENTRY, STACK_NO_NATIVE

SlotKind = Literal["native", "python"]

# Why an order cannot be fully trusted; {} is the count of Python frames no eval-loop frame claimed.
STOPPED_EARLY = "native walk stopped early; {} outer Python frames follow it"
UNMATCHED = "{} Python frames had no eval-loop frame to match; showing the Python stack alone"


@dataclass(frozen=True)
class CombinedOrder:
    slots: list[tuple[SlotKind, int]]  # (kind, index into that kind's frames), innermost first
    # Why the order could not be fully trusted, or None: the native walk was
    # cut short, or more Python entry frames than eval-loop frames were found.
    problem: str | None = None


def combined_order(
    native_flags: Sequence[int], python_flags: Sequence[int], native_captured: bool = True
) -> CombinedOrder:
    """The reference: one stack's slots from its frames' flags (innermost first)."""
    if not native_captured or not native_flags:
        return CombinedOrder([("python", i) for i in range(len(python_flags))])
    slots: list[tuple[SlotKind, int]] = []
    next_python = 0
    truncated = False
    for index, flags in enumerate(native_flags):
        if flags & NATIVE_FRAME_MARKER:
            truncated = True
            slots.append(("native", index))
            continue
        if flags & NATIVE_FRAME_EVAL_LOOP and next_python < len(python_flags):
            while next_python < len(python_flags):
                slots.append(("python", next_python))
                next_python += 1
                if python_flags[next_python - 1] & PYTHON_FRAME_ENTRY:
                    break
            continue
        slots.append(("native", index))
    left = len(python_flags) - next_python
    if left == 0:
        return CombinedOrder(slots)
    if truncated:
        # The walk stopped before the outer eval-loop frames: the remaining
        # Python frames are outer ones and belong after the marker.
        slots.extend(("python", i) for i in range(next_python, len(python_flags)))
        return CombinedOrder(slots, STOPPED_EARLY.format(left))
    # A complete native walk that leaves Python frames unclaimed means the two
    # walks disagree; guessing would misplace frames, so show Python alone.
    return CombinedOrder([("python", i) for i in range(len(python_flags))], UNMATCHED.format(left))


@dataclass(frozen=True)
class CombinedOrders:
    """Slots of a batch of stacks, stack after stack, each stack's in combined order."""

    owner: np.ndarray  # int64 per slot: the stack's index in the batch
    source: np.ndarray  # int64 per slot: its row in the batch's native or Python frames
    is_python: np.ndarray  # bool per slot
    slot: np.ndarray  # int32 per slot: its position in its stack
    problem: pa.Array  # string per stack: `CombinedOrder.problem`, null when the order can be trusted


def combined_orders(
    status: np.ndarray,
    native_lengths: np.ndarray,
    python_lengths: np.ndarray,
    native_flags: np.ndarray,
    python_flags: np.ndarray,
) -> CombinedOrders:
    """The fast path: `combined_order` of every stack of a batch, one pass each in the extension.
    Each stack's frames lie one after another in the flag arrays (innermost first); a stack whose
    `status` has STACK_NO_NATIVE is ordered as one whose native frames were not captured."""
    owner, source, is_python, slot, has_native, truncated, leftover = (
        np.frombuffer(data, dtype)
        for data, dtype in zip(
            _native.combined_order(
                np.ascontiguousarray(native_lengths, dtype=np.int64),
                np.ascontiguousarray(python_lengths, dtype=np.int64),
                np.ascontiguousarray(status, dtype=np.uint32),
                np.ascontiguousarray(native_flags, dtype=np.uint32),
                np.ascontiguousarray(python_flags, dtype=np.uint32),
                STACK_NO_NATIVE,
                NATIVE_FRAME_MARKER,
                NATIVE_FRAME_EVAL_LOOP,
                PYTHON_FRAME_ENTRY,
            ),
            (np.int64, np.int64, np.bool_, np.int32, np.bool_, np.bool_, np.int64),
        )
    )
    return CombinedOrders(owner, source, is_python, slot, _problems(has_native, truncated, leftover))


def _problems(has_native: np.ndarray, truncated: np.ndarray, leftover: np.ndarray) -> pa.Array:
    """`CombinedOrder.problem` per stack, the text made only for the few stacks that have one."""
    with_problem = np.flatnonzero(has_native & (leftover > 0))
    if not len(with_problem):
        return pa.nulls(len(leftover), pa.string())
    count = pc.cast(pa.array(leftover[with_problem]), pa.string())

    def filled(text: str) -> pa.Array:  # the text with each stack's count in place of {}
        before, after = text.split("{}")
        return pc.binary_join_element_wise(before, count, after, "")

    problem = pc.if_else(pa.array(truncated[with_problem]), filled(STOPPED_EARLY), filled(UNMATCHED))
    at = np.full(len(leftover), -1, dtype=np.int64)
    at[with_problem] = np.arange(len(with_problem))
    return problem.take(pa.array(np.maximum(at, 0), pa.int64(), mask=at < 0))
