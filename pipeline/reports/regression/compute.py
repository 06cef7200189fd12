"""The comparison: per (kind, name, call site), the candidate's events against the baseline's.

Two tiers. Against one baseline (a run or a group), counts are exact: any change past both
thresholds is one. Against a window of earlier runs, a site whose count every window run agrees on
is compared the same exact way; a site whose count varies is flagged only when the candidate leaves
the window's band (`stats.spread`) and also passes the thresholds measured from the window's
median, so data-dependent sites do not alarm. Everything is computed column-wise: one DuckDB query
gives every (set, site) value, numpy classifies all sites at once.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.reports.regression import select
from tbpipe.pipeline.reports.regression.accept import AcceptList
from tbpipe.pipeline.reports.regression.model import (
    DECREASED,
    INCREASED,
    MOVED,
    NEW,
    REGRESSING,
    REMOVED,
    UNCHANGED,
    EnvironmentDifference,
    Frame,
    RegressionReport,
    ReportRequest,
    RunSet,
    SiteChange,
    Spread,
)
from tbpipe.pipeline.reports.regression.select import SelectionError
from tbpipe.pipeline.reports.regression.stats import spread

ENVIRONMENT_FIELDS = ("python_version", "torch_version", "cuda_version", "tbpipe_version", "sources")
MODULES_SHOWN = 20


def compare(
    con: Any, request: ReportRequest, accept: AcceptList | None = None, today: dt.date | None = None
) -> RegressionReport:
    """The regression report for `request` over the database `con` (read-only is enough)."""
    started = time.monotonic()
    if (request.baseline is None) == (request.window is None):
        raise SelectionError("give a baseline: --baseline RUN or --baseline-window N (one of them)")
    if request.window is not None and request.window < 1:
        raise SelectionError(f"--baseline-window must be at least 1, not {request.window}")
    candidate = select.resolve(con, request.candidate, request, role="candidate")
    if request.window is not None:
        baseline = select.window(con, candidate, request)
    else:
        baseline = [select.resolve(con, request.baseline, request, role="baseline")]
        shared = set(baseline[0].run_ids) & set(candidate.run_ids)
        if shared:
            raise SelectionError(
                f"baseline {baseline[0].name} and candidate {candidate.name} share runs ({', '.join(sorted(shared)[:3])}): "
                "compare different runs"
            )
    sets = [*baseline, candidate]
    values = _site_values(con, sets, request)
    sites = _classify(values, sets, request)
    _attach_tracebacks(con, candidate, sites, request.tracebacks)
    expired = _apply_accepts(sites, accept, today or dt.date.today())
    sites.sort(key=_order)
    return RegressionReport(
        request, candidate, baseline, environment(con, baseline[-1], candidate), sites, expired,
        time.monotonic() - started,
    )  # fmt: skip


def _order(site: SiteChange) -> tuple:
    return (not site.flagged, site.change == UNCHANGED, -abs(site.delta), site.kind, site.name, site.site_key or "")


# ------------------------------------------------------------------------------------------ values


def _site_values(con: Any, sets: list[RunSet], request: ReportRequest) -> pa.Table:
    """One row per (set, kind, name, site): the events summed over the set's runs, and where the site is."""
    membership = pa.table(
        {
            "run_id": pa.array([r for s in sets for r in s.run_ids], pa.string()),
            "set_index": pa.array([i for i, s in enumerate(sets) for _ in s.run_ids], pa.int32()),
        }
    )
    where, params = [], []
    if request.kinds:
        where.append("list_contains(?, c.kind)")
        params.append(list(request.kinds))
    if request.per is not None:
        where.append("NOT (c.kind = ? AND c.name = ?)")
        params += list(request.per)
    con.register("report_sets", membership)
    try:
        table = query_arrow(
            con,
            f"""
            SELECT s.set_index, c.kind, c.name, c.site_key, sum(c.events)::DOUBLE AS events,
                   arg_max(c.site_function, c.events) AS site_function,
                   arg_max(c.site_portable_file, c.events) AS site_portable_file,
                   arg_max(c.site_file, c.events) AS site_file,
                   arg_max(c.site_line, c.events) AS site_line
            FROM call_sites c JOIN report_sets s USING (run_id)
            {"WHERE " + " AND ".join(where) if where else ""}
            GROUP BY s.set_index, c.kind, c.name, c.site_key
            """,
            params,
        )
        if request.per is not None:
            markers = dict(
                query_rows(
                    con,
                    """
                    SELECT s.set_index, sum(c.events)::DOUBLE FROM call_sites c JOIN report_sets s USING (run_id)
                    WHERE c.kind = ? AND c.name = ? GROUP BY s.set_index
                    """,
                    list(request.per),
                )
            )
            for index, run_set in enumerate(sets):
                run_set.markers = markers.get(index, 0.0)
                if not run_set.markers:
                    kind, name = request.per
                    raise SelectionError(
                        f"--per {kind}:{name}: {run_set.name} recorded no {kind} {name!r} events to divide by "
                        f"(record one per iteration: capture.record({kind!r}, {name!r}))"
                    )
            divisor = np.array([s.markers for s in sets])[table["set_index"].to_numpy()]
            table = table.set_column(
                table.column_names.index("events"), "events", pa.array(table["events"].to_numpy() / divisor)
            )
    finally:
        con.unregister("report_sets")
    return table


# ------------------------------------------------------------------------------------------ classification


def _classify(values: pa.Table, sets: list[RunSet], request: ReportRequest) -> list[SiteChange]:
    n_base = len(sets) - 1
    kind = values["kind"].to_pylist()
    name = values["name"].to_pylist()
    key = values["site_key"].to_pylist()
    ids: dict[tuple, int] = {}
    site_of = np.array([ids.setdefault((k, n, s), len(ids)) for k, n, s in zip(kind, name, key)], dtype=np.int64)
    set_index = values["set_index"].to_numpy()
    events = values["events"].to_numpy()
    matrix = np.zeros((len(ids), len(sets)))
    matrix[site_of, set_index] = events

    # Where each site is: in the candidate, else in the newest baseline set that has it; and its
    # line in the newest baseline set that has it (to tell a moved site).
    order = np.lexsort((set_index, site_of))  # per site, sets ascending: the last row is the newest
    last = np.ones(len(order), dtype=bool)
    last[:-1] = site_of[order][1:] != site_of[order][:-1]
    newest_row = np.full(len(ids), -1)
    newest_row[site_of[order][last]] = order[last]
    in_base = set_index < n_base
    base_order = order[in_base[order]]
    base_last = np.ones(len(base_order), dtype=bool)
    base_last[:-1] = site_of[base_order][1:] != site_of[base_order][:-1]
    base_row = np.full(len(ids), -1)
    base_row[site_of[base_order][base_last]] = base_order[base_last]

    columns = {c: values[c].to_pylist() for c in ("site_function", "site_portable_file", "site_file", "site_line")}
    base_keys = {key[i] for i in np.flatnonzero(in_base)}
    thresholds = request.thresholds
    out = []
    for (site_kind, site_name, site_key), index in ids.items():
        row = newest_row[index]
        window = matrix[index, :n_base]
        c = float(matrix[index, n_base])
        baseline_line = columns["site_line"][base_row[index]] if base_row[index] >= 0 else None
        candidate_has = matrix[index, n_base] > 0
        line = columns["site_line"][row]
        change, b, site_spread = _verdict(window, c, request)
        if change == UNCHANGED and candidate_has and base_row[index] >= 0 and baseline_line != line:
            change = MOVED
        past = abs(c - b) > thresholds.absolute
        flagged = change in REGRESSING and past
        out.append(
            SiteChange(
                kind=site_kind,
                name=site_name,
                site_key=site_key,
                site_function=columns["site_function"][row],
                site_file=columns["site_file"][row],
                site_line=line,
                site_portable_file=columns["site_portable_file"][row],
                baseline_events=b,
                candidate_events=c,
                change=change,
                baseline_line=baseline_line if baseline_line != line else None,
                site_known=change != NEW or site_key in base_keys,
                flagged=flagged,
                spread=site_spread,
            )
        )
    return out


def _verdict(window: np.ndarray, c: float, request: ReportRequest) -> tuple[str, float, Spread | None]:
    """(change, the baseline value it is measured from, the window's spread when it varied)."""
    if np.all(window == window[0]):
        # Every baseline run agrees: counts are exact, no statistics needed. A window still keeps
        # its values (a flat trend in the report).
        agreed = spread(window, request.spread) if len(window) > 1 else None
        return _exact(float(window[0]), c, request), float(window[0]), agreed
    band = spread(window, request.spread)
    if band.low <= c <= band.high:
        return UNCHANGED, band.median, band
    if c == 0:
        return REMOVED, band.median, band
    # Outside the band: a change only when it is also large enough, measured from the median.
    delta = c - band.median
    thresholds = request.thresholds
    if abs(delta) > thresholds.absolute and (band.median == 0 or abs(delta) / band.median > thresholds.relative):
        return (INCREASED if delta > 0 else DECREASED), band.median, band
    return UNCHANGED, band.median, band


def _exact(b: float, c: float, request: ReportRequest) -> str:
    if b == 0:
        return NEW if c > 0 else UNCHANGED
    if c == 0:
        return REMOVED
    delta = c - b
    thresholds = request.thresholds
    if abs(delta) > thresholds.absolute and abs(delta) / b > thresholds.relative:
        return INCREASED if delta > 0 else DECREASED
    return UNCHANGED


# ------------------------------------------------------------------------------------------ tracebacks


def _attach_tracebacks(con: Any, candidate: RunSet, sites: list[SiteChange], limit: int) -> None:
    """The heaviest stack of each of the first `limit` flagged sites, as combined frames."""
    wanted = [s for s in sites if s.flagged and s.site_key is not None][: max(limit, 0)]
    if not wanted:
        return
    keys = pa.table(
        {
            "kind": pa.array([s.kind for s in wanted], pa.string()),
            "name": pa.array([s.name for s in wanted], pa.string()),
            "site_key": pa.array([s.site_key for s in wanted], pa.string()),
        }
    )
    con.register("report_wanted", keys)
    try:
        heaviest = query_rows(
            con,
            """
            SELECT n.kind, n.name, t.site_key, arg_max(c.stack_id, c.events) AS stack_id
            FROM event_counts c
            JOIN runs r USING (run_number)
            JOIN event_names n USING (name_id)
            JOIN stack_sites ss USING (stack_id)
            JOIN sites t USING (site_id)
            SEMI JOIN report_wanted w ON w.kind = n.kind AND w.name = n.name AND w.site_key = t.site_key
            WHERE list_contains(?, r.run_id)
            GROUP BY n.kind, n.name, t.site_key
            """,
            [candidate.run_ids],
        )
    finally:
        con.unregister("report_wanted")
    stack_of = {(kind, name, key): stack for kind, name, key, stack in heaviest}
    frames = query_arrow(
        con,
        """
        SELECT stack_id, kind, function, file, line, module, inlined
        FROM stack_frames WHERE list_contains(?, stack_id) ORDER BY stack_id, depth
        """,
        [sorted(set(stack_of.values()))],
    )
    by_stack: dict[int, list[Frame]] = {}
    for row in frames.to_pylist():
        by_stack.setdefault(row.pop("stack_id"), []).append(Frame(**row))
    for site in wanted:
        stack = stack_of.get((site.kind, site.name, site.site_key))
        if stack is not None:
            site.traceback = by_stack.get(stack, [])


# ------------------------------------------------------------------------------------------ accepted changes


def _apply_accepts(sites: list[SiteChange], accept: AcceptList | None, today: dt.date) -> list[str]:
    if accept is None:
        return []
    live, expired = accept.split(today)
    for site in sites:
        if not site.flagged:
            continue
        entry = next((e for e in live if e.matches(site)), None)
        if entry is not None:
            site.flagged = False
            site.accepted = entry.describe()
    return [e.describe() for e in expired]


# ------------------------------------------------------------------------------------------ environment


def environment(con: Any, baseline: RunSet, candidate: RunSet) -> list[EnvironmentDifference]:
    """What differs between the two sides besides the code: versions, labels, the modules' builds."""
    out = []
    sides = [_environment_of(con, baseline), _environment_of(con, candidate)]
    for field in ENVIRONMENT_FIELDS:
        before, after = sides[0]["fields"].get(field), sides[1]["fields"].get(field)
        if before != after:
            out.append(EnvironmentDifference(field, before, after))
    for label in sorted(set(baseline.labels) | set(candidate.labels)):
        before, after = baseline.labels.get(label), candidate.labels.get(label)
        if before != after:
            out.append(EnvironmentDifference(f"label {label}", before, after))
    modules = []
    for module in sorted(set(sides[0]["modules"]) & set(sides[1]["modules"])):
        before, after = sides[0]["modules"][module], sides[1]["modules"][module]
        if before != after:
            modules.append(EnvironmentDifference(f"module {module}", before, after))
    out += modules[:MODULES_SHOWN]
    if len(modules) > MODULES_SHOWN:
        out.append(EnvironmentDifference(f"{len(modules) - MODULES_SHOWN} more modules rebuilt", None, None))
    return out


def _environment_of(con: Any, run_set: RunSet) -> dict[str, dict[str, str]]:
    rows = query_arrow(
        con,
        f"SELECT {', '.join(ENVIRONMENT_FIELDS)} FROM runs WHERE list_contains(?, run_id)",
        [run_set.run_ids],
    )
    fields = {}
    for field in ENVIRONMENT_FIELDS:
        if pa.types.is_list(rows[field].type):
            values = {", ".join(sorted(v or [])) for v in rows[field].to_pylist()}
        else:
            values = {v for v in rows[field].to_pylist() if v is not None}
        fields[field] = " | ".join(sorted(values)) if values else None
    modules: dict[str, str] = {}
    for name, keys in query_rows(
        con,
        """
        SELECT regexp_extract(path, '[^/]*$') AS name, list(DISTINCT module_key ORDER BY module_key)
        FROM run_modules WHERE list_contains(?, run_id) GROUP BY name
        """,
        [run_set.run_ids],
    ):
        modules[name] = ", ".join(_short_key(k) for k in keys)
    return {"fields": fields, "modules": modules}


def _short_key(key: str) -> str:
    return key if len(key) <= 16 or key.startswith(("path:", "invalid:")) else key[:12] + "…"
