"""Building SymCaches with `symbolic` and looking addresses up in them, fast.

symbolic's own `SymCache.lookup` wraps every frame in a Python object and decodes every string
(~9 us per libpython address); this module calls the same C entry point through symbolic's cffi
handle and reads the result array in one go, memoizing function names by their address in the
cache (they point into the mapped SymCache) and file paths by content, which halves the cost.
"""

from __future__ import annotations

import struct
from typing import Any

from tbpipe.pipeline.symbols.model import ElfFileError

# A raw frame as lookups produce it: (function or None, file or None, line (0 = none)).
RawFrame = tuple

_MAX_DECODED_PATHS = 1 << 18


def build_symcache(path: str, build_id: str | None) -> tuple[bytes, frozenset[str]]:
    """SymCache bytes for the object in `path`, and symbolic's feature set for it.

    `build_id` (when given) must equal the object's code ID: symbolic must never build from a
    different object than the one the locator vetted (fat archives hold several).
    """
    import io

    from symbolic.debuginfo import Archive

    try:
        archive = Archive.open(path)
        objects = list(archive.iter_objects())
    except Exception as error:
        raise ElfFileError(f"{path}: symbolic cannot read it ({_brief(error)})") from None
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
        raise ElfFileError(f"{path}: building the SymCache failed ({_brief(error)})") from None
    return buffer.getvalue(), features


def _brief(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]


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
    """Address -> inline chain (innermost first) over one SymCache held in memory."""

    def __init__(self, data: bytes, strings: StringTable | None = None):
        from symbolic._lowlevel import ffi, lib
        from symbolic.symcache import SymCache

        try:
            self._cache = SymCache.from_bytes(data)
        except Exception as error:
            raise ElfFileError(f"stored SymCache is unreadable ({_brief(error)})") from None
        self._ffi = ffi
        self._lib = lib
        # SymbolicSourceLocation: sym_addr, instr_addr, line, then three SymbolicStr
        # (data pointer, length, owned flag) for lang, symbol and full_path.
        self._layout = _layout(ffi)
        self._path_offset = ffi.offsetof("SymbolicSourceLocation", "full_path")
        self.strings = strings if strings is not None else StringTable()
        self._name_ids: dict[int, int] = {}  # symbol pointer (into the SymCache) -> string id
        self._path_ids: dict[bytes, int] = {}

    def lookup_flat(self, addresses: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """(frame count per address, then per frame: function id, file id, line), frames of each
        address innermost first and addresses in order; ids index `self.strings` (-1: none)."""
        ffi = self._ffi
        lookup = self._lib.symbolic_symcache_lookup
        free_result = self._lib.symbolic_lookup_result_free
        free_str = self._lib.symbolic_str_free
        addressof = ffi.addressof
        buffer = ffi.buffer
        unpack = ffi.unpack
        cast = ffi.cast
        iter_unpack = self._layout.iter_unpack
        size = self._layout.size
        path_offset = self._path_offset
        intern = self.strings.intern
        name_ids = self._name_ids
        path_ids = self._path_ids
        handle = self._cache._objptr
        counts: list[int] = []
        functions: list[int] = []
        files: list[int] = []
        lines: list[int] = []
        add_count, add_function, add_file, add_line = counts.append, functions.append, files.append, lines.append
        for address in addresses:
            result = lookup(handle, address)
            count = result.len
            add_count(count)
            if count:
                items = result.items
                owned_at = int(cast("uintptr_t", items)) + path_offset
                for line, symbol_ptr, symbol_len, path_ptr, path_len, path_owned in iter_unpack(
                    buffer(items, count * size)
                ):
                    name_id = name_ids.get(symbol_ptr)
                    if name_id is None:
                        text = unpack(cast("char *", symbol_ptr), symbol_len).decode("utf-8", "replace")
                        name_id = name_ids[symbol_ptr] = intern(text or None)
                    if path_len:
                        raw = unpack(cast("char *", path_ptr), path_len)
                        path_id = path_ids.get(raw)
                        if path_id is None:
                            path_id = intern(raw.decode("utf-8", "replace"))
                            if len(path_ids) < _MAX_DECODED_PATHS:
                                path_ids[raw] = path_id
                    else:
                        path_id = -1
                    if path_owned:
                        free_str(cast("SymbolicStr *", owned_at))
                    owned_at += size
                    add_function(name_id)
                    add_file(path_id)
                    add_line(line)
            free_result(addressof(result))
        return counts, functions, files, lines

    def lookup_many(self, addresses: list[int]) -> list[list[RawFrame]]:
        """For each address its frames as (function, file, line), innermost first."""
        counts, functions, files, lines = self.lookup_flat(addresses)
        strings = self.strings.strings
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


def _layout(ffi: Any) -> struct.Struct:
    # Read only what is used: skip sym_addr/instr_addr (16 bytes) and lang (24 bytes).
    offset_line = ffi.offsetof("SymbolicSourceLocation", "line")
    offset_symbol = ffi.offsetof("SymbolicSourceLocation", "symbol")
    offset_path = ffi.offsetof("SymbolicSourceLocation", "full_path")
    str_size = ffi.sizeof("SymbolicStr")
    owned_at = ffi.offsetof("SymbolicStr", "owned")
    size = ffi.sizeof("SymbolicSourceLocation")
    pointer = ffi.sizeof("void *")
    length = ffi.sizeof("uintptr_t")
    ptr_code = "Q" if pointer == 8 else "I"
    fmt = (
        f"={offset_line}x I{offset_symbol - offset_line - 4}x"
        f"{ptr_code}{ptr_code}{str_size - pointer - length}x"
        f"{offset_path - offset_symbol - str_size}x"
        f"{ptr_code}{ptr_code}{owned_at - pointer - length}x?{size - offset_path - owned_at - 1}x"
    )
    layout = struct.Struct(fmt)
    if layout.size != size:
        raise RuntimeError("unexpected SymbolicSourceLocation layout")
    return layout
