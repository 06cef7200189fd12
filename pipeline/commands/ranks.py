"""`tbpipe ranks [--job SELECTOR] [--format table|json|md] [--fail-on-divergence] [--lake DIR]`: the call
sites where the ranks of one job disagree, each with its per-rank counts, outlier ranks and traceback.

Exit status: 0 the ranks agree (or they do not and --fail-on-divergence was not given); 1 a site
diverges and --fail-on-divergence was given; 2 a usage or data problem, said in one line.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import typer

from tbpipe.pipeline.commands import FRAMES_HELP, checked_frames
from tbpipe.pipeline.errors import UsageError

DIVERGENCE_EXIT = 1


class RanksFormat(str, Enum):
    table = "table"
    json = "json"
    md = "md"


def register(app: typer.Typer) -> None:
    @app.command("ranks")
    def ranks(
        job: str = typer.Option(
            "latest-job",
            "--job",
            "-j",
            help="The job: job=ID, latest-job, latest-job:K=V,..., a job id, or a run (its job).",
        ),
        label: list[str] | None = typer.Option(
            None, "--label", "-l", help="With latest-job: only jobs of runs with KEY=VALUE; repeatable."
        ),
        kind: list[str] | None = typer.Option(None, "--kind", "-k", help="Event kinds to compare; repeatable."),
        threshold_rel: float = typer.Option(
            0.0, "--threshold-rel", help="A rank diverges only past this fraction of the ranks' median count..."
        ),
        threshold_abs: float = typer.Option(0.0, "--threshold-abs", help="... and past this many events."),
        output_format: RanksFormat = typer.Option(RanksFormat.table, "--format", "-f", help="table, json or md."),
        frames: str = typer.Option("program", "--frames", help=FRAMES_HELP + " (table and md)"),
        out: Path | None = typer.Option(None, "--out", "-o", help="Write to this file; - or nothing: standard output."),
        fail_on_divergence: bool = typer.Option(
            False, "--fail-on-divergence", help="Exit with status 1 when the ranks disagree at any site."
        ),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        lake: Path | None = typer.Option(None, "--lake", help="Read a Parquet lake folder instead of a database file."),
    ) -> None:
        """Where the ranks of one job (torchrun, SLURM, MPI, torch.multiprocessing) disagree, call site by call site."""
        import json

        from rich.console import Console

        from tbpipe.pipeline.db import open_database
        from tbpipe.pipeline.db.selectors import parse_label_list
        from tbpipe.pipeline.reports.ranks import RanksRequest, divergence

        checked_frames(frames)
        if threshold_rel < 0 or threshold_abs < 0:
            raise UsageError("--threshold-rel and --threshold-abs must not be negative")
        labels: dict[str, str] = {}
        for pair in label or []:
            labels.update(parse_label_list(pair, "--label"))
        request = RanksRequest(job, labels, tuple(kind or ()), threshold_rel, threshold_abs)
        if lake is not None:
            from tbpipe.pipeline.lake.store import connect

            con = connect(lake)
        else:
            con = open_database(db, read_only=True)
        try:
            report = divergence(con, request)
        finally:
            con.close()
        to_file = out is not None and str(out) != "-"
        if output_format is RanksFormat.table and not to_file:
            from tbpipe.pipeline.reports.ranks.table import print_table

            print_table(report, Console(soft_wrap=True), frames)
        else:
            if output_format is RanksFormat.json:
                text = json.dumps(report.to_json(), indent=2) + "\n"
            elif output_format is RanksFormat.md:
                from tbpipe.pipeline.reports.ranks.markdown import render_markdown

                text = render_markdown(report, frames)
            else:
                import io

                from tbpipe.pipeline.reports.ranks.table import print_table

                buffer = io.StringIO()
                print_table(report, Console(file=buffer, width=160, soft_wrap=True), frames)
                text = buffer.getvalue()
            if to_file:
                try:
                    out.write_text(text, encoding="utf-8")
                except OSError as error:
                    raise UsageError(f"cannot write to {out}: {error.strerror or error}") from None
                print(f"tbpipe: {report.verdict}\ntbpipe: written to {out}", file=sys.stderr)
            else:
                sys.stdout.write(text)
        if fail_on_divergence and report.divergent:
            raise typer.Exit(DIVERGENCE_EXIT)
