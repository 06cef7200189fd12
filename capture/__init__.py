"""In-process capture of combined Python + native tracebacks.

from tbpipe import capture
tb = capture.gather()                  # raw: addresses and code ids, nothing symbolized
frames = capture.symbolize([tb])[0]    # [{"kind", "name", "filename", "line", "module"}, ...]
with capture.session("runs", labels={"suite": "bert"}):
    capture.record("kernel_launch", "gemm", grid=(4, 1, 1))
"""

from __future__ import annotations

from tbpipe import _native
from tbpipe.capture.errors import CaptureError, SessionError, SourceError
from tbpipe.capture.session import Session, active_session, session
from tbpipe.capture.symbolize import symbolize

__version__ = "0.1.0"

RawTraceback = _native.RawTraceback

# The native functions themselves, not wrappers: a wrapper would add a Python
# frame of tbpipe's own to every stack and cost a second call per event.
gather = _native.gather  # gather(python=True, native=True) -> RawTraceback
record = _native.record  # record(kind, name, **attrs); a no-op without an active session

__all__ = [
    "CaptureError",
    "RawTraceback",
    "Session",
    "SessionError",
    "SourceError",
    "active_session",
    "gather",
    "record",
    "session",
    "symbolize",
]
