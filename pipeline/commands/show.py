"""`tbpipe show [--db PATH] --event ID [--site-of forward] | --stack ID | --site KEY [--frames MODE]`: a
combined traceback, one frame a line, focused by a mode of `stacks.focus`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tbpipe.pipeline.commands import FRAMES_HELP, checked_frames
from tbpipe.pipeline.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("show")
    def show(
        event: int | None = typer.Option(None, "--event", help="An event id (`events.event_id`)."),
        stack: int | None = typer.Option(None, "--stack", help="A stack id (`stacks.stack_id`)."),
        site: str | None = typer.Option(None, "--site", help="A call-site key (`call_sites.site_key`)."),
        limit: int = typer.Option(3, "--limit", help="With --site: how many of its stacks to print, heaviest first."),
        site_of: str = typer.Option(
            "own",
            "--site-of",
            help="With --event: 'own' (its own stack) or 'forward' (a backward op's, or a launch in one: the stack of "
            "the forward op that made its autograd node; view `backward_op_sites`).",
        ),
        frames: str = typer.Option("program", "--frames", help=FRAMES_HELP),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
    ) -> None:
        """Print the combined Python + native traceback of an event, a stack or a call site (innermost first)."""
        from tbpipe.pipeline.db import open_database
        from tbpipe.pipeline.reports import traceback

        chosen = [
            name for name, value in (("--event", event), ("--stack", stack), ("--site", site)) if value is not None
        ]
        if len(chosen) != 1:
            raise UsageError("give exactly one of --event ID, --stack ID or --site KEY")
        if site_of not in ("own", "forward"):
            raise UsageError(f"--site-of is 'own' or 'forward', not {site_of!r}")
        if site_of == "forward" and event is None:
            raise UsageError("--site-of forward goes with --event ID")
        checked_frames(frames)
        console = Console(soft_wrap=True)
        con = open_database(db, read_only=True)
        try:
            if event is not None and site_of == "forward":
                traceback.show_forward_of_event(con, event, console, frames)
            elif event is not None:
                traceback.show_event(con, event, console, frames)
            elif stack is not None:
                traceback.show_stack(con, stack, console, frames)
            else:
                traceback.show_site(con, site, limit, console, frames)
        finally:
            con.close()
