"""Exports of recorded events and their stacks into the formats other tools read.

    con = open_database("tbpipe.duckdb", read_only=True)
    summary = export(con, ExportFilter(runs=("latest",), kind="kernel_launch"), ExportFormat.pprof, Path("k.pb.gz"))

`source` chooses and counts the events (all SQL is there); one module per format renders them:
`pprof` (gzipped profile.proto, `profile_proto` declares its schema), `collapsed` (flame-graph
lines) and `chrome_trace` (Trace Event Format JSON). `api.export` writes a file atomically: into
a temporary file beside it, renamed when complete, so a failed export leaves no half file.

The names below are imported on first use (PEP 562), so parsing `tbpipe export`'s options
does not load pyarrow and DuckDB.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ExportFormat": "formats",
    "ExportFilter": "source",
    "ExportSource": "source",
    "NoEventsError": "source",
    "ExportOutputError": "api",
    "ExportSummary": "api",
    "export": "api",
    "export_to": "api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from tbpipe.pipeline.export.api import ExportOutputError, ExportSummary, export, export_to
    from tbpipe.pipeline.export.formats import ExportFormat
    from tbpipe.pipeline.export.source import ExportFilter, ExportSource, NoEventsError
