"""Collapsed stacks (`outer;...;inner COUNT`, one line per stack) for flamegraph.pl, inferno and speedscope.

Frames are named as in `frames.line_label`, outermost first; inlined frames are frames of their
own. Frame text is escaped so that it cannot break the format: `%`, `;`, CR and LF become
`%25`, `%3B`, `%0D` and `%0A` (percent-encoding: the tools split on `;` and on the last space,
and a reader can decode the names). Stacks whose text comes out equal (the same code path at two
addresses) keep a line each, so every line's count is one stack's count in the database; the
tools add equal lines up. Events without a stack count under one `[no stack]` frame, so the
lines add up to the events.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.export.frames import NO_STACK, location_labels
from tbpipe.pipeline.export.source import ExportSource

_ESCAPES = (("%", "%25"), (";", "%3B"), ("\r", "%0D"), ("\n", "%0A"))


def escape_frame(text: str) -> str:
    for raw, escaped in _ESCAPES:
        text = text.replace(raw, escaped)
    return text


def unescape_frame(text: str) -> str:
    for raw, escaped in reversed(_ESCAPES):
        text = text.replace(escaped, raw)
    return text


def _location_texts(source: ExportSource) -> tuple[pa.Table, list[str]]:
    """The chosen stacks and, per location (id - 1), its escaped frames outermost first, `;`-joined."""
    located = source.stack_locations()
    texts = [
        ";".join(escape_frame(label) for label in reversed(location_labels(location)))
        for location in located.locations.to_pylist()
    ]
    return located.stacks, texts


def write_collapsed(source: ExportSource, out: BinaryIO) -> int:
    """Writes the collapsed stacks of the source's events to `out`, one line per stack (sorted by
    stack id); returns the events they count."""
    stacks, texts = _location_texts(source)
    counts = source.stack_counts()
    counted_ids = counts["stack_id"].to_numpy(zero_copy_only=False)
    counted = counts["events"].to_numpy()
    stack_ids = stacks["stack_id"].to_numpy()
    # Where each stack's count is (both lists are sorted by stack id; NULL, no stack, sorts first).
    has_stack = ~counts["stack_id"].is_null().to_numpy(zero_copy_only=False)
    known = counted_ids[has_stack].astype(np.int64)
    position = np.searchsorted(known, stack_ids)
    assert np.array_equal(known[position], stack_ids), "every stack with frames is a counted stack"
    events = counted[has_stack][position]

    total = 0
    lines: list[str] = []
    for location_ids, count in zip(stacks["location_ids"].to_pylist(), events.tolist()):
        lines.append(f"{';'.join([texts[i - 1] for i in reversed(location_ids)])} {count}")
        total += count
        if len(lines) >= 4096:
            out.write(("\n".join(lines) + "\n").encode())
            lines.clear()
    # Events without a stack, and stacks without frames, under one pseudo frame.
    framed = set(stack_ids.tolist())
    unframed = int(counted[~has_stack].sum()) + sum(
        int(n) for sid, n in zip(known.tolist(), counted[has_stack].tolist()) if sid not in framed
    )
    if unframed:
        lines.append(f"{NO_STACK} {unframed}")
        total += unframed
    if lines:
        out.write(("\n".join(lines) + "\n").encode())
    return total
