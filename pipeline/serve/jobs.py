"""Jobs in the service: `/api/jobs` (the jobs, newest first), `/api/jobs/{job}/ranks` (`tbpipe ranks
--format json`) and the job page, `/jobs/{job}`: the job's runs, a heat map of its ranks x its top
call sites (the divergent sites first) and the divergent sites' tracebacks.

`{job}` is a job id, `latest-job`, or any run selector (the job of that run), as `tbpipe ranks --job`.
"""

from __future__ import annotations

import html
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from starlette.responses import HTMLResponse

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.reports.ranks import RankSite, RanksReport, RanksRequest, divergence
from tbpipe.pipeline.serve.app import service_of
from tbpipe.pipeline.serve.pages import frames_mode, render

router = APIRouter()

Kinds = Annotated[list[str] | None, Query(description="Event kinds to compare; repeatable.")]
Threshold = Annotated[float, Query(ge=0, description="A rank diverges only past this (see `tbpipe ranks`).")]


def jobs(cursor: Any, limit: int) -> list[dict[str, Any]]:
    """The newest jobs: id, runs, ranks, first start, the labels all their runs share."""
    rows = query_rows(
        cursor,
        """
        SELECT j.job, count(*) AS runs, count(DISTINCT j.rank) AS ranks, min(j.started_at AT TIME ZONE 'UTC') AS started,
               list(r.labels) AS labels
        FROM job_runs j JOIN runs r ON r.run_number = j.run_number
        GROUP BY j.job ORDER BY started DESC NULLS LAST, j.job DESC LIMIT ?
        """,
        [limit],
    )
    out = []
    for job, runs, ranks, started, labels in rows:
        shared = dict(labels[0] or {})
        for other in labels[1:]:
            shared = {k: v for k, v in shared.items() if (other or {}).get(k) == v}
        shared = {k: v for k, v in shared.items() if k not in ("job", "node", "world_size")}
        out.append({"job": job, "runs": runs, "ranks": ranks, "started_at": started.isoformat() if started else None,
                    "labels": shared})  # fmt: skip
    return out


def _report(request: Request, job: str, kind: list[str] | None, threshold_rel: float, threshold_abs: float):
    ask = RanksRequest(job=job, kinds=tuple(kind or ()), threshold_rel=threshold_rel, threshold_abs=threshold_abs)
    with service_of(request).database.read() as cursor:
        return divergence(cursor, ask)


@router.get("/api/jobs", summary="Jobs (the runs of one launch of many ranks), newest first")
def jobs_api(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict[str, Any]:
    with service_of(request).database.read() as cursor:
        return {"jobs": jobs(cursor, limit)}


@router.get("/api/jobs/{job}/ranks", summary="Where a job's ranks disagree, as `tbpipe ranks --format json`")
def ranks_api(
    request: Request, job: str, kind: Kinds = None, threshold_rel: Threshold = 0.0, threshold_abs: Threshold = 0.0
) -> dict[str, Any]:
    return _report(request, job, kind, threshold_rel, threshold_abs).to_json()


# ------------------------------------------------------------------------------------------ pages

CELL_MAX, CELL_MIN, ROW, LABEL = 44, 10, 22, 460  # px


def _shade(count: int, reference: float, scale: float) -> tuple[str, bool]:
    """A cell's fill, by how far its count is from the row's median: pale grey at the median, blue
    above it, orange below, deeper the further off; and whether the fill is dark (light text)."""
    off = count - reference
    if off == 0:
        return "#eef1f5", False
    depth = min(1.0, abs(off) / scale)
    lightness = 86 - 44 * depth
    return (f"hsl(214, 70%, {lightness:.0f}%)" if off > 0 else f"hsl(28, 85%, {lightness:.0f}%)"), lightness < 62


def heat_map(report: RanksReport) -> str:
    """An SVG: a row per site of `report.sites` (divergent first), a column per rank; each cell
    shaded by how far its count is from the site's median over the ranks (`_shade`), outliers
    framed in red, the count written in the cell when it is wide enough."""
    ranks, sites = report.ranks, report.sites
    if not sites:
        return ""
    cell = max(CELL_MIN, min(CELL_MAX, 900 // max(len(ranks), 1)))
    width, height = LABEL + cell * len(ranks) + 2, 20 + ROW * len(sites) + 2
    parts = []
    for i, rank in enumerate(ranks):
        if cell >= 20 or i % max(1, 20 // cell) == 0:
            parts.append(f'<text class="rank" x="{LABEL + i * cell + cell / 2:.0f}" y="14">{rank}</text>')
    for row, site in enumerate(sites):
        y = 20 + row * ROW
        label = f"{site.name}  {site.site.where()}"
        shown = label if len(label) <= 64 else label[:63] + "…"
        mark = ' class="divergent"' if site.divergent else ""
        text = (
            f'<text{mark} x="{LABEL - 8}" y="{y + 15}">{html.escape(shown)}<title>{html.escape(label)}</title></text>'
        )
        parts.append(f'<a href="/sites/{quote(site.site.key, safe="")}">{text}</a>' if site.site.key else text)
        scale = max([site.reference, 1.0] + [abs(c - site.reference) for c in site.counts_by_rank.values()])
        for i, rank in enumerate(ranks):
            count = site.counts_by_rank[rank]
            fill, dark = _shade(count, site.reference, scale)
            x = LABEL + i * cell
            parts.append(
                f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{ROW - 1}" fill="{fill}"'
                + (' class="outlier"' if rank in site.outlier_ranks else "")
                + f"><title>rank {rank}: {count:,} {html.escape(site.name)} (median {site.reference:g})</title></rect>"
            )
            if cell >= 28:
                tone = "light" if dark else "dark"
                parts.append(f'<text class="count {tone}" x="{x + cell / 2:.0f}" y="{y + 15}">{count:,}</text>')
    return (
        f'<svg id="heat-map" role="img" aria-label="events per rank and call site" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}">{"".join(parts)}</svg>'
    )


@router.get("/jobs", response_class=HTMLResponse, include_in_schema=False)
def jobs_page(request: Request) -> HTMLResponse:
    with service_of(request).database.read() as cursor:
        found = jobs(cursor, 200)
    return render(request, "jobs.html.j2", jobs=found)


@router.get("/jobs/{job}", response_class=HTMLResponse, include_in_schema=False)
def job_page(
    request: Request, job: str, kind: Kinds = None, threshold_rel: Threshold = 0.0, threshold_abs: Threshold = 0.0
) -> HTMLResponse:
    frames_mode(request)
    report = _report(request, job, kind, threshold_rel, threshold_abs)
    groups: list[tuple[RankSite, list[RankSite]]] = report.tracebacks_by_site()
    return render(request, "job.html.j2", report=report, heat_map=heat_map(report), groups=groups)
