"""Raw stacks (schemas.raw tables) → symbolized frames in combined order.

Used by the in-process `tbpipe.pipeline.symbolize` and by the offline readers,
so both print the same traceback for the same raw stack.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa

from tbpipe.pipeline.stacks.order import combined_order
from tbpipe.pipeline.symbols import ModuleRef
from tbpipe.schemas.raw import (
    NATIVE_FRAME_EXACT_PC,
    NATIVE_FRAME_MARKER,
    STACK_NO_NATIVE,
    STOP_REASONS,
)

Frame = dict[str, Any]


def frame(
    kind: str,
    name: str,
    filename: str | None,
    line: int | None,
    module: str | None,
    inlined: bool = False,
    generated: bool = False,
) -> Frame:
    """`generated`: a frame of code torch.compile or Triton generated (the database knows; raw stacks do not)."""
    out = {"kind": kind, "name": name, "filename": filename, "line": line, "module": module, "inlined": inlined}
    if generated:
        out["generated"] = True
    return out


def symbolize_stacks(stacks: pa.Table, modules: pa.Table, code: pa.Table, symbolizer: Any) -> list[list[Frame]]:
    """Frames of each row of `stacks`, innermost first, Python and native interleaved."""

    module_rows = {row["module_index"]: row for row in modules.to_pylist()}
    code_rows = {row["code_id"]: row for row in code.to_pylist()}
    stack_rows = stacks.select(["status", "native", "python"]).to_pylist()

    # Each (module, address, exact) is looked up once, however many stacks share it.
    wanted: dict[int, dict[tuple[int, bool], int]] = {}
    for row in stack_rows:
        for native in row["native"]:
            if native["flags"] & NATIVE_FRAME_MARKER or native["module"] not in module_rows:
                continue
            keys = wanted.setdefault(native["module"], {})
            keys.setdefault((native["offset"], bool(native["flags"] & NATIVE_FRAME_EXACT_PC)), len(keys))
    refs = {
        index: ModuleRef(build_id=module_rows[index]["build_id"] or "", path=module_rows[index]["path"])
        for index in wanted
    }
    requests = {refs[i]: ([a for a, _ in keys], [e for _, e in keys]) for i, keys in wanted.items()}
    results = symbolizer.symbolize_many(requests) if requests else {}

    def native_chain(native: dict[str, Any]) -> list[Frame]:
        offset, flags = native["offset"], native["flags"]
        if flags & NATIVE_FRAME_MARKER:
            reason = STOP_REASONS.get(offset, f"stop reason {offset}")
            return [frame("marker", f"<native walk stopped: {reason}>", None, None, None)]
        module = module_rows.get(native["module"])
        if module is None:
            return [frame("native", f"0x{offset:x}", None, None, None)]
        position = wanted[native["module"]][(offset, bool(flags & NATIVE_FRAME_EXACT_PC))]
        fallback_name = f"{os.path.basename(module['path'])}+0x{offset:x}"
        return [
            frame("native", f.function or fallback_name, f.file, f.line, module["path"], f.inlined)
            for f in results[refs[native["module"]]][position]
        ]

    def python_frame(python: dict[str, Any]) -> Frame:
        info = code_rows.get(python["code_id"])
        line = python["line"] if python["line"] >= 0 else None
        if info is None:
            return frame("python", "<unknown code>", None, line, None)
        return frame("python", info["qualname"], info["filename"], line, None)

    out = []
    for row in stack_rows:
        order = combined_order(
            [n["flags"] for n in row["native"]],
            [p["flags"] for p in row["python"]],
            native_captured=not (row["status"] & STACK_NO_NATIVE),
        )
        frames: list[Frame] = []
        for kind, index in order.slots:
            if kind == "python":
                frames.append(python_frame(row["python"][index]))
            else:
                frames.extend(native_chain(row["native"][index]))
        if order.problem:
            frames.append(frame("marker", f"<{order.problem}>", None, None, None))
        out.append(frames)
    return out


def format_frames(frames: list[Frame]) -> str:
    """One frame a line, `file:line:function`, innermost first; inlined and generated frames marked."""
    lines = []
    for f in frames:
        if f["kind"] == "marker":
            lines.append(f["name"])
            continue
        where = f["filename"] or (os.path.basename(f["module"]) if f["module"] else "??")
        line = f["line"] if f["line"] is not None else "?"
        suffix = (" [inlined]" if f.get("inlined") else "") + (" [generated]" if f.get("generated") else "")
        lines.append(f"{where}:{line}:{f['name']}{suffix}")
    return "\n".join(lines)
