"""`tbpipe run [--out DIR] [--label K=V]... [--source NAME]... -- CMD ARGS...`"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def run_captured(
    command: list[str],
    out_dir: Path,
    labels: dict[str, str],
    sources: list[str],
    options: dict[str, object] | None = None,
) -> int:
    """Runs `command` with every Python process in it recording into `out_dir`; returns its exit status.

    `options` are Session keyword options (sample_rate, max_events_per_stack_per_s).
    """
    # Imported here: every other tbpipe command would otherwise pay for the
    # capture library (the extension, pyarrow) at start-up.
    from tbpipe.capture.autostart_session import environment_for_run
    from tbpipe.capture.session import Session, prepare_out_dir

    if not command:
        raise UsageError("nothing to run: give the command after --, e.g. tbpipe run -- python train.py")
    # Validate labels, sources and options here, once, with the session's own
    # checks, rather than let every captured process fail on them.
    Session(out_dir, labels, sources, **(options or {}))
    prepare_out_dir(out_dir)
    env = dict(os.environ)
    env.update(environment_for_run(str(out_dir.resolve()), labels, sources, options))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(autostart_dir()), env.get("PYTHONPATH", "")) if p)
    before = _run_dirs(out_dir)
    try:
        status = subprocess.call(command, env=env)
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]}") from None
    if not _run_dirs(out_dir) - before:
        # Nothing recorded is almost always a set-up problem, not an idle program.
        print(
            f"tbpipe: no Python process of `{command[0]}` recorded into {out_dir} (is it a Python program? "
            "`python -I`/`-E` ignore PYTHONPATH, through which tbpipe starts recording)",
            file=sys.stderr,
        )
    return status


def _run_dirs(out_dir: Path) -> set[Path]:
    return {manifest.parent for manifest in out_dir.glob("*/manifest.json")}


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
    ) -> None:
        """Capture a whole program (and its Python child processes), one run folder per process."""
        options = {"sample_rate": sample_rate, "max_events_per_stack_per_s": max_per_stack}
        status = run_captured(list(ctx.args), out, parse_labels(label or []), list(source or []), options)
        raise typer.Exit(status)
