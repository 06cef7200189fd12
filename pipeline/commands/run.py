"""`tbpipe run [--out DIR] [--label K=V]... [--source NAME]... -- CMD ARGS...`"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import typer

from tbpipe.pipeline.errors import UsageError


def autostart_dir() -> Path:
    """The folder whose sitecustomize.py starts recording in each captured process."""
    import tbpipe.capture

    return Path(tbpipe.capture.__file__).resolve().parent / "autostart"


def parse_labels(pairs: list[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"label {pair!r} is not of the form KEY=VALUE")
        labels[key] = value
    return labels


def run_captured(command: list[str], out_dir: Path, labels: dict[str, str], sources: list[str]) -> int:
    """Runs `command` with every Python process in it recording into `out_dir`; returns its exit status."""
    # Imported here: every other tbpipe command would otherwise pay for the
    # capture library (the extension, pyarrow) at start-up.
    from tbpipe.capture.autostart_session import environment_for_run
    from tbpipe.capture.session import prepare_out_dir
    from tbpipe.capture.sources import resolve_sources

    if not command:
        raise UsageError("nothing to run: give the command after --, e.g. tbpipe run -- python train.py")
    resolve_sources(sources)
    prepare_out_dir(out_dir)
    env = dict(os.environ)
    env.update(environment_for_run(str(out_dir.resolve()), labels, sources))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(autostart_dir()), env.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]}") from None


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def run(
        ctx: typer.Context,
        out: Path = typer.Option(Path("runs"), "--out", "-o", help="Folder that receives one run folder per process."),
        label: Optional[List[str]] = typer.Option(None, "--label", "-l", help="KEY=VALUE, repeatable."),
        source: Optional[List[str]] = typer.Option(None, "--source", "-s", help="Event source to switch on, repeatable."),
    ) -> None:
        """Capture a whole program (and its Python child processes), one run folder per process."""
        status = run_captured(list(ctx.args), out, parse_labels(label or []), list(source or []))
        raise typer.Exit(status)
