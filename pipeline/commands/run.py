"""`tbpipe run [--out DIR] [--label K=V]... [--source NAME]... -- CMD ARGS...`"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def run(
        ctx: typer.Context,
        out: Path = typer.Option(Path("runs"), "--out", "-o", help="Folder that receives one run folder per process."),
        label: list[str] | None = typer.Option(None, "--label", "-l", help="KEY=VALUE, repeatable."),
        source: list[str] | None = typer.Option(None, "--source", "-s", help="Event source to switch on, repeatable."),
        sample_rate: float = typer.Option(1.0, "--sample-rate", help="Fraction of events recorded, in (0, 1]."),
        max_per_stack: int = typer.Option(
            0, "--max-per-stack-per-s", help="At most this many events per stack and second (0: no limit)."
        ),
        op_stacks: str = typer.Option(
            "own",
            "--op-stacks",
            help="The stack of an op called by another op (torch-ops): own (gathered for it) or outermost "
            "(the enclosing op's, while no Python ran in between: the same call sites, less overhead).",
        ),
    ) -> None:
        """Capture a whole program (and its Python child processes), one run folder per process."""
        from tbpipe.capture.launch import parse_labels, run_captured

        options = {"sample_rate": sample_rate, "max_events_per_stack_per_s": max_per_stack, "op_stacks": op_stacks}
        status = run_captured(list(ctx.args), out, parse_labels(label or []), list(source or []), options)
        raise typer.Exit(status)
