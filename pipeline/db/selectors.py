"""Run selectors: which runs a command reads, as people write them on the command line.

    RUN_ID              that run (or the one run whose id starts with it)
    latest              the newest run in the database
    latest:K=V,K2=V2    the newest run carrying all of these labels
    job=ID              every run of one job (a launch of many ranks: its ranks and its launcher)
    latest-job          every run of the newest job
    latest-job:K=V,...  every run of the newest job among runs carrying these labels

"Newest" is by `runs.started_at`, ties broken by `run_id`; a job is the runs sharing a `job` label
(capture/ranks.py sets it). Shared by the commands that read chosen runs (`tbpipe export`,
`tbpipe ranks`; `tbpipe report` adds groups and windows on top, in
`pipeline.reports.regression.select`), so every one accepts the same words.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.errors import UsageError

LATEST = "latest"
LATEST_JOB = "latest-job"
JOB_LABEL = "job"


def parse_per(text: str | None) -> tuple[str, str] | None:
    """`--per KIND:NAME` (the events whose count divides each run's counts) as (kind, name)."""
    if text is None:
        return None
    kind, sep, name = text.partition(":")
    if not sep or not kind or not name:
        raise UsageError(f"--per {text!r}: expected KIND:NAME, e.g. --per step:train")
    return kind, name


class RunSelectionError(UsageError):
    """A run selector that names no run, or more than one where one is needed."""


@dataclass(frozen=True)
class RunSelector:
    """One parsed selector: an exact run id (or its prefix), the newest run with some labels, or a
    job (by its id, or the newest with some labels)."""

    text: str
    run_id: str | None = None  # None: the newest run (or job) with `labels`
    labels: dict[str, str] = field(default_factory=dict)
    job: str | None = None  # `job=ID`
    latest_job: bool = False  # `latest-job[:K=V,...]`

    @property
    def is_job(self) -> bool:
        return self.job is not None or self.latest_job

    @property
    def is_latest(self) -> bool:
        return self.run_id is None and not self.is_job


def parse_label_list(text: str, what: str) -> dict[str, str]:
    """'K=V,K2=V2' -> {K: V, K2: V2}; RunSelectionError names `what` and the malformed pair."""
    labels: dict[str, str] = {}
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise RunSelectionError(f"{what} {text!r}: expected KEY=VALUE[,KEY=VALUE...], not {pair!r}")
        labels[key.strip()] = value.strip()
    return labels


def parse_selector(text: str) -> RunSelector:
    """`RUN_ID`, `latest`, `latest:K=V,...`, `job=ID`, `latest-job` or `latest-job:K=V,...` ->
    RunSelector; a malformed label list is a RunSelectionError."""
    text = text.strip()
    if not text:
        raise RunSelectionError(
            "empty run selector: give a run id, 'latest', 'latest:KEY=VALUE,...', 'job=ID' or 'latest-job'"
        )
    if text in (LATEST, LATEST_JOB):
        return RunSelector(text, latest_job=text == LATEST_JOB)
    for word in (LATEST_JOB, LATEST):
        if text.startswith(word + ":"):
            labels = parse_label_list(text[len(word) + 1 :], "run selector")
            return RunSelector(text, labels=labels, latest_job=word == LATEST_JOB)
    if text.startswith(JOB_LABEL + "="):
        job = text[len(JOB_LABEL) + 1 :].strip()
        if not job:
            raise RunSelectionError(f"run selector {text!r}: give the job's id, job=ID")
        return RunSelector(text, job=job)
    return RunSelector(text, run_id=text)


def _describe(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items())


def _newest(con: Any, labels: dict[str, str], extra: str = "") -> str | None:
    """The newest run with these labels (and the SQL condition `extra`), or None."""
    where, params = [extra] if extra else [], []
    for key, value in labels.items():
        where.append("labels[?] = ?")
        params += [key, value]
    rows = query_rows(
        con,
        f"""
        SELECT run_id FROM runs {"WHERE " + " AND ".join(where) if where else ""}
        ORDER BY started_at DESC NULLS LAST, run_id DESC LIMIT 1
        """,
        params,
    )
    return rows[0][0] if rows else None


@dataclass(frozen=True)
class Job:
    """The runs of one job, oldest first."""

    job_id: str
    run_ids: list[str]


def resolve_job(con: Any, selector: RunSelector) -> Job:
    """The job a `job=ID` or `latest-job[:K=V,...]` selector names; RunSelectionError when none."""
    job_id = selector.job
    if job_id is None:
        newest = _newest(con, selector.labels, f"labels['{JOB_LABEL}'] IS NOT NULL")
        if newest is None:
            wanted = f" among runs with labels {_describe(selector.labels)}" if selector.labels else ""
            raise RunSelectionError(
                f"no job{wanted} in the database: runs get a job label when a launcher (torchrun, SLURM, MPI, "
                "torch.multiprocessing) started them"
            )
        job_id = query_rows(con, f"SELECT labels['{JOB_LABEL}'] FROM runs WHERE run_id = ?", [newest])[0][0]
    rows = query_rows(
        con,
        f"SELECT run_id FROM runs WHERE labels['{JOB_LABEL}'] = ? ORDER BY started_at NULLS LAST, run_id",
        [job_id],
    )
    if not rows:
        raise RunSelectionError(f"no job {job_id!r} in the database (`tbpipe runs` lists runs with their labels)")
    return Job(job_id, [row[0] for row in rows])


def resolve_selector(con: Any, selector: RunSelector) -> str:
    """The run id `selector` names in the database behind `con` (a job selector names several: `resolve_runs`)."""
    if selector.is_job:
        raise RunSelectionError(f"{selector.text!r} names a job, not one run")
    if selector.is_latest:
        newest = _newest(con, selector.labels)
        if newest is None:
            if selector.labels:
                raise RunSelectionError(f"no run with labels {_describe(selector.labels)} in the database")
            raise RunSelectionError("no runs in the database: ingest some with `tbpipe ingest RUNS_DIR`")
        return newest
    run_id = selector.run_id
    assert run_id is not None
    if query_rows(con, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]):
        return run_id
    matches = [
        row[0] for row in query_rows(con, "SELECT run_id FROM runs WHERE starts_with(run_id, ?) LIMIT 3", [run_id])
    ]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise RunSelectionError(f"run {run_id!r} is ambiguous: it starts {', '.join(matches[:2])}, ...")
    raise RunSelectionError(f"no run {run_id!r} in the database (`tbpipe runs` lists them)")


def resolve_runs(con: Any, selectors: Iterable[str | RunSelector]) -> list[str]:
    """The run ids the selectors name (a job's: all of them), in the order given, each once."""
    run_ids: list[str] = []
    for selector in selectors:
        parsed = parse_selector(selector) if isinstance(selector, str) else selector
        named = resolve_job(con, parsed).run_ids if parsed.is_job else [resolve_selector(con, parsed)]
        run_ids.extend(run_id for run_id in named if run_id not in run_ids)
    return run_ids
