"""Offline symbolization: ELF addresses -> function, file, line and inline chains, in bulk.

Debug info is found by build-ID (`debuginfo`; from debuginfod servers last: `debuginfod`), turned
once ever into a SymCache kept in the persistent store (`store`), and every (build-ID, address)
pair is resolved once ever (`resolve`, in worker processes for big batches); `Symbolizer` is the
API over all of it.

    sym = Symbolizer()
    frames = sym.symbolize_module(ModuleRef(build_id, path), addresses, exact)
    table = sym.symbolize_arrow({ModuleRef(...): (addresses, exact), ...})   # for DuckDB

The names below are imported on first use (PEP 562): `tbpipe addr2line` on a warm store
imports a submodule such as `symbols.elf` without paying for all the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tbpipe.capture.lazy import lazy_names

_EXPORTS = {
    "arrow_schema": "columns",
    "DebugInfoLocator": "debuginfo",
    "Located": "debuginfo",
    "DebuginfodClient": "debuginfod",
    "DebuginfodSettings": "debuginfod",
    "debuginfod_cache_dir": "debuginfod",
    "DebugDirIndex": "dirindex",
    "ScanReport": "dirindex",
    "BadBuildIdError": "model",
    "ElfFileError": "model",
    "ModuleRef": "model",
    "ModuleStatus": "model",
    "Quality": "model",
    "SymbolizedFrame": "model",
    "SymbolsError": "model",
    "normalize_build_id": "model",
    "SymbolStore": "store",
    "default_cache_dir": "store",
    "Symbolizer": "symbolizer",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())


if TYPE_CHECKING:
    from tbpipe.pipeline.symbols.columns import arrow_schema
    from tbpipe.pipeline.symbols.debuginfo import DebugInfoLocator, Located
    from tbpipe.pipeline.symbols.debuginfod import DebuginfodClient, DebuginfodSettings, debuginfod_cache_dir
    from tbpipe.pipeline.symbols.dirindex import DebugDirIndex, ScanReport
    from tbpipe.pipeline.symbols.model import (
        BadBuildIdError,
        ElfFileError,
        ModuleRef,
        ModuleStatus,
        Quality,
        SymbolizedFrame,
        SymbolsError,
        normalize_build_id,
    )
    from tbpipe.pipeline.symbols.store import SymbolStore, default_cache_dir
    from tbpipe.pipeline.symbols.symbolizer import Symbolizer
