"""Registry of event sources a session can switch on (`sources=[...]`, `--source`).

`record()` events need no source: they are always captured while a session is
active. Sources add events from elsewhere (PyTorch ops, CUDA launches, ...);
each registers itself here with a start and a stop function.

`start()` returns a handle that is passed to `stop()`. A source that is
running but can record nothing (no GPU, no CUPTI library) does not raise: its
handle has a `status` attribute, one line saying why, which the session prints
and writes into the manifest's `source_status`. A source that cannot work at all
in this process (PyTorch not installed) raises SourceError, and the session does
not start.

The built-in sources live in their own modules, imported only when a session
starts them, so importing tbpipe never imports torch or triton.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tbpipe.capture.errors import SourceError


@dataclass(frozen=True)
class Source:
    name: str
    description: str
    start: Callable[[], object]  # returns a handle passed to stop()
    stop: Callable[[object], None]


_SOURCES: dict[str, Source] = {}


def register_source(source: Source) -> None:
    _SOURCES[source.name] = source


def known_source_names() -> list[str]:
    return sorted(_SOURCES)


def resolve_sources(names: list[str] | tuple[str, ...]) -> list[Source]:
    """The registered sources for `names`, or SourceError naming the unknown one."""
    resolved = []
    for name in names:
        source = _SOURCES.get(name)
        if source is None:
            known = ", ".join(known_source_names()) or "none are registered in this version"
            raise SourceError(f"unknown event source {name!r} (known sources: {known})")
        resolved.append(source)
    return resolved


_BUILTIN_MODULES: list[str] = []

# Sources that record from inside code torch.compile generated: while one of them is on, the session
# also follows torch.compile (tbpipe.capture.torch_compile: where generated code came from, compile events).
COMPILE_AWARE_SOURCES = ("torch-ops", "cuda", "triton")


def reset_sources_after_fork_in_child() -> None:
    """Called first thing in a forked child, before the child's session starts its sources.

    A built-in source module that keeps a lock across threads remakes it in
    `_after_fork_in_child()`: a parent thread that held it is gone. Only
    modules already imported are visited (nothing is imported in a fork hook).
    """
    for module_name in _BUILTIN_MODULES:
        module = sys.modules.get(module_name)
        reset = getattr(module, "_after_fork_in_child", None)
        if reset is not None:
            reset()


def _register_builtin(name: str, description: str, module: str) -> None:
    _BUILTIN_MODULES.append(module)

    def start() -> object:
        return importlib.import_module(module).start()

    def stop(handle: object) -> None:
        importlib.import_module(module).stop(handle)

    register_source(Source(name, description, start, stop))


_register_builtin(
    "torch-ops",
    "an `op` event for every aten op PyTorch runs, forward and backward (a dispatch mode)",
    "tbpipe.capture.torch_ops",
)
_register_builtin(
    "cuda",
    "a `kernel_launch` event for every CUDA kernel launch, `graph_launch` per CUDA graph launch (CUPTI callbacks)",
    "tbpipe.capture.cuda",
)
_register_builtin(
    "triton",
    "a `triton_launch` event for every Triton kernel launch (Triton's launch-enter hook)",
    "tbpipe.capture.triton_launches",
)
