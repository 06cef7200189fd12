"""One line of a location as text, the way profilers' flame graphs name frames: `function (file:line)`.

Shared by the collapsed-stack and Chrome trace writers (pprof keeps functions, files and lines
apart). A native frame without a function shows its module and address (`libfoo.so+0x1a2b`), one
without a file its module (`memcpy (libc.so.6)`); an inlined frame ends in ` [inlined]`; a marker
(the native walk stopped there) is its text in brackets.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NO_STACK = "[no stack]"


def _module_name(module: str | None) -> str:
    return os.path.basename(module) if module else "??"


def line_label(kind: str, line: dict[str, Any], module: str | None, address: int | None) -> str:
    """`line` is one entry of `StackLocations.locations.lines` of a location of `kind`."""
    function, file, number = line["function"], line["file"], line["line"]
    if kind == "marker":
        return f"[{function or 'native walk stopped'}]"
    if kind == "native" and not function:
        return f"{_module_name(module)}+0x{address or 0:x}"
    where = f"{file}:{number if number is not None else '?'}" if file else _module_name(module)
    label = f"{function or '<unknown code>'} ({where})"
    return label + " [inlined]" if line["inlined"] else label


def location_labels(location: dict[str, Any]) -> list[str]:
    """The labels of a location's lines, innermost first."""
    kind, module, address = location["kind"], location["module"], location["address"]
    return [line_label(kind, line, module, address) for line in location["lines"]]


def stack_texts(locations: Any, stacks: Any, per_location: list[list[str]]) -> tuple[Any, Any]:
    """Each stack's texts, innermost first, from one list of texts per location (innermost first).

    `locations`/`stacks` are `StackLocations`' tables; `per_location[i]` belongs to location id i + 1.
    Returns (stack_ids, texts): a numpy array and a ListArray, one entry per row of `stacks`.
    """

    assert len(per_location) == locations.num_rows
    location_ids = stacks["location_ids"].combine_chunks()
    if isinstance(location_ids, pa.ChunkedArray):  # an empty table
        location_ids = pa.array([], pa.list_(pa.int64()))
    # Large types: the texts of a big export pass 2 GiB.
    per_slot = pa.array(per_location, pa.large_list(pa.large_string())).take(pc.subtract(location_ids.flatten(), 1))
    slot_ends = np.cumsum(pc.list_value_length(per_slot).to_numpy(zero_copy_only=False), dtype=np.int64)
    slot_ends = np.concatenate([np.zeros(1, np.int64), slot_ends])
    list_offsets = location_ids.offsets.to_numpy()
    stack_offsets = slot_ends[list_offsets - list_offsets[0]]
    texts = pa.LargeListArray.from_arrays(pa.array(stack_offsets, pa.int64()), per_slot.flatten())
    return stacks["stack_id"].to_numpy(), texts
