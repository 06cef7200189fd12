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

from typing import TYPE_CHECKING

from tbpipe.capture.lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())


if TYPE_CHECKING:
    from tbpipe.pipeline.export.api import ExportOutputError, ExportSummary, export, export_to
    from tbpipe.pipeline.export.formats import ExportFormat
    from tbpipe.pipeline.export.source import ExportFilter, ExportSource, NoEventsError
