"""Errors of the capture library, each one clear line for the user."""

from __future__ import annotations

from tbpipe.pipeline.errors import TbpipeError


class CaptureError(TbpipeError):
    """Base class of capture-side errors."""


class SessionError(CaptureError):
    """A session cannot start: unwritable output folder, a session already active, ..."""


class SourceError(CaptureError):
    """An unknown or unavailable event source was asked for."""
