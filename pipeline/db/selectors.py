"""Run selectors: which runs a command reads, as people write them on the command line.

    RUN_ID              that run (or the one run whose id starts with it)
    latest              the newest run in the database
    latest:K=V,K2=V2    the newest run carrying all of these labels

"Newest" is by `runs.started_at`, ties broken by `run_id`. Shared by the commands that read
chosen runs (`tbpipe export`; `tbpipe report` adds groups and windows on top, in
`pipeline.reports.regression.select`), so every one accepts the same words.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.errors import UsageError

LATEST = "latest"


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
    """One parsed selector: an exact run id (or its prefix), or the newest run with some labels."""

    text: str
    run_id: str | None = None  # None: the newest run with `labels`
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def is_latest(self) -> bool:
        return self.run_id is None


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
    """`RUN_ID`, `latest` or `latest:K=V,...` -> RunSelector; a malformed label list is a RunSelectionError."""
    text = text.strip()
    if not text:
        raise RunSelectionError("empty run selector: give a run id, 'latest' or 'latest:KEY=VALUE,...'")
    if text == LATEST:
        return RunSelector(text)
    if text.startswith(LATEST + ":"):
        return RunSelector(text, labels=parse_label_list(text[len(LATEST) + 1 :], "run selector"))
    return RunSelector(text, run_id=text)


def _describe(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items())


def resolve_selector(con: Any, selector: RunSelector) -> str:
    """The run id `selector` names in the database behind `con`."""
    if selector.is_latest:
        where, params = [], []
        for key, value in selector.labels.items():
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
        if not rows:
            if selector.labels:
                raise RunSelectionError(f"no run with labels {_describe(selector.labels)} in the database")
            raise RunSelectionError("no runs in the database: ingest some with `tbpipe ingest RUNS_DIR`")
        return rows[0][0]
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
    """The run ids the selectors name, in the order given, each once."""
    run_ids: list[str] = []
    for selector in selectors:
        parsed = parse_selector(selector) if isinstance(selector, str) else selector
        run_id = resolve_selector(con, parsed)
        if run_id not in run_ids:
            run_ids.append(run_id)
    return run_ids
