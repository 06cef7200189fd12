"""A job compared with a job rank by rank (`tbpipe report --per-rank`): the summed comparison, and
the same comparison again for each rank of the candidate job, rank r against rank r of the
baseline job (or of each job of the window).

A rank is chosen as any other label is (`ReportRequest.labels`): the runs of `job=ID` that carry
`rank=r` (its forked workers count with it), so each rank's report is an ordinary report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.selectors import JOB_LABEL
from tbpipe.pipeline.reports.regression.accept import AcceptList
from tbpipe.pipeline.reports.regression.compute import compare
from tbpipe.pipeline.reports.regression.model import RegressionReport, ReportRequest
from tbpipe.pipeline.reports.regression.select import SelectionError, is_job

RANK_LABEL = "rank"


@dataclass
class PerRankReport:
    summed: RegressionReport
    ranks: list[tuple[str, RegressionReport]]  # (rank, its report), in rank order

    @property
    def regressions(self) -> list:
        """Every flagged site, summed and per rank (what --fail-on-regression looks at)."""
        return [*self.summed.regressions, *(s for _, report in self.ranks for s in report.regressions)]

    @property
    def gpu_regressions(self) -> list:
        return [*self.summed.gpu_regressions, *(s for _, report in self.ranks for s in report.gpu_regressions)]

    @property
    def gpu_sites(self) -> list:
        return self.summed.gpu_sites

    def gpu_verdict(self) -> str:
        return self.summed.gpu_verdict()

    def verdict(self) -> str:
        flagged = [rank for rank, report in self.ranks if report.regressions]
        per_rank = (
            f"rank{'s' if len(flagged) != 1 else ''} {', '.join(flagged)} regressed on their own"
            if flagged
            else f"no rank regressed on its own ({len(self.ranks)} compared)"
        )
        return f"{self.summed.verdict()}; {per_rank}"

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summed.to_json(),
            "verdict": self.verdict(),
            "ok": not self.regressions,
            "per_rank": {rank: report.to_json() for rank, report in self.ranks},
        }


def _ranks(con: Any, run_ids: list[str]) -> list[str]:
    rows = query_rows(
        con,
        f"SELECT DISTINCT labels['{RANK_LABEL}'] FROM runs WHERE list_contains(?, run_id) AND labels['{RANK_LABEL}'] IS NOT NULL",
        [run_ids],
    )
    return sorted((row[0] for row in rows), key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0, r))


def compare_per_rank(
    con: Any, request: ReportRequest, accept: AcceptList | None = None, **options: Any
) -> PerRankReport:
    """The summed report of a job against a job (or a window of jobs), and one per rank; `options`
    go to each `compare`."""
    summed = compare(con, request, accept, **options)
    if not is_job(summed.candidate):
        raise SelectionError(
            f"--per-rank compares jobs: the candidate {summed.candidate.name} is not one (job=ID or latest-job)"
        )
    if request.window is None and not is_job(summed.baseline[0]):
        raise SelectionError(f"--per-rank compares jobs: the baseline {summed.baseline[0].name} is not one")
    candidate = f"{JOB_LABEL}={summed.candidate.labels[JOB_LABEL]}"
    baseline = None if request.window is not None else f"{JOB_LABEL}={summed.baseline[0].labels[JOB_LABEL]}"
    reports = []
    for rank in _ranks(con, summed.candidate.run_ids):
        one = dataclasses.replace(
            request,
            candidate=candidate,
            baseline=baseline,
            labels={**request.labels, RANK_LABEL: rank},
            suspects=False,  # the summed report names them
        )
        reports.append((rank, compare(con, one, accept, **options)))
    return PerRankReport(summed, reports)
