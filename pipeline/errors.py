"""Exception types the CLI turns into one clear line (and a non-zero exit status)."""

from __future__ import annotations

from tbpipe.capture.errors import TbpipeError

__all__ = ["TbpipeError", "UsageError", "first_line"]


class UsageError(TbpipeError):
    """The command line or an API call asked for something that cannot work."""


def first_line(error: BaseException | str, limit: int | None = None) -> str:
    """The first line of an error's text (its type name when it has none), cut at `limit` characters."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else (type(error).__name__ if isinstance(error, BaseException) else "")
    return text[:limit] if limit is not None else text
