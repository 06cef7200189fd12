"""Building SymCaches with `symbolic` and looking addresses up in them, fast.

symbolic's own `SymCache.lookup` wraps every frame in a Python object and decodes every string
(~9 us per libpython address); the extension calls the same C entry point (found through
symbolic's cffi handle) in a loop and fills result columns, interning function names by their
address in the SymCache and file paths by content (~0.3 us per address).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from tbpipe.pipeline.errors import first_line
from tbpipe.pipeline.symbols.model import ElfFileError

# A raw frame as lookups produce it: (function or None, file or None, line (0 = none)).
RawFrame = tuple


def build_symcache(path: str, build_id: str | None) -> tuple[bytes, frozenset[str]]:
    """SymCache bytes for the object in `path`, and symbolic's feature set for it.

    `build_id` (when given) must equal the object's code ID: symbolic must never build from a
    different object than the one the locator vetted (fat archives hold several).
    """
    import io

    from symbolic.debuginfo import Archive

    contents = None  # must outlive every use of the archive: symbolic reads it in place
    try:
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            # symbolic opens files by UTF-8 path only: a name that is not UTF-8 is read here.
            with open(path, "rb") as stream:
                contents = stream.read()
            archive = Archive.from_bytes(contents)
        else:
            archive = Archive.open(path)
        objects = list(archive.iter_objects())
    except Exception as error:
        raise ElfFileError(f"{path}: symbolic cannot read it ({first_line(error, 160)})") from None
    if not objects:
        raise ElfFileError(f"{path}: holds no object symbolic can read")
    chosen = objects[0]
    code_ids = [(o.code_id or "").lower() for o in objects]
    # A debuglink target without a build-ID note (vetted by its CRC) has no code ID at all.
    if build_id and any(code_ids):
        if build_id not in code_ids:
            raise ElfFileError(f"{path}: symbolic sees code ID {code_ids[0] or 'none'}, not build-ID {build_id}")
        chosen = objects[code_ids.index(build_id)]
    try:
        features = frozenset(chosen.features)
        cache = chosen.make_symcache()
        buffer = io.BytesIO()
        cache.dump_into(buffer)
    except Exception as error:
        raise ElfFileError(f"{path}: building the SymCache failed ({first_line(error, 160)})") from None
    del cache, chosen, objects, archive  # everything that points into `contents`, before it goes
    return buffer.getvalue(), features


class StringTable:
    """Strings by id, for the dictionary-encoded frame columns."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self._ids: dict[str, int] = {}

    def intern(self, text: str | None) -> int:
        if text is None:
            return -1
        found = self._ids.get(text)
        if found is None:
            found = self._ids[text] = len(self.strings)
            self.strings.append(text)
        return found


class SymCacheReader:
    """Address -> inline chain (innermost first) over one SymCache held in memory.

    Lookups run in the extension (`tbpipe._native.SymCacheLookup`), which calls symbolic's C
    entry points directly and interns every string once; this reader also serves as the string
    table (`intern`, `strings`) of the results it produces.
    """

    def __init__(self, data: bytes):
        from symbolic._lowlevel import ffi, lib
        from symbolic.symcache import SymCache

        from tbpipe import _native

        try:
            self._cache = SymCache.from_bytes(data)
        except Exception as error:
            raise ElfFileError(f"stored SymCache is unreadable ({first_line(error, 160)})") from None

        def address(function: str) -> int:
            return int(ffi.cast("uintptr_t", ffi.addressof(lib, function)))

        self._lookup = _native.SymCacheLookup(
            self._cache,
            int(ffi.cast("uintptr_t", self._cache._objptr)),
            address("symbolic_symcache_lookup"),
            address("symbolic_lookup_result_free"),
            address("symbolic_str_free"),
            _abi_layout(ffi),
        )
        self.strings: list[str] = self._lookup.strings  # live: grows as strings are interned
        self.intern = self._lookup.intern
        self.set_symbols = self._lookup.set_symbols
        self.set_code_ranges = self._lookup.set_code_ranges
        self.resolve = self._lookup.resolve
        self.symbol_id = self._lookup.symbol_id

    def lookup_flat(self, addresses: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """(frame count per address, then per frame: function id, file id, line), frames of each
        address innermost first and addresses in order; ids index `self.strings` (-1: none)."""
        return self._lookup.lookup_flat(array("Q", addresses))

    def lookup_many(self, addresses: Sequence[int]) -> list[list[RawFrame]]:
        """For each address its frames as (function, file, line), innermost first."""
        counts, functions, files, lines = self.lookup_flat(addresses)
        strings = self.strings
        out = []
        pos = 0
        for count in counts:
            out.append(
                [
                    (strings[f] if f >= 0 else None, strings[p] if p >= 0 else None, line)
                    for f, p, line in zip(
                        functions[pos : pos + count], files[pos : pos + count], lines[pos : pos + count]
                    )
                ]
            )
            pos += count
        return out


def _abi_layout(ffi: Any) -> dict[str, int]:
    """What cffi knows of symbolic's lookup structures, for the extension to check its own against."""
    return {
        "location_size": ffi.sizeof("SymbolicSourceLocation"),
        "line": ffi.offsetof("SymbolicSourceLocation", "line"),
        "symbol": ffi.offsetof("SymbolicSourceLocation", "symbol"),
        "full_path": ffi.offsetof("SymbolicSourceLocation", "full_path"),
        "str_size": ffi.sizeof("SymbolicStr"),
        "str_len": ffi.offsetof("SymbolicStr", "len"),
        "str_owned": ffi.offsetof("SymbolicStr", "owned"),
        "result_size": ffi.sizeof("SymbolicLookupResult"),
        "result_len": ffi.offsetof("SymbolicLookupResult", "len"),
    }
