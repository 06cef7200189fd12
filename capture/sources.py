"""Registry of event sources a session can switch on (`sources=[...]`, `--source`).

`record()` events need no source: they are always captured while a session is
active. Sources add events from elsewhere (PyTorch ops, CUDA launches, ...);
each registers itself here with a start and a stop function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
