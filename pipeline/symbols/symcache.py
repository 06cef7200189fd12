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
    if build_id:
        matching = [o for o in objects if (o.code_id or "").lower() == build_id]
        if not matching:
            raise ElfFileError(f"{path}: symbolic sees code ID {objects[0].code_id}, not build-ID {build_id}")
        chosen = matching[0]
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


class SymCacheReader:
    """Address -> raw inline chain (innermost first) over one SymCache held in memory."""

    def __init__(self, data: bytes):
        from symbolic._lowlevel import ffi, lib
        from symbolic.symcache import SymCache

        try:
            self._cache = SymCache.from_bytes(data)
        except Exception as error:
            raise ElfFileError(f"stored SymCache is unreadable ({_brief(error)})") from None
        self._ffi = ffi
        self._lib = lib
        item_size = ffi.sizeof("SymbolicSourceLocation")
        # SymbolicSourceLocation: sym_addr, instr_addr, line, then three SymbolicStr
        # (data pointer, length, owned flag) for lang, symbol and full_path.
        self._layout = _layout(ffi)
        if self._layout.size != item_size:
            raise RuntimeError("symbolic's SymbolicSourceLocation layout changed; update symcache.py")
        self._names: dict[int, str] = {}
        self._paths: dict[bytes, str] = {}

    def lookup_many(self, addresses: list[int]) -> list[list[RawFrame]]:
        """For each address its raw frames (innermost first); [] where the SymCache has none."""
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
        names = self._names
        paths = self._paths
        handle = self._cache._objptr
        out: list[list[RawFrame]] = []
        append = out.append
        for address in addresses:
            result = lookup(handle, address)
            count = result.len
            if not count:
                free_result(addressof(result))
                append([])
                continue
            items = result.items
            frames = []
            for index, fields in enumerate(iter_unpack(buffer(items, count * size))):
                line, symbol_ptr, symbol_len, path_ptr, path_len, path_owned = fields
                name = names.get(symbol_ptr)
                if name is None:
                    name = unpack(cast("char *", symbol_ptr), symbol_len).decode("utf-8", "replace")
                    if not name:
                        name = None
                    names[symbol_ptr] = name
                if path_len:
                    raw = unpack(cast("char *", path_ptr), path_len)
                    path = paths.get(raw)
                    if path is None:
                        path = raw.decode("utf-8", "replace")
                        if len(paths) < _MAX_DECODED_PATHS:
                            paths[raw] = path
                else:
                    path = None
                if path_owned:
                    free_str(addressof(items[index], "full_path"))
                frames.append((name, path, line))
            free_result(addressof(result))
            append(frames)
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
