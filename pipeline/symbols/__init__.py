"""Offline symbolization: ELF addresses -> function, file, line and inline chains, in bulk.

Debug info is found by build-ID (`debuginfo`), turned once ever into a SymCache kept in the
persistent store (`store`), and every (build-ID, address) pair is resolved once ever
(`resolve`, in worker processes for big batches); `Symbolizer` is the API over all of it.

    sym = Symbolizer()
    frames = sym.symbolize_module(ModuleRef(build_id, path), addresses, exact)
    table = sym.symbolize_arrow({ModuleRef(...): (addresses, exact), ...})   # for DuckDB
"""

from tbpipe.pipeline.symbols.columns import arrow_schema
from tbpipe.pipeline.symbols.debuginfo import DebugInfoLocator, Located, debuginfod_cache_dir
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

__all__ = [
    "BadBuildIdError",
    "DebugDirIndex",
    "DebugInfoLocator",
    "ElfFileError",
    "Located",
    "ModuleRef",
    "ModuleStatus",
    "Quality",
    "ScanReport",
    "SymbolStore",
    "SymbolizedFrame",
    "Symbolizer",
    "SymbolsError",
    "arrow_schema",
    "debuginfod_cache_dir",
    "default_cache_dir",
    "normalize_build_id",
]
