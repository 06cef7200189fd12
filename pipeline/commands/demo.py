"""`tbpipe demo`: the product's main job end to end, on a small workload in two nightly versions.

Captures version 1 and version 2 of the demo workload, each from a checkout folder of its own,
ingests both, prints the newest run's top kernel-launch call sites with a combined traceback, then
the regression report between the two nights (Markdown here, HTML beside the runs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from tbpipe.pipeline.errors import TbpipeError


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path = typer.Option(Path("demo-runs"), "--out", "-o", help="Folder for the demo's runs."),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: OUT/tbpipe.duckdb)."),
        top: int = typer.Option(5, help="How many call sites to print."),
    ) -> None:
        """Capture two versions of a small workload, ingest them, print top call sites and the report."""
        from tbpipe.capture.launch import run_captured
        from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database, read
        from tbpipe.pipeline.demo.versions import check_out
        from tbpipe.pipeline.reports.call_sites import render_top_sites
        from tbpipe.pipeline.reports.ingest_summary import render_ingest_summary
        from tbpipe.pipeline.reports.regression import ReportRequest, compare
        from tbpipe.pipeline.reports.regression_html import render_html
        from tbpipe.pipeline.reports.regression_markdown import render_markdown
        from tbpipe.pipeline.reports.traceback import show_site

        console = Console()

        def step(title: str, command: str) -> None:
            # The command on a line of its own, whole: a rule's title is cut to the width.
            console.rule(title)
            console.print(f"$ {command}", markup=False, highlight=False, soft_wrap=True)

        db_path = db or out / "tbpipe.duckdb"
        nights = []
        for version in (1, 2):
            script = check_out(out, version)
            commit = f"night-{version}"
            step(
                f"1.{version} capture {commit}",
                f"cd {script.parent} && tbpipe run --label commit={commit} -- python workload.py",
            )
            status = run_captured(
                [sys.executable, script.name], out / "runs", {"suite": "demo", "commit": commit}, [], cwd=script.parent
            )
            if status != 0:
                raise TbpipeError(f"the demo workload ({script}) failed with exit status {status}")
            nights.append(commit)
        step("2. ingest", f"tbpipe ingest {out / 'runs'} --db {db_path}")
        summary = ingest_runs([out / "runs"], IngestOptions(db_path=db_path))
        render_ingest_summary(summary, console)
        con = open_database(db_path, read_only=True)
        try:
            runs = [r for r in read.runs(con, {"suite": "demo"}) if r["labels"].get("commit") in nights]
            latest = {r["labels"]["commit"]: r["run_id"] for r in runs}  # oldest first: the newest wins
            if set(latest) != set(nights):
                raise TbpipeError(f"the demo runs did not get into {db_path}")
            candidate, baseline = latest[nights[1]], latest[nights[0]]
            sites = read.top_sites(con, "kernel_launch", [candidate], top)
            if not sites:
                raise TbpipeError(f"the demo run recorded no kernel launches (its manifest in {out} says why)")
            step("3. top kernel-launch call sites of night-2", "tbpipe query: SELECT ... FROM kernel_launch_sites")
            render_top_sites(sites, f"run {candidate}", console)
            if sites[0]["site_key"]:
                step(
                    "4. the heaviest site's traceback",
                    f"tbpipe show --site {sites[0]['site_key']} --limit 1 --db {db_path}",
                )
                show_site(con, sites[0]["site_key"], 1, console)
            step(
                "5. night-2 against night-1",
                f"tbpipe report --candidate {candidate} --baseline {baseline} --db {db_path}",
            )
            report = compare(con, ReportRequest(candidate=candidate, baseline=baseline, tracebacks=1))
        finally:
            con.close()
        console.print(render_markdown(report), markup=False, highlight=False, soft_wrap=True)
        html_path = out / "report.html"
        html_path.write_text(render_html(report), encoding="utf-8")
        console.print(f"HTML report: {html_path.resolve()}", highlight=False, soft_wrap=True)
        console.print(
            f"More: tbpipe report --db {db_path} --candidate latest:suite=demo --baseline-window 3 --format html "
            f"--out report.html",
            highlight=False,
            soft_wrap=True,
        )
