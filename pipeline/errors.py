"""Exception types the CLI turns into one clear line (and a non-zero exit status)."""

from __future__ import annotations

from tbpipe.capture.errors import TbpipeError

__all__ = ["TbpipeError", "UsageError", "first_line", "print_error"]


class UsageError(TbpipeError):
    """The command line or an API call asked for something that cannot work."""


def first_line(error: BaseException | str, limit: int | None = None) -> str:
    """The first line of an error's text (its type name when it has none), cut at `limit` characters."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else (type(error).__name__ if isinstance(error, BaseException) else "")
    return text[:limit] if limit is not None else text


def print_error(error: TbpipeError) -> None:
    """The one line a command prints for an error, on standard error: `tbpipe: MESSAGE`."""
    from rich.console import Console
    from rich.markup import escape

    # Escaped: messages quote user input and file contents, where '[...]' is not rich markup. Not
    # wrapped at the console's width (80 columns in a log): a message is one line a log search finds
    # whole, and its paths are never cut in two.
    Console(stderr=True, soft_wrap=True).print(f"[bold red]tbpipe:[/] {escape(str(error))}", highlight=False)
