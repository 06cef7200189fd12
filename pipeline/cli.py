"""The `tbpipe` command line: a typer app whose subcommands live in `pipeline/commands/`."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from tbpipe.pipeline.errors import TbpipeError

app = typer.Typer(
    name="tbpipe",
    help="Combined Python + native tracebacks for every event, queryable in DuckDB.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_stderr = Console(stderr=True)


def _register_commands() -> None:
    # Imported here so `tbpipe --help` stays fast and each command owns its module.
    from tbpipe.pipeline.commands import demo as demo_command
    from tbpipe.pipeline.commands import ingest as ingest_command
    from tbpipe.pipeline.commands import query as query_command
    from tbpipe.pipeline.commands import run as run_command
    from tbpipe.pipeline.commands import runs as runs_command
    from tbpipe.pipeline.commands import show as show_command

    run_command.register(app)
    demo_command.register(app)
    ingest_command.register(app)
    query_command.register(app)
    runs_command.register(app)
    show_command.register(app)
    __import__("tbpipe.pipeline.commands.addr2line", fromlist=["register"]).register(app)
    __import__("tbpipe.pipeline.commands.debuginfo", fromlist=["register"]).register(app)


def main() -> None:
    _register_commands()
    try:
        app()
    except TbpipeError as error:
        _stderr.print(f"[bold red]tbpipe:[/] {error}", highlight=False)
        sys.exit(2)
