"""C++ demangling through the extension (`tbpipe._native.demangle`, abi::__cxa_demangle), batched
and cached here too so each distinct name crosses into C++ once per process.

Without the extension (e.g. a source checkout that has not been built) names stay mangled: a
correct but less readable answer, never a subprocess per name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_native_demangle: Callable[[list[str]], list[str]] | None = None
_looked_for_native = False
_cache: dict[str, str] = {}
_MAX_CACHED = 1 << 20


def _native() -> Callable[[list[str]], list[str]] | None:
    global _native_demangle, _looked_for_native
    if not _looked_for_native:
        _looked_for_native = True
        try:
            from tbpipe import _native as extension

            _native_demangle = getattr(extension, "demangle", None)
        except ImportError:
            _native_demangle = None
    return _native_demangle


def available() -> bool:
    """Whether names are really demangled (the extension is importable)."""
    return _native() is not None


def _looks_mangled(name: str) -> bool:
    return name.startswith("_Z") or name.startswith("__Z")


def demangle_many(names: Iterable[str]) -> dict[str, str]:
    """name -> demangled name for each of `names` (unchanged when not a mangled C++ name)."""
    names = list(names)
    wanted = [n for n in set(names) if n not in _cache]
    mangled = [n for n in wanted if _looks_mangled(n)]
    for name in wanted:
        if not _looks_mangled(name):
            _cache[name] = name
    if mangled:
        native = _native()
        results = mangled
        if native is not None:
            try:
                results = native(mangled)
            except Exception:
                results = mangled
        for name, result in zip(mangled, results):
            _cache[name] = result
    out = {n: _cache.get(n, n) for n in names}
    if len(_cache) > _MAX_CACHED:
        _cache.clear()
    return out


def demangle(name: str) -> str:
    return demangle_many([name])[name]
