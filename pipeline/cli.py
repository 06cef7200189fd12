"""The `tbpipe` command line: a typer app whose subcommands live in `pipeline/commands/`.

Start-up is kept short: `tbpipe CMD ...` imports only CMD's module (each command module pulls
in its own dependencies: duckdb, pyarrow, ...), and `tbpipe addr2line` with plain binutils-style
options and `tbpipe ingest` with plain folders and options (`run_fast` of each) do not even build
the typer app: typer 0.29 imports pydantic to coerce parameters, a third of an ingest with nothing
new to load. `tbpipe`, `tbpipe --help` and anything that is not a known command name register
every command, so help and "no such command" messages are unchanged.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from tbpipe.pipeline.errors import TbpipeError, print_error

if TYPE_CHECKING:
    import typer

# Command names, each the name of its module under tbpipe.pipeline.commands, in `--help` order.
_COMMANDS = ("run", "demo", "ingest", "query", "runs", "show", "report", "ranks", "export", "serve", "lake", "compact")
_COMMANDS += ("retain",)
_COMMANDS += ("addr2line", "debuginfo", "doctor")

# Commands whose module runs a plain command line without typer (`run_fast(argv) -> bool`).
_FAST_COMMANDS = ("addr2line", "ingest")

_app: typer.Typer | None = None


def _new_app() -> typer.Typer:
    import typer

    return typer.Typer(
        name="tbpipe",
        help="Combined Python + native tracebacks for every event, queryable in DuckDB.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )


def _register_commands(app: typer.Typer, only: str | None = None) -> None:
    # Imported here so `tbpipe --help` stays fast and each command owns its module.
    import importlib

    for name in _COMMANDS:
        if only is None or name == only:
            importlib.import_module(f"tbpipe.pipeline.commands.{name}").register(app)
    _one_line_summaries(app)
    if only is not None:
        # With a single command and no callback, typer would run that command without its
        # name; a callback keeps `tbpipe CMD ...` parsed as a group.
        @app.callback()
        def _group() -> None:
            pass


def _one_line_summaries(app: typer.Typer) -> None:
    """Each command's line in `tbpipe --help` (and a group's --help): the first paragraph of its
    docstring, joined into one line. Typer lists a command's help with the docstring's own line breaks,
    which cut the sentence where the source wraps it; the command's own --help reflows it anyway."""
    import inspect

    for info in app.registered_commands:
        if info.short_help is None:
            text = info.help or inspect.getdoc(info.callback) or ""
            info.short_help = " ".join(text.split("\n\n")[0].split())
    for group in app.registered_groups:
        _one_line_summaries(group.typer_instance)


def __getattr__(name: str):
    # `app`: the full CLI, built on first access (for tests and embedding).
    global _app
    if name == "app":
        if _app is None:
            _app = _new_app()
            _register_commands(_app)
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fast_command(name: str):
    import importlib

    return importlib.import_module(f"tbpipe.pipeline.commands.{name}").run_fast


def main() -> None:
    argv = sys.argv[1:]
    command = argv[0] if argv else None
    try:
        if command in _FAST_COMMANDS and _fast_command(command)(argv[1:]):
            return
        app = _new_app()
        _register_commands(app, command if command in _COMMANDS else None)
        app()
    except TbpipeError as error:
        print_error(error)
        sys.exit(2)
