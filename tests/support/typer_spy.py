"""What typer hands a command: the reference the commands' fast parsers (`parse_fast`) are held to."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import typer
from typer.testing import CliRunner


def typer_kwargs(module: ModuleType, command: Callable, argv: list[str]) -> dict:
    """The keyword arguments typer calls `command` (of the command module `module`) with for `argv`."""
    seen = {}

    @functools.wraps(command)
    def spy(**kwargs):
        seen.update(kwargs)

    module._import_typer()  # the module's annotations name typer
    app = typer.Typer()
    app.command("spy")(spy)

    @app.callback()
    def _group() -> None:
        pass

    result = CliRunner().invoke(app, ["spy", *argv])
    assert result.exit_code == 0, result.output
    return seen
