"""In-process capture of combined Python + native tracebacks.

    from tbpipe import capture
    tb = capture.gather()                  # raw: addresses and code ids, nothing symbolized
    with capture.session("runs", labels={"suite": "bert"}):
        capture.record("kernel_launch", "gemm", grid=(4, 1, 1))

The capture library never imports the offline pipeline: `tbpipe.pipeline.symbolize([tb])` turns
raw tracebacks into frames. Importing this package costs the extension alone; sessions (pyarrow,
the writer) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tbpipe import _native
from tbpipe.capture.errors import CaptureError, LaunchError, SessionError, SourceError
from tbpipe.capture.lazy import lazy_names

__version__ = "0.1.0"  # the package's version, read by the build (pyproject.toml) from here

RawTraceback = _native.RawTraceback

# The native functions themselves, not wrappers: a wrapper would add a Python
# frame of tbpipe's own to every stack and cost a second call per event.
gather = _native.gather  # gather(python=True, native=True) -> RawTraceback
record = _native.record  # record(kind, name, **attrs); a no-op without an active session

_LAZY = {"Session": "sessions", "active_session": "sessions", "session": "sessions"}

if TYPE_CHECKING:
    from tbpipe.capture.sessions import Session, active_session, session


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "CaptureError",
    "LaunchError",
    "RawTraceback",
    "Session",
    "SessionError",
    "SourceError",
    "active_session",
    "gather",
    "record",
    "session",
]
