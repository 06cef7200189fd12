"""`tbpipe report --candidate RUN (--baseline RUN | --baseline-window N) [...]`: what changed, site by site.

Exit status: 0 nothing flagged; 1 a regression flagged and --fail-on-regression given (or, with
--fail-on-gpu-regression, a site whose GPU time grew); 2 a usage or data problem (no such run, an
empty window, a bad --accept file), said in one line.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import typer

from tbpipe.pipeline.commands import FRAMES_HELP, checked_frames
from tbpipe.pipeline.db.selectors import parse_per
from tbpipe.pipeline.errors import UsageError

REGRESSION_EXIT = 1


class ReportFormat(str, Enum):
    md = "md"
    html = "html"
    json = "json"


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        candidate: str = typer.Option(
            "latest",
            "--candidate",
            "-c",
            help="RUN: a run id, latest, latest:K=V,..., a group K=V, or a job: job=ID, latest-job[:K=V,...].",
        ),
        baseline: str | None = typer.Option(None, "--baseline", "-b", help="RUN to compare with."),
        baseline_window: int | None = typer.Option(
            None, "--baseline-window", "-w", help="Compare with the N previous runs (or groups) with the same labels."
        ),
        label: list[str] | None = typer.Option(None, "--label", "-l", help="Only runs with KEY=VALUE; repeatable."),
        kind: list[str] | None = typer.Option(None, "--kind", "-k", help="Event kinds to compare; repeatable."),
        per: str | None = typer.Option(
            None, "--per", help="KIND:NAME: divide each run's counts by its number of these events."
        ),
        group_by: str | None = typer.Option(
            None, "--group-by", help="Label whose value groups runs (e.g. commit): counts are summed per group."
        ),
        vary: list[str] | None = typer.Option(
            None, "--vary", help="Labels the window's runs may differ in from the candidate (default: commit)."
        ),
        output_format: ReportFormat = typer.Option(ReportFormat.md, "--format", "-f", help="md, html or json."),
        out: Path | None = typer.Option(
            None, "--out", "-o", help="Write the report to this file; - or nothing: standard output."
        ),
        fail_on_regression: bool = typer.Option(
            False, "--fail-on-regression", help="Exit with status 1 when a regression is flagged."
        ),
        threshold_rel: float = typer.Option(
            0.0, "--threshold-rel", help="Flag a count change only past this fraction of the baseline."
        ),
        threshold_abs: float = typer.Option(0.0, "--threshold-abs", help="... and past this many events."),
        gpu_threshold_rel: float = typer.Option(
            0.10, "--gpu-threshold-rel", help="Flag a site's GPU time only past this fraction of the baseline."
        ),
        gpu_threshold_abs_us: float = typer.Option(
            0.0, "--gpu-threshold-abs-us", help="... and past this many microseconds (per marker with --per)."
        ),
        fail_on_gpu_regression: bool = typer.Option(
            False, "--fail-on-gpu-regression", help="Exit with status 1 when a site's GPU time is flagged."
        ),
        accept: Path | None = typer.Option(None, "--accept", help="TOML file of accepted changes."),
        per_rank: bool = typer.Option(
            False, "--per-rank", help="Jobs: also compare each rank with the same rank of the baseline job(s)."
        ),
        site_of: str = typer.Option(
            "own",
            "--site-of",
            help="Where work done in autograd's backward counts: 'own' (its own stack's site) or 'forward' (the site "
            "of the forward op that made its node; view `backward_op_sites`).",
        ),
        suspects: bool = typer.Option(
            True,
            "--suspects/--no-suspects",
            help="Name the commits between the two sides that changed code on each regressed site's stacks.",
        ),
        repo: Path | None = typer.Option(
            None,
            "--repo",
            help="Git repository the suspects are read from (default: the working folder's checkout, else the "
            "one the candidate ran in).",
        ),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        lake: Path | None = typer.Option(None, "--lake", help="Read a Parquet lake folder instead of a database file."),
        progress: bool | None = typer.Option(
            None, "--progress/--no-progress", help="Progress bar on stderr (default: on a terminal, not under CI)."
        ),
        frames: str = typer.Option(
            "program", "--frames", help=FRAMES_HELP + " (md; the HTML report switches among them in place)"
        ),
    ) -> None:
        """Compare a run (or group) with a baseline run or window, call site by call site."""
        from tbpipe.pipeline.db import open_database
        from tbpipe.pipeline.reports.regression import ReportRequest, Thresholds, compare, load_accept_file
        from tbpipe.pipeline.reports.regression.model import SITE_OF
        from tbpipe.pipeline.reports.regression.select import parse_label_list

        checked_frames(frames)
        if site_of not in SITE_OF:
            raise UsageError(f"--site-of is {' or '.join(repr(s) for s in SITE_OF)}, not {site_of!r}")
        if threshold_rel < 0 or threshold_abs < 0:
            raise UsageError("--threshold-rel and --threshold-abs must not be negative")
        if gpu_threshold_rel < 0 or gpu_threshold_abs_us < 0:
            raise UsageError("--gpu-threshold-rel and --gpu-threshold-abs-us must not be negative")
        if repo is not None and suspects:
            from tbpipe.pipeline.reports.regression.repository import Repository

            if Repository.find(repo) is None:
                raise UsageError(f"--repo {repo}: not a git repository (or git is not installed)")
        labels: dict[str, str] = {}
        for pair in label or []:
            labels.update(parse_label_list(pair, "--label"))
        request = ReportRequest(
            candidate=candidate,
            baseline=baseline,
            window=baseline_window,
            labels=labels,
            kinds=tuple(kind or ()),
            per=parse_per(per),
            thresholds=Thresholds(relative=threshold_rel, absolute=threshold_abs),
            gpu_thresholds=Thresholds(relative=gpu_threshold_rel, absolute=gpu_threshold_abs_us * 1000.0),
            group_by=group_by,
            vary=tuple(vary) if vary else ("commit",),
            site_of=site_of,
            suspects=suspects,
            repo=str(repo) if repo is not None else None,
        )
        if per_rank and output_format is ReportFormat.html:
            raise UsageError("--per-rank renders as md or json")
        accepted = load_accept_file(accept) if accept is not None else None
        if lake is not None:
            from tbpipe.pipeline.lake.store import connect

            con = connect(lake)
        else:
            con = open_database(db, read_only=True)
        try:
            if per_rank:
                from tbpipe.pipeline.reports.regression.per_rank import compare_per_rank

                result = compare_per_rank(con, request, accepted, progress=progress)
            else:
                result = compare(con, request, accepted, progress=progress)
        finally:
            con.close()
        text = render(result, output_format, frames)
        if out is not None and str(out) != "-":
            try:
                out.write_text(text, encoding="utf-8")
            except OSError as error:
                raise UsageError(f"cannot write the report to {out}: {error.strerror or error}") from None
            gpu = f"\ntbpipe: {result.gpu_verdict()}" if result.gpu_sites else ""
            print(f"tbpipe: {result.verdict()}{gpu}\ntbpipe: report written to {out}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        if (fail_on_regression and result.regressions) or (fail_on_gpu_regression and result.gpu_regressions):
            raise typer.Exit(REGRESSION_EXIT)


def render(result, output_format: ReportFormat, frames: str = "program") -> str:
    if hasattr(result, "summed") and output_format is ReportFormat.md:  # --per-rank
        parts = [render(result.summed, output_format, frames), "## Per rank", "", result.verdict(), ""]
        for rank, report in result.ranks:
            parts += [f"### Rank {rank}", "", render(report, output_format, frames)]
        return "\n".join(parts)
    if output_format is ReportFormat.json:
        import json

        return json.dumps(result.to_json(), indent=2) + "\n"
    if output_format is ReportFormat.html:
        from tbpipe.pipeline.reports.regression_html import render_html

        return render_html(result)
    from tbpipe.pipeline.reports.regression_markdown import render_markdown

    return render_markdown(result, frames)
