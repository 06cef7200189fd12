"""What the API and the pages read: runs, a run's call sites, a site with its tracebacks and history,
the callers of a kernel. Built on `pipeline.db.read`; the few reads it lacks are here, parameterised.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from tbpipe.pipeline.db import read, retain
from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.db.read import NotFoundError

HISTORY_LIMIT = 500


def _iso(value: Any) -> Any:
    return value.isoformat() + "Z" if hasattr(value, "isoformat") else value


def _run_json(run: dict[str, Any]) -> dict[str, Any]:
    out = dict(run)
    out["started_at"] = _iso(run["started_at"])
    out["ended_at"] = _iso(run["ended_at"])
    out["labels"] = dict(run["labels"] or {})
    out["status"] = "complete" if run["complete"] else "incomplete"
    out["argv"] = list(run["argv"] or [])
    out["ingest_notes"] = list(run["ingest_notes"] or [])
    # Rolled up by `tbpipe retain`: its counts stay, its events (and so its event pages) are gone.
    out["rolled_up_at"] = _iso(run["rolled_up_at"])
    out["rolled_up"] = run["rolled_up_at"] is not None
    return out


# Facts derived from the whole database, kept per state of it (`ServedDatabase.state_key()`, None
# while an ingest writes: then computed per request). One state at a time; a race between two
# requests computes a fact twice, harmlessly.
_STATE: dict[tuple, dict[str, Any]] = {}


def _per_state(generation: tuple | None, fact: str, compute: Callable[[], Any]) -> Any:
    if generation is None:
        return compute()
    facts = _STATE.get(generation)
    if facts is None:
        _STATE.clear()
        facts = _STATE[generation] = {}
    if fact not in facts:
        facts[fact] = compute()
    return facts[fact]


def counts_by_kind(cursor: Any, run_ids: list[str], generation: tuple | None = None) -> dict[str, dict[str, int]]:
    """{run_id: {kind: events}} for the given runs; with `generation` (what identifies the database's
    state), every run's counts are computed once per state and kept."""
    if generation is not None:
        every = _per_state(generation, "counts", lambda: _counts(cursor, None))
        return {run_id: every.get(run_id, {}) for run_id in run_ids}
    return _counts(cursor, run_ids)


class SiteDirectory:
    """Every site's function, portable file and key by site id, in columns (a few MB per 100k sites):
    a page of a run's sites names its sites from here instead of a query per page."""

    def __init__(self, cursor: Any):
        table = query_arrow(cursor, "SELECT site_id, function, portable_file, site_key FROM sites ORDER BY site_id")
        self._ids = table["site_id"].to_numpy()
        self._table = table

    def describe(self, site_ids: list[int]) -> dict[int, tuple[str | None, str | None, str]]:

        wanted = np.asarray(site_ids, dtype=self._ids.dtype)
        positions = np.searchsorted(self._ids, wanted)
        found = positions < len(self._ids)
        found[found] = self._ids[positions[found]] == wanted[found]
        rows = self._table.take(positions[found]).to_pylist()
        return {row["site_id"]: (row["function"], row["portable_file"], row["site_key"]) for row in rows}


def _counts(cursor: Any, run_ids: list[str] | None) -> dict[str, dict[str, int]]:
    # The runs' numbers as literals: a constant filter reaches the rolled-up runs' blocks (sql/counts.sql).
    where = ""
    if run_ids is not None:
        numbers = query_rows(cursor, "SELECT run_number FROM runs WHERE list_contains(?, run_id)", [run_ids])
        where = f"WHERE c.run_number IN ({', '.join(str(int(n)) for (n,) in numbers) or 'NULL'})"
    rows = query_rows(
        cursor,
        f"""
        SELECT r.run_id, n.kind, sum(c.events)::BIGINT
        FROM run_name_counts c
        JOIN event_names n USING (name_id)
        JOIN runs r USING (run_number)
        {where}
        GROUP BY ALL
        ORDER BY 1, 3 DESC
        """,
    )
    out: dict[str, dict[str, int]] = {run_id: {} for run_id in run_ids or []}
    for run_id, kind, events in rows:
        out.setdefault(run_id, {})[kind] = events
    return out


def runs_page(
    cursor: Any,
    labels: dict[str, str],
    complete: bool | None,
    limit: int,
    offset: int,
    newest_first: bool = True,
    generation: tuple | None = None,
) -> dict[str, Any]:
    # The page's rows only (a year of nightly ranks is thousands of runs).
    total = read.count_runs(cursor, labels, complete=complete)
    runs = read.runs(cursor, labels, complete=complete, newest_first=newest_first, limit=limit, offset=offset)
    page = [_run_json(r) for r in runs]
    counts = counts_by_kind(cursor, [r["run_id"] for r in page], generation) if page else {}
    for run in page:
        run["counts"] = counts.get(run["run_id"], {})
    return {"runs": page, "total": total, "limit": limit, "offset": offset}


def label_values(cursor: Any) -> dict[str, list[str]]:
    """Every label key with its values, for the runs page's filters."""
    rows = query_rows(
        cursor,
        """
        SELECT k, list(DISTINCT v ORDER BY v)
        FROM (SELECT unnest(map_keys(labels)) AS k, unnest(map_values(labels)) AS v FROM runs)
        GROUP BY k ORDER BY k
        """,
    )
    return {key: list(values) for key, values in rows}


def run(cursor: Any, run_id: str, generation: tuple | None = None) -> dict[str, Any]:
    """One run's row, its counts by kind (every run's, kept per state with `generation`) and its children."""
    rows = query_rows(
        cursor,
        """
        SELECT run_id, run_number, parent_run_id, started_at AT TIME ZONE 'UTC', ended_at AT TIME ZONE 'UTC', complete,
               host, pid, argv, cwd, labels, python_version, torch_version, cuda_version, tbpipe_version, sources,
               events_recorded, events_dropped, events, stacks, new_stacks, capture_errors, ingest_notes, source_dir,
               ingested_at AT TIME ZONE 'UTC', rolled_up_at AT TIME ZONE 'UTC'
        FROM runs WHERE run_id = ?
        """,
        [run_id],
    )
    if not rows:
        raise NotFoundError(f"no run {run_id!r} in the database (GET /api/runs lists them)")
    keys = (
        "run_id run_number parent_run_id started_at ended_at complete host pid argv cwd labels python_version "
        "torch_version cuda_version tbpipe_version sources events_recorded events_dropped events stacks new_stacks "
        "capture_errors ingest_notes source_dir ingested_at rolled_up_at"
    ).split()
    out = dict(zip(keys, rows[0]))
    out["rolled_up"] = out["rolled_up_at"] is not None
    for key in ("started_at", "ended_at", "ingested_at", "rolled_up_at"):
        out[key] = _iso(out[key])
    out["labels"] = dict(out["labels"] or {})
    out["status"] = "complete" if out["complete"] else "incomplete"
    for key in ("argv", "sources", "capture_errors", "ingest_notes"):
        out[key] = list(out[key] or [])
    out["counts"] = counts_by_kind(cursor, [run_id], generation)[run_id]
    children = query_rows(cursor, "SELECT run_id FROM runs WHERE parent_run_id = ? ORDER BY started_at", [run_id])
    out["child_run_ids"] = [r[0] for r in children]
    return out


def run_sites(
    cursor: Any,
    run_id: str,
    kind: str | None,
    name: str | None,
    limit: int,
    offset: int,
    generation: tuple | None = None,
) -> list[dict[str, Any]]:
    """A run's call sites, most events first: what `read.top_sites` gives for one run, from that run's
    `site_counts` rows. With `generation`, the run numbers, the site directory and the run's leading
    sites are kept per state."""
    number = _run_numbers(cursor, generation).get(run_id)
    if number is None:
        raise NotFoundError(f"no run {run_id!r} in the database (GET /api/runs lists them)")
    rows = None
    if generation is not None and name is None:
        rows = _page_of_lead(_lead(cursor, number, generation), kind, offset, limit)
    if rows is None:
        rows = _sites_page(cursor, number, kind, name, limit, offset)
    directory = _site_directory(cursor, generation)
    sites = directory.describe([row[0] for row in rows if row[0] is not None])
    out = []
    for site_id, kind, name, site_file, site_line, events in rows:
        function, portable_file, site_key = sites.get(site_id, (None, None, None))
        out.append(
            {
                "kind": kind,
                "name": name,
                "site_function": function,
                "site_file": portable_file if portable_file is not None else site_file,
                "site_line": site_line,
                "site_key": site_key,
                "events": events,
            }
        )
    return out


def _run_numbers(cursor: Any, generation: tuple | None) -> dict[str, int]:
    return _per_state(
        generation, "run numbers", lambda: dict(query_rows(cursor, "SELECT run_id, run_number FROM runs"))
    )


def _site_directory(cursor: Any, generation: tuple | None) -> SiteDirectory:
    return _per_state(generation, "sites", lambda: SiteDirectory(cursor))


# The newest runs whose leading sites `warm` reads ahead: what the runs page links to first.
WARM_RUNS = 64


def warm(cursor: Any, generation: tuple) -> int:
    """Reads ahead, for this state of the database, what the first pages after an ingest ask for: the
    run numbers, the site directory, every run's event counts and the leading sites of the newest
    `WARM_RUNS` runs. Returns how many runs' leads it read. Run by the service's warmer thread."""
    _run_numbers(cursor, generation)
    _site_directory(cursor, generation)
    counts_by_kind(cursor, [], generation)
    newest = query_rows(cursor, "SELECT run_number FROM runs ORDER BY started_at DESC, run_id LIMIT ?", [WARM_RUNS])
    for (number,) in newest:
        _lead(cursor, number, generation)
    return len(newest)


# A run's leading call sites, every kind together, are read once per state of the database, and the
# pages that fall within them (any kind, any offset) are cut from that list: the run page's kernel
# launches, its ops and its top sites cost one query, not one each (~3 ms of CPU apiece on a 10M-event
# database). Pages past the lead, and name searches (DuckDB's lower() is not Python's), query.
LEAD_SITES = retain.LEAD_SITES  # a rolled-up run's lead is kept whole (`rolled_up_leads`)
LEAD_RUNS_KEPT = 256  # per state, the runs asked of most recently (~30 kB each)
_LEADS_LOCK = threading.Lock()
# Every page is this order, or a part of it: cutting a kind's page from the lead needs a total order.
_SITES_ORDER = retain.LEAD_ORDER


def _sites_page(
    cursor: Any, run_number: int, kind: str | None, name: str | None, limit: int, offset: int
) -> list[tuple]:
    where, params = ["p.run_number = ?"], [run_number]
    if kind is not None:
        where.append("n.kind = ?")
        params.append(kind)
    if name is not None:
        where.append("contains(lower(n.name), lower(?))")
        params.append(name)
    # The page's rows first (the run's rows are together, found by their zone maps), then their
    # sites: joined before the limit, every site's row would be read.
    return query_rows(
        cursor,
        f"""
        SELECT p.site_id, n.kind, n.name, p.site_file, p.site_line, p.events::BIGINT
        FROM run_site_counts p JOIN event_names n USING (name_id)
        WHERE {" AND ".join(where)}
        ORDER BY {_SITES_ORDER}
        LIMIT {int(limit)} OFFSET {int(offset)}
        """,
        params,
    )


def _lead(cursor: Any, run_number: int, generation: tuple) -> list[tuple]:
    leads = _per_state(generation, "leads", OrderedDict)
    with _LEADS_LOCK:
        lead = leads.get(run_number)
        if lead is not None:
            leads.move_to_end(run_number)
            return lead
    lead = _kept_lead(cursor, run_number) or _sites_page(cursor, run_number, None, None, LEAD_SITES, 0)
    with _LEADS_LOCK:
        leads[run_number] = lead
        while len(leads) > LEAD_RUNS_KEPT:
            leads.popitem(last=False)
    return lead


def _kept_lead(cursor: Any, run_number: int) -> list[tuple]:
    """A rolled-up run's lead as its roll-up kept it (a few rows by run); none for other runs, and for
    runs rolled up before leads were kept (then read from their counts)."""
    return query_rows(
        cursor,
        """
        SELECT l.site_id, n.kind, n.name, l.site_file, l.site_line, l.events
        FROM rolled_up_leads l JOIN event_names n USING (name_id)
        WHERE l.run_number = ? AND l.run_number IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
        ORDER BY l.place
        """,
        [run_number],
    )


def _page_of_lead(lead: list[tuple], kind: str | None, offset: int, limit: int) -> list[tuple] | None:
    """The page, when the lead holds all of it: a kind's rows keep their order among all rows."""
    rows = lead if kind is None else [row for row in lead if row[1] == kind]
    if len(lead) < LEAD_SITES or len(rows) >= offset + limit:
        return rows[offset : offset + limit]
    return None


def _run_exists(cursor: Any, run_id: str) -> bool:
    return bool(query_rows(cursor, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]))


def _frame_json(frame: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": frame["kind"],
        "function": frame["name"],
        "file": frame["filename"],
        "line": frame["line"],
        "module": frame["module"],
        "inlined": bool(frame["inlined"]),
        "generated": bool(frame.get("generated")),
    }


def stack(cursor: Any, stack_id: int) -> list[dict[str, Any]]:
    """A combined traceback, innermost frame first."""
    return [_frame_json(f) for f in read.stack_frames(cursor, stack_id)]


def lookups(generation: tuple | None) -> read.Lookups:
    """The small answers kept for this state of the database (a fresh set while an ingest writes)."""
    return _per_state(generation, "lookups", read.Lookups)


def site(cursor: Any, site_key: str, stacks: int, generation: tuple | None = None) -> dict[str, Any]:
    """A call site: where it is, its heaviest stacks with their combined tracebacks, its events per run."""
    kept = lookups(generation)
    info = read.site(cursor, site_key, stacks, kept)
    frames = read.stacks_frames(cursor, [s.stack_id for s in info.stacks], kept)
    return {
        "site_key": info.site_key,
        "function": info.function,
        "file": info.file,
        "portable_file": info.portable_file,
        "line": info.line,
        "is_user": info.is_user,
        "events": info.events,
        "stack_count": info.stack_count,
        "stacks": [
            {
                "stack_id": s.stack_id,
                "events": s.events,
                "names": s.names,
                "frames": [_frame_json(f) for f in frames.get(s.stack_id, [])],
            }
            for s in info.stacks
        ],
        "runs": site_history(cursor, site_key, HISTORY_LIMIT, info.site_id, generation)["runs"],
    }


def site_history(
    cursor: Any, site_key: str, limit: int, site_id: int | None = None, generation: tuple | None = None
) -> dict[str, Any]:
    """The site's events in every run that has it (oldest first), per event kind and name, and where it was."""
    # The site's rows through its index (sql/migrations/007) and from the rolled-up runs' blocks,
    # then their runs and names.
    kept = lookups(generation)
    counts = read.site_run_counts(
        cursor,
        site_id if site_id is not None else read.site_id(cursor, site_key),
        kept,  # the caller may know it
    )
    names = kept.event_names(cursor, {row[1] for row in counts})
    by_run: dict[int, list[tuple]] = {}
    for run_number, name_id, events, file, line in counts:
        by_run.setdefault(run_number, []).append((events, name_id, file, line))
    of_run = kept.runs(cursor, by_run)
    # Newest run first (ties by run id), each run's names by events, most first: the runs are
    # sorted, not their rows (a year's history has a row or two a run).
    order = sorted(by_run, key=lambda number: of_run[number][0])
    order.sort(key=lambda number: of_run[number][1], reverse=True)
    runs = []
    for run_number in order[:limit]:
        run_id, started, labels = of_run[run_number]
        rows = by_run[run_number]
        rows.sort(key=lambda row: -row[0])
        _events, _name, file, line = rows[0]
        entry = {
            "run_id": run_id,
            "started_at": _iso(started),
            "labels": dict(labels or {}),
            "events": 0,
            "names": {},
            "site_file": file,
            "site_line": line,
        }
        for events, name_id, _file, _line in rows:
            kind, name = names[name_id]
            entry["events"] += events
            entry["names"][f"{kind}:{name}"] = events
        runs.append(entry)
    runs.reverse()
    return {"site_key": site_key, "runs": runs}


def kernel_sites(cursor: Any, name: str, kind: str | None, run_ids: list[str] | None, limit: int) -> list[dict]:
    """The call sites of events named exactly `name`."""
    sites = read.top_sites(cursor, kind, run_ids, limit * 4, name=name)
    return [s for s in sites if s["name"] == name][:limit]


def event_kinds(cursor: Any, name: str) -> list[str]:
    return [r[0] for r in query_rows(cursor, "SELECT kind FROM event_names WHERE name = ? ORDER BY kind", [name])]


def run_numbers(cursor: Any, run_ids: list[str]) -> list[int]:
    return [r[0] for r in query_rows(cursor, "SELECT run_number FROM runs WHERE list_contains(?, run_id)", [run_ids])]
