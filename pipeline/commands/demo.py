"""`tbpipe demo`: capture the demo workload, ingest it, print its top kernel-launch call sites."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import typer
from rich.console import Console

from tbpipe.capture.launch import run_captured
from tbpipe.pipeline.errors import TbpipeError

WORKLOAD = "tbpipe.pipeline.demo.workload"


def workload_file() -> str:
    spec = importlib.util.find_spec(WORKLOAD)
    return str(Path(spec.origin).resolve())


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path = typer.Option(Path("demo-runs"), "--out", "-o", help="Folder for the demo's runs."),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: OUT/tbpipe.duckdb)."),
        top: int = typer.Option(5, help="How many call sites to print."),
    ) -> None:
        """Capture a small workload, ingest it into DuckDB, print its top kernel-launch call sites."""
        from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database, read
        from tbpipe.pipeline.reports.call_sites import render_top_sites
        from tbpipe.pipeline.reports.ingest_summary import render_ingest_summary
        from tbpipe.pipeline.reports.traceback import show_site

        console = Console()
        console.rule("1. capture: tbpipe run -- python -m " + WORKLOAD)
        status = run_captured([sys.executable, "-m", WORKLOAD], out, {"suite": "demo"}, [])
        if status != 0:
            raise TbpipeError(f"the demo workload failed with exit status {status}")
        db_path = db or out / "tbpipe.duckdb"
        console.rule(f"2. ingest: tbpipe ingest {out} --db {db_path}")
        # The workload lives inside tbpipe, whose files are not user code: say this one is.
        summary = ingest_runs([out], IngestOptions(db_path=db_path, user_code=[workload_file()]))
        render_ingest_summary(summary, console)
        new_runs = [o.run_id for o in summary.outcomes if o.status in ("ingested", "updated")]
        if not new_runs:
            raise TbpipeError(f"the demo run did not get into {db_path}")
        con = open_database(db_path, read_only=True)
        try:
            sites = read.top_sites(con, "kernel_launch", new_runs, top)
            if not sites:
                raise TbpipeError(f"the demo run recorded no kernel launches (its manifest in {out} says why)")
            console.rule("3. top kernel-launch call sites: SELECT ... FROM kernel_launch_sites")
            render_top_sites(sites, f"run {', '.join(new_runs)}", console)
            if sites and sites[0]["site_key"]:
                console.rule(f"4. tbpipe show --site {sites[0]['site_key']} --limit 1 --db {db_path}")
                show_site(con, sites[0]["site_key"], 1, console)
        finally:
            con.close()
        console.print(
            f'\nMore: tbpipe query --db {db_path} "SELECT * FROM kernel_launch_sites ORDER BY events DESC"',
            highlight=False,
            soft_wrap=True,
        )
