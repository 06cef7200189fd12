"""In-process symbolization of raw tracebacks, batched (like torch's symbolize_tracebacks).

The tracebacks are turned into the same tables a run directory holds and go
through the same code as the offline pipeline: native addresses through the
bulk symbolizer (debug info found by build-ID, inline chains), Python frames
through the code objects interned in this process.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from tbpipe import _native
from tbpipe.pipeline.stacks.render import Frame, symbolize_stacks
from tbpipe.pipeline.symbols import Symbolizer
from tbpipe.schemas import raw

_default_symbolizer = None


def _symbolizer():
    global _default_symbolizer
    if _default_symbolizer is None:
        _default_symbolizer = Symbolizer(jobs=1)
    return _default_symbolizer


def _lines(python_frames: list[tuple[int, int, int]]) -> list[int]:
    if not python_frames:
        return []
    codes, offsets, flags = zip(*python_frames)
    lines = array.array("i")
    lines.frombytes(
        _native.resolve_lines(
            array.array("Q", codes).tobytes(), array.array("i", offsets).tobytes(), array.array("I", flags).tobytes()
        )
    )
    return lines.tolist()


def _tables(tracebacks: Sequence[Any]) -> tuple[pa.Table, pa.Table, pa.Table]:
    modules = {m["index"]: m for m in _native._modules()}
    stack_rows, used_modules, used_codes = [], set(), set()
    python_raw = [frame for tb in tracebacks for frame in tb.python]
    lines = _lines(python_raw)
    position = 0
    for tb in tracebacks:
        native = []
        for pc, module, flags in tb.native:
            known = modules.get(module)
            native.append(
                {
                    "module": module if known else -1,
                    "offset": pc - known["load_bias"] if known else pc,
                    "flags": flags,
                }
            )
            if known:
                used_modules.add(module)
        python = []
        for code_id, offset, flags in tb.python:
            python.append({"code_id": code_id, "offset": offset, "line": lines[position], "flags": flags})
            position += 1
            used_codes.add(code_id)
        stack_rows.append({"stack_id": 0, "thread_id": 0, "status": tb.status, "native": native, "python": python})
    module_rows = [
        {
            "module_index": index,
            "path": modules[index]["path"],
            "build_id": modules[index]["build_id"] or None,
            "load_bias": modules[index]["load_bias"],
            "exec_ranges": [],
            "eval_ranges": [],
        }
        for index in sorted(used_modules)
    ]
    code_ids = sorted(used_codes)
    code_rows = [
        {"code_id": i, "filename": info[0], "qualname": info[1], "first_line": info[2]}
        for i, info in zip(code_ids, _native.code_info(code_ids))
        if info is not None
    ]
    return (
        pa.Table.from_pylist(stack_rows, schema=raw.stacks_schema()),
        pa.Table.from_pylist(module_rows, schema=raw.modules_schema()),
        pa.Table.from_pylist(code_rows, schema=raw.code_schema()),
    )


def symbolize(tracebacks: Sequence[Any], *, symbolizer: Any = None) -> list[list[Frame]]:
    """Per traceback, its frames innermost first in combined order.

    Each frame is {"kind": "python"|"native"|"marker", "name", "filename",
    "line", "module", "inlined"}; an inlined native call expands into several
    frames, innermost first, all but the outermost of them with inlined=True.
    """
    stacks, modules, code = _tables(list(tracebacks))
    return symbolize_stacks(stacks, modules, code, symbolizer or _symbolizer())
