"""The `triton` source: a `triton_launch` event for every Triton kernel launch.

Triton calls a launch-enter hook on the launching thread, with the GIL held,
just before each launch; the event is recorded there with the combined stack.
Hook APIs, newest first:
  - triton >= 3.4: `triton.knobs.runtime.launch_enter_hook` is a HookChain
    (`.add(fn)` / `.remove(fn)`), shared politely with other tools (proton);
  - triton 3.3: `triton.knobs.runtime.launch_enter_hook` is a single callable;
  - triton <= 3.2: `triton.compiler.CompiledKernel.launch_enter_hook`, a class
    attribute holding a single callable.
For the single-callable forms a hook already there is kept and called after
ours, and put back when the source stops (unless someone replaced ours since).

Event: kind `triton_launch`, name = the kernel's name, attributes grid
([x, y, z]), stream and function (the CUfunction: equal to the `function` of the
`cuda` source's cuLaunchKernel event for the same launch). Triton >= 3.0 hands
the hook only {name, function, stream}, plus what a kernel's own
launch_metadata adds lazily (never evaluated here: it may be costly); the grid
is read from the launcher's frame (`gridX/gridY/gridZ` of the driver's
launcher, or `grid_0..2` of JITFunction.run), and left out when neither is
found. Triton 2.x passed the launcher's arguments themselves, grid first.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tbpipe import _native
from tbpipe.capture import after_import


@dataclass
class TritonHandle:
    status: str
    api: str | None = None  # "hook_chain", "knob" or "compiled_kernel" once installed


@dataclass
class _Installed:
    api: str
    undo: Callable[[], None] = field(repr=False)


class _State:
    def __init__(self) -> None:
        self.installed: _Installed | None = None
        self.lock = threading.RLock()


_state = _State()
_triton = after_import.AttachWhenImported("triton", "triton", "Triton", lambda triton: _install(triton), _state.lock)


def _after_fork_in_child() -> None:
    # A parent thread that held the lock at fork time does not exist in the
    # child; waiting for it would hang the child's session start.
    _state.lock = _triton.lock = threading.RLock()


def start() -> TritonHandle:
    with _state.lock:
        status = _triton.start()
        return TritonHandle(status, _state.installed.api if _state.installed else None)


def stop(handle: TritonHandle | None = None) -> None:
    with _state.lock:
        _triton.cancel()
        installed, _state.installed = _state.installed, None
        if installed is not None:
            installed.undo()


# -- the hook ----------------------------------------------------------------


def launch_enter_hook(*args: Any, **kwargs: Any) -> None:
    """Records one launch; never raises into Triton's launcher."""
    try:
        name, attrs = describe_launch(args, sys._getframe(1))
        _native.record("triton_launch", name, **attrs)
    except Exception:
        pass


def describe_launch(args: tuple[Any, ...], caller: Any) -> tuple[str, dict[str, Any]]:
    """(kernel name, attributes) from what a launch hook receives."""
    metadata = _launch_metadata(args[0]) if len(args) == 1 else None
    if metadata is not None:
        attrs: dict[str, Any] = {}
        grid = _grid_from_frames(caller)
        if grid is not None:
            attrs["grid"] = grid
        for key in ("stream", "function"):
            value = dict.get(metadata, key)
            if isinstance(value, int):
                attrs[key] = value
        return str(dict.get(metadata, "name") or "<unknown triton kernel>"), attrs
    # Triton 2.x: the launcher's own arguments, grid first, the CompiledKernel among them.
    attrs = {}
    if len(args) >= 3 and all(isinstance(a, int) for a in args[:3]):
        attrs["grid"] = [int(a) for a in args[:3]]
    name = None
    for arg in args:
        metadata = getattr(arg, "metadata", None)
        if metadata is not None and hasattr(arg, "asm"):
            name = getattr(arg, "name", None) or (metadata.get("name") if isinstance(metadata, dict) else None)
            break
    return str(name or "<unknown triton kernel>"), attrs


def _launch_metadata(value: Any) -> dict | None:
    """The plain metadata dict of a launch hook's argument, without evaluating anything lazy.

    Triton 3.0-3.2 pass a dict subclass whose callable values are computed on
    access (dict.get skips that); later versions pass an object holding a plain
    dict in `.data` and lazy extras that only its .get() computes."""
    data = getattr(value, "data", None)
    if isinstance(data, dict):
        return data
    return value if isinstance(value, dict) else None


_GRID_NAMES = (("gridX", "gridY", "gridZ"), ("grid_0", "grid_1", "grid_2"))


def _grid_from_frames(frame: Any, depth: int = 6) -> list[int] | None:
    while frame is not None and depth > 0:
        names = frame.f_code.co_varnames
        for x, y, z in _GRID_NAMES:
            if x in names:
                local = frame.f_locals
                grid = [local.get(x), local.get(y, 1), local.get(z, 1)]
                if all(isinstance(v, int) for v in grid):
                    return [int(v) for v in grid]
        frame = frame.f_back
        depth -= 1
    return None


# -- installing into each API -------------------------------------------------------


def _install(triton: Any) -> str:
    if _state.installed is not None:
        return _state.installed.api
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    current = getattr(runtime, "launch_enter_hook", None) if runtime is not None else None
    if current is not None and callable(getattr(current, "add", None)) and callable(getattr(current, "remove", None)):
        current.add(launch_enter_hook)
        _state.installed = _Installed("hook_chain", lambda: current.remove(launch_enter_hook))
    elif runtime is not None and hasattr(runtime, "launch_enter_hook"):
        _state.installed = _Installed("knob", _replace_single_hook(runtime, "launch_enter_hook"))
    else:
        from triton.compiler import CompiledKernel

        _state.installed = _Installed("compiled_kernel", _replace_single_hook(CompiledKernel, "launch_enter_hook"))
    return _state.installed.api


def _replace_single_hook(owner: Any, attribute: str) -> Callable[[], None]:
    previous = getattr(owner, attribute, None)
    if previous is None:
        hook: Callable[..., None] = launch_enter_hook
    else:

        def hook(*args: Any, **kwargs: Any) -> None:
            launch_enter_hook(*args, **kwargs)
            previous(*args, **kwargs)

    setattr(owner, attribute, hook)

    def undo() -> None:
        if getattr(owner, attribute, None) is hook:
            setattr(owner, attribute, previous)

    return undo
