"""Exception types the CLI turns into one clear line (and a non-zero exit status)."""

from __future__ import annotations


class TbpipeError(Exception):
    """Base class: the message is shown to the user as is, without a traceback."""


class UsageError(TbpipeError):
    """The command line or an API call asked for something that cannot work."""
