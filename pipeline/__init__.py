"""Offline side of tbpipe: symbolize raw runs, load them into DuckDB, query and report.

from tbpipe.pipeline import symbolize
frames = symbolize([capture.gather()])[0]   # combined order, innermost first
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Loaded on first use: the CLI imports this package and must stay quick to start.
    if name == "symbolize":
        from tbpipe.pipeline.stacks.live import symbolize

        return symbolize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
