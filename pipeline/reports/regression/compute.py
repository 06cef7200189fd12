"""The comparison: per (kind, name, call site), the candidate's events against the baseline's.

Two tiers. Against one baseline (a run or a group), counts are exact: any change past both
thresholds is one. Against a window of earlier runs, a site whose count every window run agrees on
is compared the same exact way; a site whose count varies is flagged only when the candidate leaves
the window's band (`stats.spread`) and also passes the thresholds measured from the window's
median, so data-dependent sites do not alarm. Everything is computed column-wise: DuckDB sums every
(set, site) value, numpy classifies all sites at once.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db import read
from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.progress import StepProgress
from tbpipe.pipeline.reports.regression import select
from tbpipe.pipeline.reports.regression.accept import AcceptList
from tbpipe.pipeline.reports.regression.gpu_time import attach_gpu_tracebacks, compare_gpu_time
from tbpipe.pipeline.reports.regression.model import (
    DECREASED,
    INCREASED,
    MOVED,
    NEW,
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
from tbpipe.pipeline.reports.regression.stats import band_edges, bands
from tbpipe.pipeline.reports.regression.suspects import attach_suspects

ENVIRONMENT_FIELDS = ("python_version", "torch_version", "cuda_version", "tbpipe_version", "sources")
MODULES_SHOWN = 20


def compare(
    con: Any,
    request: ReportRequest,
    accept: AcceptList | None = None,
    today: dt.date | None = None,
    progress: bool | None = False,
) -> RegressionReport:
    """The regression report for `request` over the database `con` (read-only is enough); `progress`:
    a bar over its steps on stderr (None: on a terminal, `progress.on_terminal`)."""
    with StepProgress("report", 4 + request.suspects, progress) as bar:
        return _compare(con, request, accept, today, bar)


def _compare(
    con: Any, request: ReportRequest, accept: AcceptList | None, today: dt.date | None, bar: StepProgress
) -> RegressionReport:
    started = time.monotonic()
    bar.describe("choosing the runs")
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
    if request.site_of not in _COUNTS:
        raise SelectionError(f"site_of is {' or '.join(map(repr, _COUNTS))}, not {request.site_of!r}")
    runs = sum(len(s.run_ids) for s in sets)
    bar.step(f"counting events per site in {runs:,} run{'s' if runs != 1 else ''}")
    values = _site_values(con, sets, request)
    sites = _classify(values, sets, request)
    bar.step("tracebacks of the flagged sites")
    _attach_tracebacks(con, candidate, sites, request)
    expired = _apply_accepts(sites, accept, today or dt.date.today())
    sites.sort(key=_order)
    # The second metric, GPU time per site: its own verdict, nothing above depends on it.
    bar.step("GPU time per site")
    gpu_sites = compare_gpu_time(con, sets, request)
    attach_gpu_tracebacks(con, candidate, gpu_sites, request.tracebacks, lambda ids: _frames_of(con, ids))
    _apply_accepts(gpu_sites, accept, today or dt.date.today())
    report = RegressionReport(
        request, candidate, baseline, environment(con, baseline[-1], candidate), sites, expired, 0.0, gpu_sites
    )
    report.focus_rules = read.focus_rules(con)
    if request.suspects:
        bar.step("suspects: the commits between the two sides")
        attach_suspects(con, report, request.repo, event_counts=_COUNTS[request.site_of][0])
    report.seconds = time.monotonic() - started
    return report


def _order(site: SiteChange) -> tuple:
    return (not site.flagged, site.change == UNCHANGED, -abs(site.delta), site.kind, site.name, site.site_key or "")


# ------------------------------------------------------------------------------------------ values


# What the counts are read from, by `ReportRequest.site_of`: (events per stack, events per site), of
# every run alike, rolled up or not (sql/counts.sql).
_COUNTS = {
    "own": ("run_stack_counts", "run_site_counts"),
    "forward": ("event_counts_at_forward", "site_counts_at_forward"),
}
# Where a site was, among several runs' rows: the one with the most events, among equals the one whose
# (file, line) hashes highest, so that the choice depends on the rows and not on the order they come in
# (as an integer: ordering structs doubled the cost of a year's window).
_PLACE = "(p.events::HUGEINT * 4294967296 + hash(p.site_file, p.site_line) % 4294967296)"


def _run_numbers(con: Any, run_ids: list[str]) -> str:
    """`run_number IN (...)`'s list for these runs, as literals: a constant filter reaches the count
    tables' scans through the views (a join on the runs would count every rolled-up run first)."""
    rows = query_rows(con, "SELECT run_number FROM runs WHERE list_contains(?, run_id)", [run_ids])
    return ", ".join(str(int(row[0])) for row in rows) or "NULL"


def _site_values(con: Any, sets: list[RunSet], request: ReportRequest) -> pa.Table:
    """One row per (set, kind, name, site): the events summed over the set's runs, and where the site is."""
    membership = pa.table(
        {
            "run_id": pa.array([r for s in sets for r in s.run_ids], pa.string()),
            "set_index": pa.array([i for i, s in enumerate(sets) for _ in s.run_ids], pa.int32()),
        }
    )
    where, params = ["true"], []
    if request.kinds:
        where.append("list_contains(?, kind)")
        params.append(list(request.kinds))
    if request.per is not None:
        where.append("NOT (kind = ? AND name = ?)")
        params += list(request.per)
    numbers = _run_numbers(con, membership["run_id"].to_pylist())
    counts = _COUNTS[request.site_of][1]
    # The rows of the window's runs on integer keys (a site key's sites stand for its first one).
    rows = f"""
        {counts} p
        JOIN (SELECT r.run_number, s.set_index FROM runs r JOIN report_sets s USING (run_id)) m USING (run_number)
        LEFT JOIN (SELECT site_id, min(site_id) OVER (PARTITION BY site_key) AS site FROM sites) k USING (site_id)"""
    named = f"p.name_id IN (SELECT name_id FROM event_names WHERE {' AND '.join(where)})"
    con.register("report_sets", membership)
    try:
        # `run_site_counts` holds each run's events per name and site: sum them over each set's runs,
        # on integer keys, and name the sums after: a window's millions of rows grouped by strings
        # cost twice as much.
        summed = query_arrow(
            con,
            f"""
            WITH summed AS (
                SELECT m.set_index, p.name_id, k.site, sum(p.events)::DOUBLE AS events
                FROM {rows}
                WHERE p.run_number IN ({numbers}) AND {named}
                GROUP BY m.set_index, p.name_id, k.site
            )
            SELECT v.set_index, v.name_id, v.site, c.kind, c.name, t.site_key, v.events,
                   t.function AS site_function, t.portable_file AS site_portable_file
            FROM summed v
            JOIN event_names c USING (name_id)
            LEFT JOIN sites t ON t.site_id = v.site
            """,
            params,
        )
        table = _with_places(summed, _places(con, summed, sets, rows, named, params))
        if request.per is not None:
            markers = dict(
                query_rows(
                    con,
                    f"""
                    SELECT s.set_index, sum(c.events)::DOUBLE
                    FROM run_name_counts c
                    JOIN event_names n USING (name_id)
                    JOIN runs r USING (run_number)
                    JOIN report_sets s ON s.run_id = r.run_id
                    WHERE c.run_number IN ({numbers}) AND n.kind = ? AND n.name = ?
                    GROUP BY s.set_index
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


def _places(con: Any, summed: pa.Table, sets: list[RunSet], rows: str, named: str, params: list) -> pa.Table:
    """Where each site was (`_PLACE`'s file and line) in the only sets the report shows it from: the
    candidate and the newest baseline set that has it. Choosing it in every set of a year's window
    cost more than the sums; most sites need the last two sets' runs only, the rest a few others'."""
    candidate = len(sets) - 1
    base = summed.filter(pc.less(summed["set_index"], candidate))
    newest = base.group_by(["name_id", "site"], use_threads=False).aggregate([("set_index", "max")])
    columns = ["set_index", "name_id", "site"]
    needed = pa.concat_tables(
        [
            newest.rename_columns(["name_id", "site", "set_index"]).select(columns),
            summed.filter(pc.equal(summed["set_index"], candidate)).select(columns),
        ]
    )
    recent = pc.greater_equal(needed["set_index"], candidate - 1)
    out = []
    # Apart, so that the few sites gone before the last baseline set read only their own rows.
    for part, only_sites in ((needed.filter(recent), False), (needed.filter(pc.invert(recent)), True)):
        if not part.num_rows:
            continue
        run_ids = [r for i in pc.unique(part["set_index"]).to_pylist() for r in sets[i].run_ids]
        where = f"p.run_number IN ({_run_numbers(con, run_ids)}) AND {named}"
        if only_sites:
            where += f" AND {_site_ids(con, part['site'].to_pylist())}"
        con.register("report_needed", part)
        try:
            out.append(
                query_arrow(
                    con,
                    f"""
                    SELECT m.set_index, p.name_id, k.site,
                           arg_max(p.site_file, {_PLACE}) AS site_file, arg_max(p.site_line, {_PLACE}) AS site_line
                    FROM {rows}
                    SEMI JOIN report_needed n
                        ON n.set_index = m.set_index AND n.name_id = p.name_id AND n.site IS NOT DISTINCT FROM k.site
                    WHERE {where}
                    GROUP BY m.set_index, p.name_id, k.site
                    """,
                    params,
                )
            )
        finally:
            con.unregister("report_needed")
    return pa.concat_tables(out) if out else pa.table({"site_file": pa.array([], pa.string())})


def _with_places(summed: pa.Table, places: pa.Table) -> pa.Table:
    """`summed` with each row's file and line from `places` (null where not chosen), matched on
    (set, name, site) with no site a key of its own; only the keys go through the join."""
    keys = ["set_index", "name_id", "site"]
    if not places.num_rows:
        return summed.append_column("site_file", pa.nulls(summed.num_rows, pa.string())).append_column(
            "site_line", pa.nulls(summed.num_rows, pa.int32())
        )

    def keyed(table: pa.Table, index: str) -> pa.Table:
        columns = [table[k] for k in keys[:2]] + [pc.fill_null(table["site"], -1)]
        return pa.table([*columns, pa.array(np.arange(table.num_rows))], names=[*keys, index])

    pairs = keyed(summed, "row").join(keyed(places, "place"), keys, join_type="inner", use_threads=False)
    at = np.full(summed.num_rows, -1)
    at[pairs["row"].to_numpy()] = pairs["place"].to_numpy()
    indices = pa.array(at, mask=at < 0)
    return summed.append_column("site_file", places["site_file"].take(indices)).append_column(
        "site_line", places["site_line"].take(indices)
    )


def _site_ids(con: Any, sites: list[int | None]) -> str:
    """A filter on `p.site_id` for these sites (a site stands for every site of its key), as literals:
    a constant list reaches the count tables' scans."""
    known = [int(s) for s in sites if s is not None]
    rows = query_rows(
        con,
        "SELECT site_id FROM sites WHERE site_key IN (SELECT site_key FROM sites WHERE list_contains(?, site_id))",
        [known],
    )
    listed = f"p.site_id IN ({', '.join(str(int(r[0])) for r in rows) or 'NULL'})"
    return f"({listed} OR p.site_id IS NULL)" if len(known) < len(sites) else listed


# ------------------------------------------------------------------------------------------ classification


_CODES = (UNCHANGED, NEW, REMOVED, INCREASED, DECREASED, MOVED)
_UNCHANGED, _NEW, _REMOVED, _INCREASED, _DECREASED, _MOVED = range(len(_CODES))


def _classify(values: pa.Table, sets: list[RunSet], request: ReportRequest) -> list[SiteChange]:
    n_base = len(sets) - 1
    # One id per (kind, name, site key), found column-wise: rows of one site share a joined text.
    joined = pc.binary_join_element_wise(
        values["kind"], values["name"], pc.fill_null(values["site_key"], "\x00"), "\x1f"
    )
    encoded = pc.dictionary_encode(joined).combine_chunks()
    site_of = encoded.indices.to_numpy().astype(np.int64)
    first_rows = np.full(len(encoded.dictionary), len(site_of), dtype=np.int64)
    np.minimum.at(first_rows, site_of, np.arange(len(site_of)))
    kind = values["kind"].take(pa.array(first_rows)).to_pylist()
    name = values["name"].take(pa.array(first_rows)).to_pylist()
    key = values["site_key"].take(pa.array(first_rows)).to_pylist()
    ids = {(k, n, s): i for i, (k, n, s) in enumerate(zip(kind, name, key))}
    set_index = values["set_index"].to_numpy()
    matrix = np.zeros((len(ids), len(sets)))
    matrix[site_of, set_index] = values["events"].to_numpy()
    window, candidate = matrix[:, :n_base], matrix[:, n_base]

    # Where each site is: in the candidate, else in the newest baseline set that has it; and its
    # line in the newest baseline set that has it (to tell a moved site).
    row_at = np.full((len(ids), len(sets)), -1)  # each (site, set)'s row: a site has one row per set
    row_at[site_of, set_index] = np.arange(len(site_of))
    newest_row, base_row = _newest_row(row_at, len(sets)), _newest_row(row_at, n_base)
    in_base = set_index < n_base

    change, baseline = _verdicts(window, candidate, request)
    lines = pc.fill_null(values["site_line"], -1).to_numpy().astype(np.int64)
    line = lines[newest_row]
    baseline_line = np.where(base_row >= 0, lines[np.maximum(base_row, 0)], -1)
    moved = (change == _UNCHANGED) & (candidate > 0) & (base_row >= 0) & (baseline_line != line)
    change = np.where(moved, _MOVED, change)
    moved_from = (base_row >= 0) & (baseline_line >= 0) & (baseline_line != line)
    flagged = np.isin(change, (_NEW, _INCREASED)) & (np.abs(candidate - baseline) > request.thresholds.absolute)

    spreads: list[Spread | None] = [None] * len(ids)
    if n_base > 1:
        spreads = bands(window, request.spread)
    # Only the rows the sites are shown from become Python objects (a year's window has ~30 rows a site).
    names = ("site_function", "site_portable_file", "site_file")
    shown = values.select(list(names)).take(pa.array(newest_row))
    columns = {c: shown[c].to_pylist() for c in names}
    base_keys = set(pc.unique(values["site_key"].filter(pa.array(in_base))).to_pylist())
    out = []
    for (site_kind, site_name, site_key), index in ids.items():
        site_change = _CODES[change[index]]
        site_line = int(line[index]) if line[index] >= 0 else None
        out.append(
            SiteChange(
                kind=site_kind,
                name=site_name,
                site_key=site_key,
                site_function=columns["site_function"][index],
                site_file=columns["site_file"][index],
                site_line=site_line,
                site_portable_file=columns["site_portable_file"][index],
                baseline_events=float(baseline[index]),
                candidate_events=float(candidate[index]),
                change=site_change,
                baseline_line=int(baseline_line[index]) if moved_from[index] else None,
                site_known=site_change != NEW or site_key in base_keys,
                flagged=bool(flagged[index]),
                spread=spreads[index],
            )
        )
    return out


def _newest_row(row_at: np.ndarray, sets: int) -> np.ndarray:
    """Per site (a row of `row_at`: its row per set, -1 for none), its row in the highest of the first
    `sets` sets that has one (-1 where none has)."""
    present = row_at[:, :sets] >= 0
    if not sets:
        return np.full(len(row_at), -1)
    highest = sets - 1 - np.argmax(present[:, ::-1], axis=1)
    return np.where(present.any(axis=1), row_at[np.arange(len(row_at)), highest], -1)


def _verdicts(window: np.ndarray, c: np.ndarray, request: ReportRequest) -> tuple[np.ndarray, np.ndarray]:
    """(change code, the baseline value it is measured from) per site, all sites at once.

    Where every baseline run agrees, the exact tier; else the band tier: unchanged inside the
    window's band, and outside it a change only when also past the thresholds from the median.
    """
    first = window[:, 0]
    agree = np.all(window == first[:, None], axis=1)
    exact = _exact_changes(first, c, request)
    median = np.median(window, axis=1)
    low, high, _robust = band_edges(window, median, request.spread)
    delta = c - median
    thresholds = request.thresholds
    gate = (np.abs(delta) > thresholds.absolute) & (
        (median == 0) | (np.abs(delta) > thresholds.relative * np.where(median == 0, 1, median))
    )
    outside = np.where(c == 0, _REMOVED, np.where(gate, np.where(delta > 0, _INCREASED, _DECREASED), _UNCHANGED))
    banded = np.where((low <= c) & (c <= high), _UNCHANGED, outside)
    return np.where(agree, exact, banded), np.where(agree, first, median)


def _exact_changes(b: np.ndarray, c: np.ndarray, request: ReportRequest) -> np.ndarray:
    delta = c - b
    thresholds = request.thresholds
    past = (np.abs(delta) > thresholds.absolute) & (np.abs(delta) > thresholds.relative * np.where(b == 0, 1, b))
    changed = np.where(past, np.where(delta > 0, _INCREASED, _DECREASED), _UNCHANGED)
    return np.where(b == 0, np.where(c > 0, _NEW, _UNCHANGED), np.where(c == 0, _REMOVED, changed))


# ------------------------------------------------------------------------------------------ tracebacks


def _attach_tracebacks(con: Any, candidate: RunSet, sites: list[SiteChange], request: ReportRequest) -> None:
    """The heaviest stack of each of the first `request.tracebacks` flagged sites (in the report's
    order, which does not depend on the order DuckDB returned the rows in), as combined frames."""
    flagged = [s for s in sorted(sites, key=_order) if s.flagged and s.site_key is not None]
    wanted = flagged[: max(request.tracebacks, 0)]
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
            f"""
            SELECT n.kind, n.name, t.site_key,
                   arg_max(c.stack_id, struct_pack(n := c.events, s := -c.stack_id)) AS stack_id
            FROM {_COUNTS[request.site_of][0]} c
            JOIN event_names n USING (name_id)
            JOIN stack_sites ss USING (stack_id)
            JOIN sites t USING (site_id)
            SEMI JOIN report_wanted w ON w.kind = n.kind AND w.name = n.name AND w.site_key = t.site_key
            WHERE c.run_number IN ({_run_numbers(con, candidate.run_ids)})
            GROUP BY n.kind, n.name, t.site_key
            """,
        )
    finally:
        con.unregister("report_wanted")
    stack_of = {(kind, name, key): stack for kind, name, key, stack in heaviest}
    by_stack = _frames_of(con, sorted(set(stack_of.values())))
    for site in wanted:
        stack = stack_of.get((site.kind, site.name, site.site_key))
        if stack is not None:
            site.traceback = by_stack.get(stack, [])


def _frames_of(con: Any, stack_ids: list[int]) -> dict[int, list[Frame]]:
    """The combined frames of each stack, innermost first."""
    frames = query_arrow(
        con,
        """
        SELECT stack_id, kind, function, file, line, module, inlined,
               kind <> 'marker' AND coalesce(is_generated_path(CASE WHEN kind = 'python' THEN file ELSE module END), false)
                   AS generated
        FROM stack_frames WHERE list_contains(?, stack_id) ORDER BY stack_id, depth
        """,
        [stack_ids],
    )
    by_stack: dict[int, list[Frame]] = {}
    for row in frames.to_pylist():
        by_stack.setdefault(row.pop("stack_id"), []).append(Frame(**row))
    return by_stack


# ------------------------------------------------------------------------------------------ accepted changes


def _apply_accepts(sites: list, accept: AcceptList | None, today: dt.date) -> list[str]:
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
