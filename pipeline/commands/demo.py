"""`tbpipe demo`: capture the demo workload and show where its launches come from."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from tbpipe.pipeline.commands.run import run_captured
from tbpipe.pipeline.errors import TbpipeError


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path = typer.Option(Path("demo-runs"), "--out", "-o", help="Folder for the demo's runs."),
        top: int = typer.Option(3, help="How many call sites to print."),
    ) -> None:
        """Capture a small workload, then print its top kernel-launch call sites."""
        from tbpipe.pipeline.reports.run_summary import print_top_stacks

        status = run_captured(
            [sys.executable, "-m", "tbpipe.pipeline.demo.workload"], out, {"suite": "demo"}, []
        )
        if status != 0:
            raise TbpipeError(f"the demo workload failed with exit status {status}")
        print_top_stacks(out, kind="kernel_launch", top=top)
