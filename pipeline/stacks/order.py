"""The combined order of one stack: Python frames put where the C code ran them.

Each native eval-loop frame (CPython's _PyEval_EvalFrameDefault and its clones)
stands for the run of Python frames it executes: from the next unclaimed Python
frame up to and including the next entry frame. CPython 3.11+ runs several
Python frames in one C call, so counting one Python frame per eval-loop frame
(or appending leftovers at the bottom) puts frames in the wrong place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tbpipe.schemas.raw import NATIVE_FRAME_EVAL_LOOP, NATIVE_FRAME_MARKER, PYTHON_FRAME_ENTRY

SlotKind = Literal["native", "python"]


@dataclass(frozen=True)
class CombinedOrder:
    slots: list[tuple[SlotKind, int]]  # (kind, index into that kind's frames), innermost first
    # Why the order could not be fully trusted, or None: the native walk was
    # cut short, or more Python entry frames than eval-loop frames were found.
    problem: str | None = None


def combined_order(
    native_flags: Sequence[int], python_flags: Sequence[int], native_captured: bool = True
) -> CombinedOrder:
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
        return CombinedOrder(slots, f"native walk stopped early; {left} outer Python frames follow it")
    # A complete native walk that leaves Python frames unclaimed means the two
    # walks disagree; guessing would misplace frames, so show Python alone.
    return CombinedOrder(
        [("python", i) for i in range(len(python_flags))],
        f"{left} Python frames had no eval-loop frame to match; showing the Python stack alone",
    )
