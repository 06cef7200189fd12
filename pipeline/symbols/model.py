"""The value types of the symbolization layer: what callers pass in and get back.

`ModuleRef` names a module (build-ID + the path it was loaded from), `SymbolizedFrame` is one
frame of an inline chain, `ModuleStatus` records what debug info was found for a build-ID and
why. Everything else in `tbpipe.pipeline.symbols` works in terms of these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tbpipe.pipeline.errors import TbpipeError, UsageError
from tbpipe.schemas.modulekey import normalized_build_id


class SymbolsError(TbpipeError):
    """Symbolization cannot go on (e.g. the symbol store is not writable)."""


class BadBuildIdError(UsageError):
    """A build-ID that is not 2..64 bytes of hex."""


class ElfFileError(SymbolsError):
    """A file that is missing, unreadable, truncated or not an ELF object."""


def normalize_build_id(build_id: str) -> str:
    """The build-ID as lower-case hex; `BadBuildIdError` when it cannot be one."""
    if not isinstance(build_id, str):
        raise BadBuildIdError(f"build-ID must be a hex string, not {type(build_id).__name__}")
    text = normalized_build_id(build_id)
    if text is None:
        shown = build_id if len(build_id) <= 80 else build_id[:77] + "..."
        raise BadBuildIdError(f"invalid build-ID {shown!r}: expected 4..128 hex digits (an even number)")
    return text


def short_build_id(build_id: str) -> str:
    """Build-ID abbreviated for messages (the full one is in `module_status`)."""
    return build_id if len(build_id) <= 16 else build_id[:12] + "…"


class Quality(str, enum.Enum):
    """What the store could use for a build-ID, from best to worst."""

    DWARF = "dwarf"  # line tables and inline info
    SYMBOLS = "symbols"  # function names from .symtab/.dynsym only
    NONE = "none"  # nothing usable

    @property
    def rank(self) -> int:
        return _QUALITY_RANK[self]


_QUALITY_RANK = {Quality.NONE: 0, Quality.SYMBOLS: 1, Quality.DWARF: 2}


@dataclass(frozen=True)
class ModuleRef:
    """A loaded module: its build-ID (hex) and the path it was loaded from (may not exist here).

    `build_id` may be empty when the module had no build-ID note: then only `path` is used and
    nothing is kept in the persistent store (there is no stable key to keep it under).
    """

    build_id: str
    path: str | None = None


@dataclass(frozen=True, slots=True)
class SymbolizedFrame:
    """One frame of an address's inline chain (chains are innermost first).

    `inlined` is True for every frame but the outermost one, which is the physical function.
    An address that could not be symbolized gives a single frame with `function=None` and a
    `reason`; a frame can also carry a reason when it is only partly resolved (e.g. a name
    from the symbol table but no line).
    """

    function: str | None
    file: str | None = None
    line: int | None = None
    inlined: bool = False
    reason: str | None = None


@dataclass
class ModuleStatus:
    """What was found for one build-ID, where, and why (kept per build-ID in the store)."""

    build_id: str
    quality: Quality
    reason: str
    debug_file: str | None = None  # the file the SymCache was built from
    # "debug-dir", "build-id-dir", "debuginfod-cache", "module", "debuglink", or "debuginfod URL" (downloaded)
    found_via: str | None = None
    module_path: str | None = None
    looked_in: list[str] = field(default_factory=list)
    source_key: str | None = None  # identity of the debug file the stored results come from
    debug_identity: list | None = None  # [path, size, mtime_ns, inode, device] of debug_file
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # PT_LOAD (vaddr, memsz, flags)
    upgraded_from: Quality | None = None  # set when better debug info replaced older results
    checked_at: float = 0.0

    def describe(self) -> str:
        """One line for humans: quality, file and reason."""
        return f"{self.build_id}: {self.quality.value}: {self.reason}"

    def to_json(self) -> dict:
        return {
            "build_id": self.build_id,
            "quality": self.quality.value,
            "reason": self.reason,
            "debug_file": self.debug_file,
            "found_via": self.found_via,
            "module_path": self.module_path,
            "looked_in": list(self.looked_in),
            "source_key": self.source_key,
            "debug_identity": list(self.debug_identity) if self.debug_identity else None,
            "segments": [list(s) for s in self.segments],
            "upgraded_from": self.upgraded_from.value if self.upgraded_from else None,
            "checked_at": self.checked_at,
        }

    @classmethod
    def from_json(cls, data: dict) -> ModuleStatus:
        return cls(
            build_id=str(data["build_id"]),
            quality=Quality(data["quality"]),
            reason=str(data.get("reason") or ""),
            debug_file=data.get("debug_file"),
            found_via=data.get("found_via"),
            module_path=data.get("module_path"),
            looked_in=[str(x) for x in data.get("looked_in") or []],
            source_key=data.get("source_key"),
            debug_identity=list(data["debug_identity"]) if data.get("debug_identity") else None,
            segments=[(int(a), int(b), int(c)) for a, b, c in data.get("segments") or []],
            upgraded_from=Quality(data["upgraded_from"]) if data.get("upgraded_from") else None,
            checked_at=float(data.get("checked_at") or 0.0),
        )
