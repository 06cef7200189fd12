"""Errors of tbpipe, each one clear line for the user.

`TbpipeError` is the root of every error tbpipe raises on purpose; it lives here, on the capture
side, because the capture library is what a captured program imports and it must not import the
offline pipeline. `tbpipe.pipeline.errors` builds on it.
"""

from __future__ import annotations


class TbpipeError(Exception):
    """Base class: the message is shown to the user as is, without a traceback."""


class CaptureError(TbpipeError):
    """Base class of capture-side errors."""


class SessionError(CaptureError):
    """A session cannot start: unwritable output folder, a session already active, ..."""


class SourceError(CaptureError):
    """An unknown or unavailable event source was asked for."""


class LaunchError(CaptureError):
    """`tbpipe run` cannot start the program: nothing to run, a command that does not exist, bad labels."""
