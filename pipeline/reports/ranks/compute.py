"""Where the ranks of one job disagree: per (kind, name, call site), each rank's events
(`rank_site_counts`, sql/ranks.sql) against the median over the job's ranks.

A rank is an outlier at a site when its count is off the median by more than both thresholds
(by default, by anything: the ranks of a data-parallel step run the same code). Everything is
column-wise: one query gives every (site, rank) count, numpy classifies all sites at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db import read
from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.db.selectors import RunSelectionError, RunSelector, parse_selector, resolve_job, resolve_selector
from tbpipe.pipeline.reports.ranks.model import JobRun, RankSite, RanksReport, RanksRequest, Site
from tbpipe.pipeline.reports.regression.model import Frame


class NoRanksError(RunSelectionError):
    """The job has no run with a rank (only its launcher, or runs captured without one)."""


def job_of(con: Any, text: str, labels: dict[str, str] | None = None) -> str:
    """The job id a selector names: `job=ID`, `latest-job[:K=V]`, a bare job id, or any run selector
    (the job of that run)."""
    selector = parse_selector(text)
    if selector.latest_job and labels:
        selector = RunSelector(selector.text, labels={**labels, **selector.labels}, latest_job=True)
    if selector.is_job:
        return resolve_job(con, selector).job_id
    if query_rows(con, "SELECT 1 FROM job_runs WHERE job = ? LIMIT 1", [text]):
        return text
    run_id = resolve_selector(con, selector)
    rows = query_rows(con, "SELECT job FROM job_runs WHERE run_id = ?", [run_id])
    if not rows:
        raise RunSelectionError(f"run {run_id} belongs to no job (no launcher labelled it: docs/ranks.md)")
    return rows[0][0]


def _job_runs(con: Any, job: str) -> list[JobRun]:
    rows = query_rows(
        con,
        "SELECT run_id, rank, local_rank, node, role FROM job_runs WHERE job = ? ORDER BY rank NULLS LAST, started_at, run_id",
        [job],
    )
    return [JobRun(*row) for row in rows]


def divergence(con: Any, request: RanksRequest) -> RanksReport:
    """The ranks report for `request` over the database (or lake) behind `con`."""
    if request.threshold_rel < 0 or request.threshold_abs < 0:
        raise RunSelectionError("the thresholds must not be negative")
    job = job_of(con, request.job, request.labels)
    runs = _job_runs(con, job)
    ranks = sorted({run.rank for run in runs if run.rank is not None})
    if not ranks:
        raise NoRanksError(f"job {job} has no run with a rank: {len(runs)} run(s), none labelled `rank`")
    where, params = ["c.job = ?"], [job]
    if request.kinds:
        where.append("list_contains(?, c.kind)")
        params.append(list(request.kinds))
    table = query_arrow(
        con,
        f"""
        SELECT c.kind, c.name, c.site_key, c.rank, c.events,
               t.function, t.file, t.line, t.portable_file, t.kind AS site_kind
        FROM rank_site_counts c
        LEFT JOIN sites t ON t.site_id = c.site_id
        WHERE {" AND ".join(where)}
        ORDER BY c.kind, c.name, c.site_key NULLS FIRST, c.rank
        """,
        params,
    )
    sites = _classify(table.to_pydict(), ranks, request)
    divergent = [s for s in sites if s.divergent]
    # The program's own lines first (a native site is often where the same extra work lands again,
    # on a worker thread), then by how far the outliers are off.
    divergent.sort(
        key=lambda s: (
            s.site.kind != "python",
            -max(abs(s.counts_by_rank[r] - s.reference) for r in s.outlier_ranks),
            -s.total,
        )
    )
    rest = sorted((s for s in sites if not s.divergent), key=lambda s: -s.total)
    _attach_tracebacks(con, job, divergent[: max(request.tracebacks, 0)])
    shown = (divergent + rest)[: max(request.top, len(divergent))]
    return RanksReport(request, job, ranks, runs, divergent, shown, len(sites), read.focus_rules(con))


def _classify(columns: dict[str, list], ranks: list[int], request: RanksRequest) -> list[RankSite]:
    """One RankSite per (kind, name, site): the view has a row per rank of each, in rank order."""
    width = len(ranks)
    rows = len(columns["kind"])
    if rows == 0:
        return []
    if rows % width:
        raise RunSelectionError(f"rank_site_counts has {rows} rows for {width} ranks: not one per rank and site")
    counts = np.asarray(columns["events"], dtype=np.int64).reshape(-1, width)
    reference = np.sort(counts, axis=1)[:, (width - 1) // 2].astype(np.float64)
    off = np.abs(counts - reference[:, None])
    outlying = (off > request.threshold_abs) & (off > request.threshold_rel * reference[:, None])
    out = []
    for i in range(counts.shape[0]):
        first = i * width
        site = Site(
            columns["site_key"][first],
            columns["function"][first],
            columns["file"][first],
            columns["line"][first],
            columns["portable_file"][first],
            columns["site_kind"][first],
        )
        out.append(
            RankSite(
                columns["kind"][first],
                columns["name"][first],
                site,
                dict(zip(ranks, counts[i].tolist())),
                float(reference[i]),
                [rank for rank, flag in zip(ranks, outlying[i]) if flag],
            )
        )
    return out


def _attach_tracebacks(con: Any, job: str, sites: list[RankSite]) -> None:
    """Each site's heaviest stack among the events of its most outlying rank."""
    wanted = [s for s in sites if s.site.key is not None]
    if not wanted:
        return
    ranks = [max(s.outlier_ranks, key=lambda r: abs(s.counts_by_rank[r] - s.reference)) for s in wanted]
    keys = pa.table(
        {
            "kind": pa.array([s.kind for s in wanted], pa.string()),
            "name": pa.array([s.name for s in wanted], pa.string()),
            "site_key": pa.array([s.site.key for s in wanted], pa.string()),
            "rank": pa.array(ranks, pa.int32()),
        }
    )
    con.register("ranks_wanted", keys)
    try:
        rows = query_rows(
            con,
            """
            SELECT w.kind, w.name, w.site_key, arg_max(c.stack_id, struct_pack(n := c.events, s := -c.stack_id))
            FROM run_stack_counts c
            JOIN job_runs j ON j.run_number = c.run_number
            JOIN event_names n ON n.name_id = c.name_id
            JOIN stack_sites ss ON ss.stack_id = c.stack_id
            JOIN sites t ON t.site_id = ss.site_id
            JOIN ranks_wanted w ON w.kind = n.kind AND w.name = n.name AND w.site_key = t.site_key AND w.rank = j.rank
            WHERE j.job = ?
            GROUP BY w.kind, w.name, w.site_key
            """,
            [job],
        )
    finally:
        con.unregister("ranks_wanted")
    stack_of = {(kind, name, key): int(stack) for kind, name, key, stack in rows if stack is not None}
    frames = read.stacks_frames(con, sorted(set(stack_of.values())))
    for site in wanted:
        stack = stack_of.get((site.kind, site.name, site.site.key))
        if stack is not None:
            site.traceback = [
                Frame(
                    f["kind"], f["name"], f["filename"], f["line"], f["module"], f["inlined"], f.get("generated", False)
                )
                for f in frames.get(stack, [])
            ]
