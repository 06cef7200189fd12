"""The formats `tbpipe export` writes (kept light: the command line imports it to parse --format)."""

from __future__ import annotations

from enum import Enum


class ExportFormat(str, Enum):
    pprof = "pprof"
    collapsed = "collapsed"
    chrome_trace = "chrome-trace"

    @property
    def binary(self) -> bool:
        return self is ExportFormat.pprof
