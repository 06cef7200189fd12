"""Which runs each side of a comparison sums over.

A RUN is written as
    RUN_ID              that run
    latest              the newest run (among those with the `--label` filters)
    latest:K=V,...      the newest run with those labels
    K=V[,K2=V2...]      a group: every run with those labels (one process or rank each), summed
    job=ID, latest-job[:K=V,...]
                        a job: every run of one launch (`pipeline.db.selectors`), summed

With `group_by` (e.g. 'commit'), a RUN that names one run stands for its whole group: every run
that shares its value of that label. A baseline window is the N runs (or groups) that started
before the candidate and carry the candidate's labels, except the ones allowed to vary (and the
job id, which no two launches share); a job's window is of earlier jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.selectors import (
    JOB_LABEL,
    LATEST_JOB,
    RunSelectionError,
    RunSelector,
    parse_label_list,
    parse_selector,
    resolve_job,
    resolve_selector,
)
from tbpipe.pipeline.reports.regression.model import ReportRequest, RunSet


class SelectionError(RunSelectionError):
    """A RUN that names no run, or a window with nothing in it: says what the database has instead."""


@dataclass(frozen=True)
class _Run:
    run_id: str
    started_at: datetime | None
    labels: dict[str, str]


def _runs(con: Any) -> list[_Run]:
    rows = query_rows(
        con,
        # UTC wall-clock times: a TIMESTAMPTZ fetched into Python needs pytz with DuckDB 1.x.
        "SELECT run_id, started_at AT TIME ZONE 'UTC', labels FROM runs ORDER BY started_at, run_id",
    )
    return [_Run(run_id, started, dict(labels or {})) for run_id, started, labels in rows]


def _matching(runs: list[_Run], labels: dict[str, str]) -> list[_Run]:
    return [r for r in runs if all(r.labels.get(k) == v for k, v in labels.items())]


def _describe(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "any labels"


def _known_values(runs: list[_Run], keys: list[str]) -> str:
    """What the database has for these label keys, for error messages."""
    parts = []
    for key in keys:
        values = sorted({r.labels[key] for r in runs if key in r.labels})
        shown = ", ".join(values[:8]) + (f" and {len(values) - 8} more" if len(values) > 8 else "")
        parts.append(f"{key}: {shown}" if values else f"no run has a {key!r} label")
    return "; ".join(parts)


def _run_set(name: str, runs: list[_Run]) -> RunSet:
    shared = dict(runs[0].labels)
    for run in runs[1:]:
        shared = {k: v for k, v in shared.items() if run.labels.get(k) == v}
    starts = [r.started_at for r in runs if r.started_at is not None]
    started = min(starts).isoformat() if starts else None
    return RunSet(name, [r.run_id for r in runs], shared, started)


def _group_of(run: _Run, candidates: list[_Run], group_by: str) -> RunSet:
    value = run.labels.get(group_by)
    if value is None:
        raise SelectionError(
            f"run {run.run_id} has no {group_by!r} label to group by (its labels: {_describe(run.labels)})"
        )
    members = [r for r in candidates if r.labels.get(group_by) == value]
    return _run_set(f"{group_by}={value}", members or [run])


def resolve(con: Any, selector: str, request: ReportRequest, *, role: str) -> RunSet:
    """The runs `selector` names; SelectionError saying what exists when it names none."""
    runs = _runs(con)
    if not runs:
        raise SelectionError("the database has no runs: ingest some with `tbpipe ingest RUNS_DIR`")
    pool = _matching(runs, request.labels)
    filtered = f" with {_describe(request.labels)}" if request.labels else ""
    text = selector.strip()
    # `job=ID,K=V` is a group like any other (one rank of a job: `job=ID,rank=0`).
    if text.startswith(LATEST_JOB) or (text.startswith(JOB_LABEL + "=") and "," not in text):
        parsed = parse_selector(text)
        if parsed.latest_job:  # the newest job among the runs the --label filters leave
            parsed = RunSelector(text, labels={**request.labels, **parsed.labels}, latest_job=True)
        job = resolve_job(con, parsed).job_id
        members = _matching(pool, {JOB_LABEL: job})
        if not members:
            raise SelectionError(f"--{role} {selector}: job {job} has no run{filtered}")
        return _run_set(f"{JOB_LABEL}={job}", members)
    if text == "latest" or text.startswith("latest:"):
        wanted = parse_label_list(text[len("latest:") :], f"--{role}") if text != "latest" else {}
        found = _matching(pool, wanted)
        if not found:
            raise SelectionError(
                f"--{role} {selector}: no run{filtered} has {_describe(wanted)} ({_known_values(pool, list(wanted))})"
            )
        run = found[-1]
        return _group_of(run, pool, request.group_by) if request.group_by else _run_set(run.run_id, [run])
    if "=" in text:
        wanted = parse_label_list(text, f"--{role}")
        found = _matching(pool, wanted)
        if not found:
            raise SelectionError(
                f"--{role} {selector}: no run{filtered} has {_describe(wanted)} ({_known_values(pool, list(wanted))})"
            )
        return _run_set(_describe(wanted), found)
    by_id = {r.run_id: r for r in runs}
    try:
        run = by_id[resolve_selector(con, parse_selector(text))]  # an id, or a unique prefix of one
    except RunSelectionError:
        newest = ", ".join(r.run_id for r in runs[-3:])
        raise SelectionError(
            f"--{role} {selector}: no such run in the database (newest: {newest}; "
            "a RUN is a run id, latest, latest:K=V or a group K=V)"
        ) from None
    return _group_of(run, pool, request.group_by) if request.group_by else _run_set(run.run_id, [run])


def is_job(run_set: RunSet) -> bool:
    """Whether the set is one whole job (as `resolve` names a job selector's runs)."""
    return run_set.name == f"{JOB_LABEL}={run_set.labels.get(JOB_LABEL)}"


def window(con: Any, candidate: RunSet, request: ReportRequest) -> list[RunSet]:
    """The `request.window` runs (or groups) before the candidate with its labels, oldest first."""
    runs = _runs(con)
    group_by = request.group_by or (JOB_LABEL if is_job(candidate) else None)
    ignore = set(request.vary) | {JOB_LABEL} | ({group_by} if group_by else set())
    same = {k: v for k, v in candidate.labels.items() if k not in ignore}
    starts = {r.run_id: r.started_at for r in runs}
    first = min((starts[r] for r in candidate.run_ids if starts.get(r) is not None), default=None)
    excluded = set(candidate.run_ids)
    earlier = [
        r
        for r in _matching(_matching(runs, request.labels), same)
        if r.run_id not in excluded and (first is None or (r.started_at is not None and r.started_at < first))
    ]
    if group_by:
        groups: dict[str, list[_Run]] = {}
        for run in earlier:
            value = run.labels.get(group_by)
            if value is not None and value != candidate.labels.get(group_by):
                groups.setdefault(value, []).append(run)
        sets = sorted(
            (_run_set(f"{group_by}={value}", members) for value, members in groups.items()),
            key=lambda s: s.started_at or "",
        )
    else:
        sets = [_run_set(r.run_id, [r]) for r in earlier]
    chosen = sets[-request.window :] if request.window else []
    if not chosen:
        unit = f"group of {group_by}" if group_by else "run"
        raise SelectionError(
            f"--baseline-window {request.window}: no earlier {unit} than {candidate.name} with "
            f"{_describe(same)} (labels allowed to vary: {', '.join(sorted(ignore)) or 'none'}); "
            f"the database has {len(runs)} runs ({_known_values(runs, sorted(same))})"
        )
    return chosen
