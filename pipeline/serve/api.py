"""The JSON API under /api (described at /api/openapi.json).

Reads run on cursors of the served database (`ServedDatabase.read`), user SQL in the sandbox
(`sandbox.run_query`); `/api/compare` is `tbpipe report --format json` with the same selectors;
`POST /api/runs` takes an uploaded run archive (needs the token).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from tbpipe.pipeline.db import read
from tbpipe.pipeline.db.read import NotFoundError
from tbpipe.pipeline.db.selectors import parse_per
from tbpipe.pipeline.reports.regression import ReportRequest, Thresholds, compare
from tbpipe.pipeline.reports.regression import select as run_select
from tbpipe.pipeline.reports.regression.per_rank import compare_per_rank
from tbpipe.pipeline.reports.regression.select import SelectionError, parse_label_list
from tbpipe.pipeline.serve import flame, queries
from tbpipe.pipeline.serve.app import service_of
from tbpipe.pipeline.serve.ingest import DONE
from tbpipe.pipeline.serve.sandbox import run_query
from tbpipe.pipeline.serve.security import check_token
from tbpipe.pipeline.serve.upload import UploadRefused, receive

router = APIRouter(prefix="/api")

Limit = Annotated[int, Query(ge=1, le=1000, description="Rows per page.")]
Offset = Annotated[int, Query(ge=0, description="Rows to skip (paging).")]
Labels = Annotated[list[str] | None, Query(description="K=V, repeatable: only runs with all these labels.")]
_FRAMES = "Focus mode (tbpipe.pipeline.stacks.focus): program, python, native or all."
IcicleFrames = Annotated[str, Query(pattern="^(program|python|native|all)$", description=_FRAMES)]
TracebackFrames = Annotated[str, Query(pattern="^(program|python|native|all)$", description=_FRAMES)]


def parse_labels(pairs: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs or []:
        labels.update(parse_label_list(pair, "label"))
    return labels


# ------------------------------------------------------------------------------------------ runs


@router.get("/runs", summary="Runs, newest first: labels, status, event counts per kind")
def runs(
    request: Request,
    label: Labels = None,
    complete: Annotated[bool | None, Query(description="Only complete (true) or incomplete (false) runs.")] = None,
    limit: Limit = 50,
    offset: Offset = 0,
    order: Annotated[str, Query(pattern="^(newest|oldest)$", description="newest or oldest first.")] = "newest",
) -> dict[str, Any]:
    database = service_of(request).database
    with database.read() as cursor:
        return queries.runs_page(
            cursor, parse_labels(label), complete, limit, offset, order == "newest", database.state_key()
        )


@router.get("/labels", summary="Every label key of the runs with its values")
def labels(request: Request) -> dict[str, list[str]]:
    with service_of(request).database.read() as cursor:
        return queries.label_values(cursor)


@router.get("/runs/{run_id}", summary="One run: manifest fields, versions, counts, notes")
def run(request: Request, run_id: str) -> dict[str, Any]:
    database = service_of(request).database
    with database.read() as cursor:
        return queries.run(cursor, run_id, database.state_key())


@router.get("/runs/{run_id}/sites", summary="A run's call sites, most events first")
def run_sites(
    request: Request,
    run_id: str,
    kind: Annotated[str | None, Query(description="Event kind, e.g. kernel_launch or op.")] = None,
    name: Annotated[str | None, Query(description="Only event names containing this (any case).")] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> dict[str, Any]:
    database = service_of(request).database
    with database.read() as cursor:
        sites = queries.run_sites(cursor, run_id, kind, name, limit + 1, offset, database.state_key())
    return {"run_id": run_id, "sites": sites[:limit], "limit": limit, "offset": offset, "more": len(sites) > limit}


@router.get("/runs/{run_id}/icicle", summary="A run's stacks merged into an icicle tree (root: all events)")
def run_icicle(
    request: Request,
    run_id: str,
    kind: Annotated[list[str] | None, Query(description="Event kinds.")] = None,
    frames: IcicleFrames = "program",
) -> dict[str, Any]:
    with service_of(request).database.read() as cursor:
        numbers = queries.run_numbers(cursor, [run_id])
        if not numbers:
            queries.run(cursor, run_id)  # raises the 404
        return {"run_id": run_id, **flame.run_tree(cursor, numbers, kind, frames)}


# ------------------------------------------------------------------------------------------ sites, stacks


@router.get("/sites/{site_key}", summary="A call site: its combined tracebacks and its events in every run")
def site(
    request: Request,
    site_key: str,
    stacks: Annotated[int, Query(ge=1, le=50, description="Heaviest stacks to show.")] = 5,
    frames: TracebackFrames = "all",
) -> dict[str, Any]:
    database = service_of(request).database
    with database.read() as cursor:
        out = queries.site(cursor, site_key, stacks, database.state_key())
        if frames != "all":
            for entry in out["stacks"]:
                entry["frames"] = flame.focused_frames(cursor, entry["frames"], frames)
        return out


@router.get("/sites/{site_key}/history", summary="A call site's events per run, oldest first")
def site_history(
    request: Request, site_key: str, limit: Annotated[int, Query(ge=1, le=5000)] = queries.HISTORY_LIMIT
) -> dict[str, Any]:
    database = service_of(request).database
    with database.read() as cursor:
        return queries.site_history(cursor, site_key, limit, generation=database.state_key())


@router.get("/stacks/{stack_id}", summary="One stack as a combined traceback, innermost frame first")
def stack(request: Request, stack_id: int, frames: TracebackFrames = "all") -> dict[str, Any]:
    with service_of(request).database.read() as cursor:
        return {"stack_id": stack_id, "frames": flame.focused_frames(cursor, queries.stack(cursor, stack_id), frames)}


@router.get("/events/{event_id}", summary="One recorded event and its traceback")
def event(request: Request, event_id: int, frames: TracebackFrames = "all") -> dict[str, Any]:
    mode = frames
    with service_of(request).database.read() as cursor:
        info = read.event(cursor, event_id)
        calling = read.calling_op(cursor, info)
        frames = queries.stack(cursor, info.stack_id) if info.stack_id is not None else []
        frames = flame.focused_frames(cursor, frames, mode)
    # calling_op: for an op of an op_stacks=outermost run called by another op, that op's event and
    # whether this event has its stack (see read.CallingOp); null otherwise.
    return {**vars(info), "calling_op": vars(calling) if calling is not None else None, "frames": frames}


@router.get(
    "/kernels/{name:path}/callers",
    summary="Sandwich view: every stack path into a kernel or op, and its call sites",
)
def kernel_callers(
    request: Request,
    name: str,
    kind: Annotated[list[str] | None, Query(description="Event kinds (default: all with this name).")] = None,
    run: Annotated[list[str] | None, Query(description="Run ids (default: every run).")] = None,
    limit: Limit = 50,
    frames: IcicleFrames = "program",
) -> dict[str, Any]:
    with service_of(request).database.read() as cursor:
        kinds = queries.event_kinds(cursor, name)
        if not kinds:
            raise NotFoundError(f"no event named {name!r} in the database")
        numbers = queries.run_numbers(cursor, run) if run else None
        if run and not numbers:
            raise SelectionError(f"none of the runs {', '.join(run)} is in the database")
        tree = flame.callers_tree(cursor, name, kind, numbers, frames)
        sites = queries.kernel_sites(cursor, name, kind[0] if kind and len(kind) == 1 else None, run, limit)
    return {"name": name, "kinds": kinds, "sites": sites, **tree}


# ------------------------------------------------------------------------------------------ compare


def report_request(
    candidate: str,
    baseline: str | None,
    baseline_window: int | None,
    label: list[str] | None,
    kind: list[str] | None,
    per: str | None,
    group_by: str | None,
    vary: list[str] | None,
    threshold_rel: float,
    threshold_abs: float,
) -> ReportRequest:
    """The request `tbpipe report` builds from the same options."""

    return ReportRequest(
        candidate=candidate,
        baseline=baseline or None,
        window=baseline_window,
        labels=parse_labels(label),
        kinds=tuple(kind or ()),
        per=parse_per(per or None),
        thresholds=Thresholds(relative=threshold_rel, absolute=threshold_abs),
        group_by=group_by or None,
        vary=tuple(vary) if vary else ("commit",),
    )


def compare_params(
    candidate: Annotated[
        str, Query(description="RUN: a run id, latest, latest:K=V,..., a group K=V, or a job: job=ID, latest-job.")
    ] = "latest",
    baseline: Annotated[str | None, Query(description="RUN to compare with.")] = None,
    baseline_window: Annotated[
        int | None, Query(ge=1, le=1000, description="Compare with the N previous runs (or groups).")
    ] = None,
    label: Labels = None,
    kind: Annotated[list[str] | None, Query(description="Event kinds to compare; repeatable.")] = None,
    per: Annotated[str | None, Query(description="KIND:NAME: divide counts by these events.")] = None,
    group_by: Annotated[str | None, Query(description="Label whose value groups runs (e.g. commit).")] = None,
    vary: Annotated[list[str] | None, Query(description="Labels the window's runs may differ in.")] = None,
    threshold_rel: Annotated[float, Query(ge=0, description="Flag only past this fraction of the baseline.")] = 0.0,
    threshold_abs: Annotated[float, Query(ge=0, description="... and past this many events.")] = 0.0,
) -> ReportRequest:
    return report_request(
        candidate, baseline, baseline_window, label, kind, per, group_by, vary, threshold_rel, threshold_abs
    )


CompareRequest = Annotated[ReportRequest, Depends(compare_params)]


def with_suspects(request: Request, report: ReportRequest) -> ReportRequest:
    """The request with suspects, as `tbpipe report` asks by default, from the service's --repo."""
    repo = service_of(request).config.repo
    return dataclasses.replace(report, suspects=True, repo=str(repo) if repo is not None else None)


@router.get("/compare", summary="The regression report's JSON (format 1), as `tbpipe report --format json`")
def compare_runs(
    request: Request,
    report: CompareRequest,
    per_rank: Annotated[bool, Query(description="Jobs: also each rank against the same rank (--per-rank).")] = False,
) -> JSONResponse:
    with service_of(request).database.read() as cursor:
        asked = with_suspects(request, report)
        result = compare_per_rank(cursor, asked, None) if per_rank else compare(cursor, asked, None)
    return JSONResponse(result.to_json())


def comparison_sides(cursor: Any, report: ReportRequest) -> tuple[list[str], list[list[str]]]:
    """The run ids of the candidate and of each baseline set, chosen as `compare` chooses them."""
    if (report.baseline is None) == (report.window is None):
        raise SelectionError("give a baseline: baseline=RUN or baseline_window=N (one of them)")
    candidate = run_select.resolve(cursor, report.candidate, report, role="candidate")
    if report.window is not None:
        baseline = run_select.window(cursor, candidate, report)
    else:
        baseline = [run_select.resolve(cursor, report.baseline, report, role="baseline")]
    return candidate.run_ids, [s.run_ids for s in baseline]


@router.get("/compare/icicle", summary="Diff icicle: the candidate's and the baseline's stacks in one tree")
def compare_icicle(request: Request, report: CompareRequest, frames: IcicleFrames = "program") -> dict[str, Any]:
    with service_of(request).database.read() as cursor:
        candidate, baseline = comparison_sides(cursor, report)
        tree = flame.diff_tree(
            cursor,
            queries.run_numbers(cursor, candidate),
            [queries.run_numbers(cursor, ids) for ids in baseline],
            list(report.kinds) or None,
            frames,
        )
    return {"candidate": candidate, "baseline": baseline, **tree}


# ------------------------------------------------------------------------------------------ SQL


@router.get("/query", summary="Read-only SQL: one SELECT, with a time and a row limit")
def query(
    request: Request,
    sql: Annotated[str, Query(description="One SELECT statement.")],
    limit: Annotated[int | None, Query(ge=1, description="Rows to return (at most the service's limit).")] = None,
) -> dict[str, Any]:
    config = service_of(request).config
    rows = min(limit or config.query_max_rows, config.query_max_rows)
    with service_of(request).database.sandbox(wait_s=config.query_timeout_s) as cursor:
        return run_query(cursor, sql, max_rows=rows, timeout_s=config.query_timeout_s).to_json()


# ------------------------------------------------------------------------------------------ ingest


@router.get("/ingest", summary="The ingest service: watched folders, queued and recent jobs")
def ingest_status(request: Request) -> dict[str, Any]:
    service = service_of(request)
    running = service.ingest.running
    return {
        "database": str(service.config.db_path),
        "mode": service.database.mode,
        "uploads": service.config.token is not None,
        "watch": service.watcher.status() if service.watcher else None,
        "queued": service.ingest.queued(),
        "running": running.to_json() if running else None,
        "jobs": [job.to_json() for job in service.ingest.jobs(20)],
    }


@router.get("/ingest/jobs/{job_id}", summary="What came of one ingest job (an upload or a watched batch)")
def ingest_job(request: Request, job_id: str) -> dict[str, Any]:
    job = service_of(request).ingest.job(job_id)
    if job is None:
        raise NotFoundError(f"no ingest job {job_id!r} (the service keeps the last jobs only)")
    return job.to_json()


@router.post(
    "/runs",
    summary="Upload a run (a tar, tar.gz or zip of its folder); needs the token",
    status_code=202,
    responses={
        201: {"description": "ingested (with ?wait=)"},
        202: {"description": "accepted: the job URL tells the outcome"},
        401: {"description": "no or wrong token"},
        413: {"description": "too large, or unpacks to too much"},
        422: {"description": "damaged run, quarantined"},
        507: {"description": "not enough free disk to unpack it"},
    },
)
async def upload_run(
    request: Request,
    wait: Annotated[float, Query(ge=0, le=600, description="Seconds to wait for the ingest's outcome.")] = 0,
) -> JSONResponse:
    service = service_of(request)
    config = service.config
    check_token(config.token, request.headers.get("authorization"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > config.max_upload_bytes:
        raise UploadRefused(
            f"the upload is {int(declared):,} bytes; at most {config.max_upload_bytes:,} are taken", 413
        )
    incoming = config.uploads / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    archive = incoming / f"{os.getpid()}-{os.urandom(6).hex()}.archive"
    try:
        size = 0
        with open(archive, "wb") as out:
            async for chunk in request.stream():
                size += len(chunk)
                if size > config.max_upload_bytes:
                    raise UploadRefused(f"the upload is over {config.max_upload_bytes:,} bytes (the limit)", 413)
                out.write(chunk)
        if size == 0:
            raise UploadRefused("empty upload: send the archive as the request body (curl --data-binary @run.tar)")
        upload = await run_in_threadpool(receive, archive, config.uploads, config.unpacked_limit, config.max_expansion)
    finally:
        archive.unlink(missing_ok=True)
    job = service.ingest.submit(upload.run_dirs, "upload")
    if wait:
        await asyncio.get_running_loop().run_in_executor(None, job.done.wait, wait)
    body = {"upload_id": upload.upload_id, "run_ids": upload.run_ids, "job_url": f"/api/ingest/jobs/{job.job_id}"}
    body["job"] = job.to_json()
    status = 202
    if job.done.is_set():
        quarantined = [o for o in job.outcomes if o.status == "quarantined"]
        if job.status != DONE:
            status = 503
            body["error"] = job.error
        elif quarantined:
            status = 422
            body["error"] = "quarantined: " + "; ".join(o.reason or "" for o in quarantined)
        else:
            status = 201
    return JSONResponse(body, status_code=status, headers={"location": body["job_url"]})
