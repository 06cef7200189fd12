"""The report's second metric: GPU time per (activity kind, name, launch site).

Counts are exact; durations are noisy, so GPU time is never compared exactly. Against a window of
earlier runs (two or more), a site's summed GPU time is unusual only outside the window's band
(`stats.band_edges`, as for counts that vary) and past the GPU thresholds measured from the window's
median. Against a single baseline there is no night-to-night spread to measure: a site is slower
when its summed time grew past the thresholds and either it ran more often (counts are exact) or
its mean per-execution duration moved by more than `spread` standard errors of the two runs' own
durations (`stats.welch_z`). Sites new on either side are new or removed. Everything is column-wise,
as in `compute`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.reports.regression.model import (
    DECREASED,
    INCREASED,
    NEW,
    REMOVED,
    UNCHANGED,
    Frame,
    GpuSiteChange,
    ReportRequest,
    RunSet,
    Spread,
)
from tbpipe.pipeline.reports.regression.stats import band_edges, bands, mean_and_variance, welch_z

_CODES = (UNCHANGED, NEW, REMOVED, INCREASED, DECREASED)
_UNCHANGED, _NEW, _REMOVED, _INCREASED, _DECREASED = range(len(_CODES))


def has_gpu_time(con: Any) -> bool:
    """Whether the database holds GPU time at all (a database of an older schema has no table for it)."""
    found = query_rows(con, "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'gpu_time_counts'")
    return bool(found and found[0][0]) and bool(query_rows(con, "SELECT 1 FROM gpu_time_counts LIMIT 1"))


def gpu_site_values(con: Any, sets: list[RunSet], request: ReportRequest) -> pa.Table:
    """One row per (set, activity kind, name, launch site): GPU time, executions, timed executions and
    the sum of squared durations, summed over the set's runs, and where the site is."""
    membership = pa.table(
        {
            "run_id": pa.array([r for s in sets for r in s.run_ids], pa.string()),
            "set_index": pa.array([i for i, s in enumerate(sets) for _ in s.run_ids], pa.int32()),
        }
    )
    where, params = ["g.kind <> 'sync'"], []
    if request.kinds:
        where.append("list_contains(?, n.kind)")
        params.append(list(request.kinds))
    con.register("report_gpu_sets", membership)
    try:
        return query_arrow(
            con,
            f"""
            SELECT s.set_index, g.kind, g.name, t.site_key,
                   sum(g.gpu_time_ns)::DOUBLE AS gpu_time_ns, sum(g.executions)::DOUBLE AS executions,
                   sum(g.timed)::DOUBLE AS timed, sum(g.gpu_time_sq_us)::DOUBLE AS gpu_time_sq_us,
                   any_value(t.function) AS site_function, any_value(t.portable_file) AS site_portable_file,
                   arg_max(ss.site_file, g.gpu_time_ns) AS site_file, arg_max(ss.site_line, g.gpu_time_ns) AS site_line,
                   arg_max(n.kind, g.gpu_time_ns) AS launch_kind
            FROM gpu_time_counts g
            JOIN runs r USING (run_number)
            JOIN report_gpu_sets s ON s.run_id = r.run_id
            LEFT JOIN event_names n ON n.name_id = g.name_id
            LEFT JOIN stack_sites ss ON ss.stack_id = g.stack_id
            LEFT JOIN sites t ON t.site_id = ss.site_id
            WHERE {" AND ".join(where)}
            GROUP BY s.set_index, g.kind, g.name, t.site_key
            """,
            params,
        )
    finally:
        con.unregister("report_gpu_sets")


def compare_gpu_time(con: Any, sets: list[RunSet], request: ReportRequest) -> list[GpuSiteChange]:
    """GPU time per site of the candidate (the last set) against the others; [] without GPU time."""
    if not has_gpu_time(con):
        return []
    values = gpu_site_values(con, sets, request)
    if values.num_rows == 0:
        return []
    n_base = len(sets) - 1
    joined = pc.binary_join_element_wise(
        values["kind"], values["name"], pc.fill_null(values["site_key"], "\x00"), "\x1f"
    )
    encoded = pc.dictionary_encode(joined).combine_chunks()
    site_of = encoded.indices.to_numpy().astype(np.int64)
    sites = len(encoded.dictionary)
    set_index = values["set_index"].to_numpy()

    def matrix(column: str) -> np.ndarray:
        out = np.zeros((sites, len(sets)))
        out[site_of, set_index] = values[column].to_numpy()
        return out

    time, executions, timed, sum_sq_us = (matrix(c) for c in ("gpu_time_ns", "executions", "timed", "gpu_time_sq_us"))
    # With --per, totals are per marker event; means and spreads stay per execution.
    divisor = np.array([s.markers or 1.0 for s in sets]) if request.per is not None else np.ones(len(sets))
    total, runs_of = time / divisor, executions / divisor

    # Per-execution durations of the whole baseline side, and of the candidate.
    base_timed = timed[:, :n_base].sum(axis=1)
    mean_b, var_b = mean_and_variance(time[:, :n_base].sum(axis=1), base_timed, sum_sq_us[:, :n_base].sum(axis=1) * 1e6)
    mean_c, var_c = mean_and_variance(time[:, n_base], timed[:, n_base], sum_sq_us[:, n_base] * 1e6)
    window, candidate = total[:, :n_base], total[:, n_base]
    change, baseline, z = _verdicts(
        window,
        candidate,
        runs_of[:, :n_base],
        runs_of[:, n_base],
        mean_b,
        var_b,
        base_timed,
        mean_c,
        var_c,
        timed[:, n_base],
        request,
    )
    thresholds = request.gpu_thresholds
    flagged = np.isin(change, (_NEW, _INCREASED)) & (np.abs(candidate - baseline) > thresholds.absolute)
    spreads: list[Spread | None] = bands(window, request.spread) if n_base > 1 else [None] * sites

    # Where each site is: the row of the newest set that has it.
    order = np.lexsort((set_index, site_of))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = site_of[order][1:] != site_of[order][:-1]
    newest = np.empty(sites, dtype=np.int64)
    newest[site_of[order][last]] = order[last]
    names = ("kind", "name", "site_key", "site_function", "site_file", "site_line", "site_portable_file", "launch_kind")
    columns = {c: values[c].to_pylist() for c in names}
    out = []
    for index in range(sites):
        row = int(newest[index])
        out.append(
            GpuSiteChange(
                kind=columns["kind"][row],
                name=columns["name"][row],
                site_key=columns["site_key"][row],
                site_function=columns["site_function"][row],
                site_file=columns["site_file"][row],
                site_line=columns["site_line"][row],
                site_portable_file=columns["site_portable_file"][row],
                launch_kind=columns["launch_kind"][row],
                baseline_ns=float(baseline[index]),
                candidate_ns=float(candidate[index]),
                baseline_executions=float(np.median(runs_of[index, :n_base]) if n_base > 1 else runs_of[index, 0]),
                candidate_executions=float(runs_of[index, n_base]),
                baseline_mean_ns=None if np.isnan(mean_b[index]) else float(mean_b[index]),
                candidate_mean_ns=None if np.isnan(mean_c[index]) else float(mean_c[index]),
                change=_CODES[change[index]],
                z=None if n_base > 1 or np.isnan(z[index]) else float(z[index]),
                flagged=bool(flagged[index]),
                spread=spreads[index],
            )
        )
    out.sort(key=lambda s: (not s.flagged, s.change == UNCHANGED, -abs(s.delta), s.kind, s.name, s.site_key or ""))
    return out


def _verdicts(
    window: np.ndarray,
    c: np.ndarray,
    window_runs: np.ndarray,
    c_runs: np.ndarray,
    mean_b: np.ndarray,
    var_b: np.ndarray,
    n_b: np.ndarray,
    mean_c: np.ndarray,
    var_c: np.ndarray,
    n_c: np.ndarray,
    request: ReportRequest,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(change code, the baseline value it is measured from, Welch's z) per site."""
    thresholds = request.gpu_thresholds
    k = request.spread
    windowed = window.shape[1] > 1
    if windowed:
        baseline = np.median(window, axis=1)
        low, high, _robust = band_edges(window, baseline, k)
        z = np.full(len(c), np.nan)
        unusual = (c < low) | (c > high)
        absent = window.max(axis=1) == 0  # no night of the window had it
    else:
        baseline = window[:, 0]
        z = welch_z(mean_b, var_b, n_b, mean_c, var_c, n_c)
        # More (or fewer) executions explain a change of time for sure; else the durations must have
        # moved past their own spread. Without durations on both sides (z NaN) only the count tells.
        unusual = np.where(
            c > baseline, (c_runs > window_runs[:, 0]) | (z > k), (c_runs < window_runs[:, 0]) | (z < -k)
        )
        absent = baseline == 0
    delta = c - baseline
    past = (np.abs(delta) > thresholds.absolute) & (
        np.abs(delta) > thresholds.relative * np.where(baseline == 0, 1, baseline)
    )
    moved = np.where(
        past & unusual, np.where(c == 0, _REMOVED, np.where(delta > 0, _INCREASED, _DECREASED)), _UNCHANGED
    )
    change = np.where(absent, np.where(c > 0, _NEW, _UNCHANGED), moved)
    return change, baseline, z


def attach_gpu_tracebacks(con: Any, candidate: RunSet, sites: list[GpuSiteChange], limit: int, frames_of) -> None:
    """The stack with the most GPU time of each of the first `limit` flagged sites, as combined frames
    (`frames_of(stack_ids) -> {stack_id: [Frame]}`)."""
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
    con.register("report_gpu_wanted", keys)
    try:
        heaviest = query_rows(
            con,
            """
            SELECT g.kind, g.name, t.site_key, arg_max(g.stack_id, g.gpu_time_ns) AS stack_id
            FROM gpu_time_counts g
            JOIN runs r USING (run_number)
            JOIN stack_sites ss ON ss.stack_id = g.stack_id
            JOIN sites t ON t.site_id = ss.site_id
            SEMI JOIN report_gpu_wanted w ON w.kind = g.kind AND w.name = g.name AND w.site_key = t.site_key
            WHERE list_contains(?, r.run_id)
            GROUP BY g.kind, g.name, t.site_key
            """,
            [candidate.run_ids],
        )
    finally:
        con.unregister("report_gpu_wanted")
    stack_of = {(kind, name, key): stack for kind, name, key, stack in heaviest}
    by_stack: dict[int, list[Frame]] = frames_of(sorted(set(stack_of.values())))
    for site in wanted:
        stack = stack_of.get((site.kind, site.name, site.site_key))
        if stack is not None:
            site.traceback = by_stack.get(stack, [])
