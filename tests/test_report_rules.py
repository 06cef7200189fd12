"""The regression report's rules, stated exactly: the band of a window (hand-computed and against a
plain-Python reference), the verdict at each of its edges and at the thresholds' edges, for counts
and GPU time, and the per-execution statistics (mean, variance, Welch's z)."""

from __future__ import annotations

import datetime as dt
import math
import shutil
import statistics
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.reports.regression import compute, gpu_time, stats
from tbpipe.pipeline.reports.regression.accept import load_accept_file
from tbpipe.pipeline.reports.regression.compute import compare
from tbpipe.pipeline.reports.regression.model import RegressionReport, ReportRequest, RunSet, SiteChange, Thresholds
from tbpipe.pipeline.reports.regression.select import SelectionError

# ------------------------------------------------------------------------------------------ the band


def reference_band(values: list[float], k: float) -> tuple[float, float, str]:
    """The band's definition in plain Python: min..max for few runs or a MAD of 0, else median +- k sigma."""
    median = statistics.median(values)
    mad = statistics.median([abs(v - median) for v in values])
    if len(values) >= 5 and mad > 0:
        return median - k * 1.4826 * mad, median + k * 1.4826 * mad, "median-mad"
    return min(values), max(values), "min-max"


def test_a_robust_band_by_hand() -> None:
    # Median 12, absolute deviations 2 0 1 1 88: MAD 1, so one odd night (100) does not widen it.
    (spread,) = stats.bands(np.array([[10.0, 12, 11, 13, 100]]), 3.0)
    assert (spread.median, spread.mad, spread.method) == (12.0, 1.0, "median-mad")
    assert spread.low == pytest.approx(12 - 4.4478) and spread.high == pytest.approx(12 + 4.4478)
    assert spread.values == [10.0, 12, 11, 13, 100]


def test_four_nights_are_too_few_for_the_median_band() -> None:
    (spread,) = stats.bands(np.array([[10.0, 12, 11, 13]]), 3.0)
    assert (spread.low, spread.high, spread.method, spread.median, spread.mad) == (10, 13, "min-max", 11.5, 1.0)


def test_a_mad_of_zero_falls_back_to_the_range() -> None:
    (spread,) = stats.bands(np.array([[5.0, 5, 5, 5, 9]]), 3.0)
    assert (spread.low, spread.high, spread.method, spread.mad) == (5, 9, "min-max", 0)


def test_each_row_has_its_own_band() -> None:
    window = np.array([[1.0, 2, 3, 4, 5], [7.0, 7, 7, 7, 7], [1.0, 1, 2, 2, 90]])
    low, high, robust = stats.band_edges(window, np.median(window, axis=1), 2.0)
    assert robust.tolist() == [True, False, True]
    assert low.tolist() == pytest.approx([3 - 2 * 1.4826, 7, 2 - 2 * 1.4826])
    assert high.tolist() == pytest.approx([3 + 2 * 1.4826, 7, 2 + 2 * 1.4826])


values_lists = st.lists(st.integers(0, 1000).map(float), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(values_lists, min_size=1, max_size=4), st.sampled_from([0.5, 1.0, 3.0]))
def test_the_band_equals_its_reference(rows: list[list[float]], k: float) -> None:
    width = len(rows[0])
    rows = [(row * width)[:width] for row in rows]
    for row, spread in zip(rows, stats.bands(np.array(rows), k)):
        low, high, method = reference_band(row, k)
        assert (spread.low, spread.high, spread.method) == (pytest.approx(low), pytest.approx(high), method)
        assert spread.median == statistics.median(row)


# ------------------------------------------------------------------------------------------ statistics


@pytest.mark.filterwarnings("error")  # no division warnings on a report's stderr
def test_mean_and_variance_by_hand() -> None:
    # Values 2, 4, 9: sum 15, squares 101; mean 5, sample variance (101 - 75) / 2 = 13. One value: no
    # variance; none: no mean; rounding below 0 is 0.
    mean, variance = stats.mean_and_variance(
        np.array([15.0, 7.0, 0.0, 3.0]), np.array([3.0, 1.0, 0.0, 3.0]), np.array([101.0, 49.0, 0.0, 2.9])
    )
    assert mean[0] == 5 and variance[0] == 13
    assert mean[1] == 7 and math.isnan(variance[1])
    assert math.isnan(mean[2]) and math.isnan(variance[2])
    assert mean[3] == 1 and variance[3] == 0


@pytest.mark.filterwarnings("error")
def test_welch_z_by_hand() -> None:
    # Standard error sqrt(4/4 + 9/9) = sqrt(2): a mean moved by 3 is 3/sqrt(2) errors, the sign b - a.
    z = stats.welch_z(
        np.array([10.0, 13, 10, 5, 5, 5]),
        np.array([4.0, 9, 4, 0, 0, 0]),
        np.array([4.0, 9, 1, 3, 3, 3]),
        np.array([13.0, 10, 13, 5, 6, 4]),
        np.array([9.0, 4, 9, 0, 0, 0]),
        np.array([9.0, 4, 9, 3, 3, 3]),
    )
    assert z[0] == pytest.approx(3 / math.sqrt(2)) and z[1] == pytest.approx(-3 / math.sqrt(2))
    assert math.isnan(z[2])  # one value on a side: no spread to measure against
    assert z[3] == 0 and z[4] == math.inf and z[5] == -math.inf


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 10_000).map(float), min_size=2, max_size=20),
    st.lists(st.integers(1, 10_000).map(float), min_size=2, max_size=20),
)
def test_mean_variance_and_welch_z_equal_their_reference(a: list[float], b: list[float]) -> None:
    def summed(values):
        return np.array([sum(values)]), np.array([float(len(values))]), np.array([sum(v * v for v in values)])

    mean_a, var_a = stats.mean_and_variance(*summed(a))
    mean_b, var_b = stats.mean_and_variance(*summed(b))
    assert mean_a[0] == pytest.approx(statistics.mean(a)) and mean_b[0] == pytest.approx(statistics.mean(b))
    assert var_a[0] == pytest.approx(statistics.variance(a), rel=1e-6, abs=1e-3)
    z = stats.welch_z(mean_a, var_a, np.array([len(a)]), mean_b, var_b, np.array([len(b)]))[0]
    error = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    if error > 1e-3:
        assert z == pytest.approx((statistics.mean(b) - statistics.mean(a)) / error, rel=1e-4, abs=1e-6)


# ------------------------------------------------------------------------------------------ count verdicts


def request(relative: float = 0.0, absolute: float = 0.0, spread: float = 3.0, **gpu) -> ReportRequest:
    return ReportRequest(
        "candidate",
        baseline="baseline",
        thresholds=Thresholds(relative, absolute),
        spread=spread,
        gpu_thresholds=Thresholds(gpu.get("gpu_relative", 0.0), gpu.get("gpu_absolute", 0.0)),
    )


def count_verdicts(window: list[float], candidates: list[float], **thresholds) -> list[str]:
    """The verdict of each candidate value against the same window."""
    codes, _ = compute._verdicts(
        np.array([window] * len(candidates), dtype=float), np.array(candidates, dtype=float), request(**thresholds)
    )
    return [compute._CODES[c] for c in codes]


def test_one_baseline_is_exact_and_thresholds_are_strict() -> None:
    assert count_verdicts([10], [10, 11, 9, 0]) == ["unchanged", "increased", "decreased", "removed"]
    assert count_verdicts([0], [0, 1]) == ["unchanged", "new"]
    # relative 0.5 of 10 is 5: a change of exactly 5 is not past it.
    assert count_verdicts([10], [15, 16, 5, 4], relative=0.5) == ["unchanged", "increased", "unchanged", "decreased"]
    assert count_verdicts([10], [13, 14, 7, 6], absolute=3) == ["unchanged", "increased", "unchanged", "decreased"]
    # Both must be passed: 14 is past 3 events but not past 50%.
    assert count_verdicts([10], [14, 16], relative=0.5, absolute=3) == ["unchanged", "increased"]
    # New and removed do not depend on the thresholds.
    assert count_verdicts([0], [1], relative=5, absolute=5) == ["new"]
    assert count_verdicts([10], [0], relative=5, absolute=50) == ["removed"]


def test_a_window_that_agrees_is_exact() -> None:
    assert count_verdicts([10, 10, 10], [10, 11, 9]) == ["unchanged", "increased", "decreased"]
    codes, baseline = compute._verdicts(np.array([[4.0, 4.0]]), np.array([9.0]), request())
    assert baseline.tolist() == [4.0]


def test_the_edges_of_a_min_max_band_are_inside() -> None:
    window = [10, 12, 14]
    assert count_verdicts(window, [10, 14, 12]) == ["unchanged"] * 3
    assert count_verdicts(window, [14.5, 9.5, 0]) == ["increased", "decreased", "removed"]
    codes, baseline = compute._verdicts(np.array([window], dtype=float), np.array([20.0]), request())
    assert baseline.tolist() == [12.0]  # measured from the median


def test_the_edges_of_a_robust_band() -> None:
    window = [10, 12, 11, 13, 100]  # 12 +- 4.4478
    assert count_verdicts(window, [16.4, 7.6]) == ["unchanged", "unchanged"]
    assert count_verdicts(window, [16.5, 7.5]) == ["increased", "decreased"]
    assert count_verdicts(window, [16.5], spread=3.1) == ["unchanged"]


def test_outside_the_band_the_thresholds_count_from_the_median() -> None:
    window = [10, 12, 14]  # median 12
    assert count_verdicts(window, [15, 16], relative=0.25) == ["unchanged", "increased"]  # 25% of 12 is 3
    assert count_verdicts(window, [8, 9], relative=0.25) == ["decreased", "unchanged"]
    assert count_verdicts(window, [16, 17], absolute=4) == ["unchanged", "increased"]
    assert count_verdicts(window, [17], relative=0.25, absolute=6) == ["unchanged"]
    # A window whose median is 0: only the absolute threshold applies.
    assert count_verdicts([0, 0, 3], [4, 5], relative=10, absolute=4) == ["unchanged", "increased"]
    assert count_verdicts([0, 0, 3], [3, 0]) == ["unchanged", "unchanged"]


def test_the_exact_tier_wherever_the_window_agrees() -> None:
    window = np.array([[5.0, 5.0, 5.0], [5.0, 6.0, 7.0], [0.0, 0.0, 0.0]])
    codes, baseline = compute._verdicts(window, np.array([7.0, 7.0, 2.0]), request())
    assert [compute._CODES[c] for c in codes] == ["increased", "unchanged", "new"]
    assert baseline.tolist() == [5.0, 6.0, 0.0]


# ------------------------------------------------------------------------------------------ classified sites


def site_values(rows: list[tuple]) -> pa.Table:
    """Rows (set_index, name, site_key, events, line) as `_site_values` returns them."""
    return pa.table(
        {
            "set_index": pa.array([r[0] for r in rows], pa.int32()),
            "kind": ["op"] * len(rows),
            "name": [r[1] for r in rows],
            "site_key": pa.array([r[2] for r in rows], pa.string()),
            "events": pa.array([float(r[3]) for r in rows]),
            "site_function": ["f"] * len(rows),
            "site_portable_file": ["pkg/a.py"] * len(rows),
            "site_file": ["/src/pkg/a.py"] * len(rows),
            "site_line": pa.array([r[4] for r in rows], pa.int64()),
        }
    )


def run_sets(count: int) -> list[RunSet]:
    return [RunSet(f"run{i}", [f"run{i}"], {}, None) for i in range(count)]


def test_flags_moves_and_known_sites_of_a_pair() -> None:
    values = site_values(
        [
            (0, "grew", "s1", 10, 5),
            (1, "grew", "s1", 14, 5),
            (0, "same", "s2", 3, 7),
            (1, "same", "s2", 3, 9),  # moved from line 7 to 9
            (0, "gone", "s3", 4, 1),
            (1, "fresh", "s3", 2, 1),  # a new name at a known site
            (1, "elsewhere", "s4", 4, 2),  # new at a new site
            (1, "small", "s1", 3, 5),
        ]
    )
    sites = {s.name: s for s in compute._classify(values, run_sets(2), request(absolute=3))}
    assert {n: (s.change, s.flagged) for n, s in sites.items()} == {
        "grew": ("increased", True),  # 4 events more, past 3
        "same": ("moved", False),
        "gone": ("removed", False),
        "fresh": ("new", False),  # 2 events: not past 3
        "elsewhere": ("new", True),
        "small": ("new", False),  # 3 events: not strictly past 3
    }
    assert (sites["same"].site_line, sites["same"].baseline_line) == (9, 7)
    assert sites["grew"].baseline_line is None and sites["gone"].site_line == 1
    assert sites["fresh"].site_known and not sites["elsewhere"].site_known
    assert (sites["grew"].baseline_events, sites["grew"].candidate_events) == (10, 14)
    assert all(s.spread is None for s in sites.values())


def test_a_window_gives_each_site_its_spread() -> None:
    rows = [(i, "varies", "s1", v, 3) for i, v in enumerate([10, 12, 14, 20])]
    rows += [(i, "steady", "s2", 5, 4) for i in range(4)]
    sites = {s.name: s for s in compute._classify(site_values(rows), run_sets(4), request())}
    assert (sites["varies"].change, sites["varies"].flagged, sites["varies"].baseline_events) == ("increased", True, 12)
    assert (sites["varies"].spread.low, sites["varies"].spread.high) == (10, 14)
    assert sites["steady"].change == "unchanged" and sites["steady"].spread.values == [5, 5, 5]


def test_a_site_that_grew_where_it_moved_keeps_its_old_line() -> None:
    values = site_values(
        [
            (0, "grew", "s1", 10, 5),
            (1, "grew", "s1", 20, 6),
            (0, "nowhere", "s2", 1, None),
            (1, "nowhere", "s2", 1, 4),
            (1, "no_stack", None, 2, None),
        ]
    )
    sites = {s.name: s for s in compute._classify(values, run_sets(2), request())}
    assert (sites["grew"].change, sites["grew"].site_line, sites["grew"].baseline_line) == ("increased", 6, 5)
    assert (sites["nowhere"].change, sites["nowhere"].baseline_line) == ("moved", None)
    assert (sites["no_stack"].site_key, sites["no_stack"].site_line, sites["no_stack"].change) == (None, None, "new")


def test_two_nights_are_a_window_with_spreads() -> None:
    rows = [(0, "varies", "s1", 10, 3), (1, "varies", "s1", 12, 3), (2, "varies", "s1", 13, 3)]
    (site,) = compute._classify(site_values(rows), run_sets(3), request())
    assert (site.change, site.spread.low, site.spread.high, site.baseline_events) == ("increased", 10, 12, 11)


def test_the_report_order_flagged_first_then_changed_then_by_size_then_by_name() -> None:
    def change(kind, name, key, delta, flagged=False, what="increased"):
        return SiteChange(kind, name, key, None, None, None, None, 10.0, 10.0 + delta, what, flagged=flagged)

    sites = [
        change("op", "b", "k", 3),
        change("op", "a", "k2", 3),
        change("op", "a", "k1", 3),
        change("kernel_launch", "z", "k", 3),
        change("op", "a", None, 3),
        change("op", "same", "k", 0, what="unchanged"),
        change("op", "big", "k", -9, what="decreased"),
        change("op", "small", "k", 1, flagged=True),
    ]
    ordered = [(s.kind, s.name, s.site_key) for s in sorted(sites, key=compute._order)]
    assert ordered == [
        ("op", "small", "k"),
        ("op", "big", "k"),
        ("kernel_launch", "z", "k"),
        ("op", "a", None),
        ("op", "a", "k1"),
        ("op", "a", "k2"),
        ("op", "b", "k"),
        ("op", "same", "k"),
    ]


# ------------------------------------------------------------------------------------------ GPU time verdicts


def gpu_pair(base: float, cand: float, runs=(10, 10), means=(10.0, 10.0), k=3.0, **thresholds) -> str:
    """The verdict of one site against one baseline run, durations' variance 5 over 10 timed runs a side
    (so a standard error of 1 and z = the means' difference)."""
    one = np.ones(1)
    code, _, _ = gpu_time._verdicts(
        np.array([[base]]),
        np.array([cand]),
        np.array([[runs[0]]], dtype=float),
        np.array([runs[1]], dtype=float),
        one * means[0],
        one * 5,
        one * 10,
        one * means[1],
        one * 5,
        one * 10,
        request(spread=k, **thresholds),
    )
    return gpu_time._CODES[code[0]]


def test_gpu_time_against_one_run_needs_more_executions_or_a_shifted_mean() -> None:
    assert gpu_pair(100, 200) == "unchanged"  # same executions, same mean: noise
    assert gpu_pair(100, 200, runs=(10, 11)) == "increased"
    assert gpu_pair(100, 50, runs=(10, 9)) == "decreased"
    assert gpu_pair(100, 50, runs=(10, 11)) == "unchanged"  # more runs do not explain less time
    assert gpu_pair(100, 200, means=(10, 13)) == "unchanged"  # z = 3 is not past 3
    assert gpu_pair(100, 200, means=(10, 13.5)) == "increased"
    assert gpu_pair(100, 200, means=(10, 13.5), k=3.5) == "unchanged"
    assert gpu_pair(100, 50, means=(10, 7)) == "unchanged"
    assert gpu_pair(100, 50, means=(10, 6.5)) == "decreased"
    assert gpu_pair(100, 50, means=(10, 13.5)) == "unchanged"  # a slower mean does not explain less time
    assert gpu_pair(0, 5) == "new" and gpu_pair(0, 0) == "unchanged"
    assert gpu_pair(100, 0, runs=(10, 0)) == "removed"
    # Fractions (GPU time per marker event): any growth is growth, any time where there was none is new.
    assert gpu_pair(100, 100.5, runs=(10, 11)) == "increased" and gpu_pair(0, 0.5) == "new"


def test_gpu_time_thresholds_are_strict_and_count_from_the_baseline() -> None:
    assert gpu_pair(100, 110, runs=(10, 11), gpu_relative=0.1) == "unchanged"
    assert gpu_pair(100, 111, runs=(10, 11), gpu_relative=0.1) == "increased"
    assert gpu_pair(100, 90, runs=(10, 9), gpu_relative=0.1) == "unchanged"
    assert gpu_pair(100, 89, runs=(10, 9), gpu_relative=0.1) == "decreased"
    assert gpu_pair(100, 105, runs=(10, 11), gpu_absolute=5) == "unchanged"
    assert gpu_pair(100, 106, runs=(10, 11), gpu_absolute=5) == "increased"
    assert gpu_pair(0, 5, gpu_relative=10, gpu_absolute=50) == "new"


def gpu_window(window: list[float], candidates: list[float], **thresholds) -> tuple[list[str], list[float]]:
    rows = len(candidates)
    nan = np.full(rows, np.nan)
    codes, baseline, z = gpu_time._verdicts(
        np.array([window] * rows, dtype=float),
        np.array(candidates, dtype=float),
        np.ones((rows, len(window))),
        np.ones(rows) * 100,  # executions say nothing in a window
        nan,
        nan,
        nan,
        nan,
        nan,
        nan,
        request(**thresholds),
    )
    assert np.isnan(z).all()
    return [gpu_time._CODES[c] for c in codes], baseline.tolist()


def test_gpu_time_against_a_window_flags_outside_its_band_only() -> None:
    codes, baseline = gpu_window([100, 120, 110], [100, 120, 120.5, 99.5, 0])
    assert codes == ["unchanged", "unchanged", "increased", "decreased", "removed"]
    assert baseline == [110] * 5
    codes, _ = gpu_window([100, 120, 110], [121, 122, 99, 98], gpu_relative=0.1)  # 10% of the median 110
    assert codes == ["unchanged", "increased", "unchanged", "decreased"]
    codes, _ = gpu_window([100, 120, 110], [125, 126], gpu_absolute=15)
    assert codes == ["unchanged", "increased"]
    # Absent from every night: new; present on one night: measured against the band.
    assert gpu_window([0, 0], [5, 0])[0] == ["new", "unchanged"]
    assert gpu_window([0, 5], [6, 5])[0] == ["increased", "unchanged"]
    # A median of 0: the relative threshold counts from 1 ns.
    assert gpu_window([0, 0, 5], [6, 4.5], gpu_relative=4)[0] == ["increased", "unchanged"]
    assert gpu_window([0, 0, 5], [6, 11], gpu_relative=10)[0] == ["unchanged", "increased"]


def test_gpu_time_new_in_a_window_is_per_site() -> None:
    nan = np.full(2, np.nan)
    codes, _, _ = gpu_time._verdicts(
        np.array([[0.0, 0.0], [5.0, 5.0]]), np.array([5.0, 5.0]), np.ones((2, 2)), np.ones(2), nan, nan, nan, nan,
        nan, nan, request(),
    )  # fmt: skip
    assert [gpu_time._CODES[c] for c in codes] == ["new", "unchanged"]


# ------------------------------------------------------------------------------------------ a whole report


def grow(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "grow")


def steady(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "steady")


def gone(count: int) -> None:
    for _ in range(count):
        capture.record("op", "gone")


def fresh(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "fresh")


def step(count: int) -> None:
    for _ in range(count):
        capture.record("user", "step")


# Per night (oldest first): the events of each site. The last is the candidate.
NIGHTS = [
    ("n1", {grow: 10, steady: 5, gone: 3, step: 2}),
    ("n2", {grow: 12, steady: 5, gone: 3, step: 2}),
    ("n3", {grow: 14, steady: 5, gone: 3, step: 2}),
    ("n4", {grow: 30, steady: 5, fresh: 4, step: 4}),
]


@pytest.fixture(scope="module")
def nights_db(tmp_path_factory, symbol_cache) -> Path:
    root = tmp_path_factory.mktemp("report_rules")
    for commit, sites in NIGHTS:
        with capture.session(root / "runs", labels={"suite": "rules", "commit": commit}):
            for site, count in sites.items():
                site(count)
    path = root / "tbpipe.duckdb"
    summary = ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False))
    assert summary.ok and summary.ingested == len(NIGHTS)
    return path


@pytest.fixture()
def con(nights_db):
    connection = open_database(nights_db, read_only=True)
    yield connection
    connection.close()


def report_of(con, **fields) -> RegressionReport:
    fields.setdefault("candidate", "latest:commit=n4")
    return compare(con, ReportRequest(**fields), today=dt.date(2026, 12, 6))


def test_a_pair_report_in_process(con) -> None:
    report = report_of(con, baseline="latest:commit=n3", tracebacks=1)
    changes = [(s.name, s.change, s.flagged, s.baseline_events, s.candidate_events) for s in report.sites]
    # Flagged first, then by size of change.
    assert changes == [
        ("grow", "increased", True, 14, 30),
        ("fresh", "new", True, 0, 4),
        ("step", "increased", True, 2, 4),
        ("gone", "removed", False, 3, 0),
        ("steady", "unchanged", False, 5, 5),
    ]
    grow_site = report.sites[0]
    assert grow_site.site_function == "grow" and grow_site.where.endswith(f":{grow_site.site_line}")
    # Tracebacks of the first flagged site only (tracebacks=1), innermost first, the site's function in it.
    assert grow_site.traceback and any(f.function == "grow" for f in grow_site.traceback)
    assert [s.traceback is None for s in report.sites if s.flagged][1:] == [True] * (len(report.regressions) - 1)
    assert report.verdict().startswith(f"{len(report.regressions)} regressions (")
    assert [e.what for e in report.environment] == ["label commit"]
    assert (report.candidate.name, report.baseline[0].name) == (
        report.candidate.run_ids[0],
        report.baseline[0].run_ids[0],
    )


def test_a_window_report_in_process(con) -> None:
    report = report_of(con, window=3, kinds=("kernel_launch",))
    sites = {s.name: s for s in report.sites}
    assert set(sites) == {"grow", "steady", "fresh"}  # only the kind asked for
    assert (sites["grow"].change, sites["grow"].flagged, sites["grow"].baseline_events) == ("increased", True, 12)
    assert (sites["grow"].spread.low, sites["grow"].spread.high, sites["grow"].spread.values) == (10, 14, [10, 12, 14])
    assert sites["steady"].change == "unchanged" and report.verdict().endswith("against 3 previous runs")


def test_per_marker_counts_in_process(con) -> None:
    report = report_of(con, baseline="latest:commit=n3", per=("user", "step"))
    sites = {s.name: s for s in report.sites}
    assert "step" not in sites and (report.candidate.markers, report.baseline[0].markers) == (4, 2)
    assert (sites["grow"].baseline_events, sites["grow"].candidate_events) == (7, 7.5)
    assert (sites["steady"].baseline_events, sites["steady"].candidate_events) == (2.5, 1.25)
    with pytest.raises(SelectionError, match="recorded no user 'nothing' events"):
        report_of(con, baseline="latest:commit=n3", per=("user", "nothing"))


def test_accepted_and_expired_entries_in_process(con, tmp_path) -> None:
    path = tmp_path / "accept.toml"
    path.write_text(
        '[[accept]]\nsite = "test_report_rules.py:grow"\nname = "gr*"\nreason = "bigger batch"\n'
        '[[accept]]\nsite = "test_report_rules.py:fresh"\nuntil = 2026-12-05\nreason = "old"\n'
        '[[accept]]\nsite = "test_report_rules.py:steady"\nuntil = 2026-12-06\nreason = "today still"\n'
    )
    report = compare(
        con,
        ReportRequest("latest:commit=n4", baseline="latest:commit=n3"),
        load_accept_file(path),
        dt.date(2026, 12, 6),
    )
    sites = {s.name: s for s in report.sites}
    assert (sites["grow"].flagged, sites["grow"].accepted) == (False, "test_report_rules.py:grow gr*: bigger batch")
    assert sites["fresh"].flagged and sites["fresh"].accepted is None
    assert report.expired_accepts == ["test_report_rules.py:fresh until 2026-12-05: old"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "give a baseline"),
        ({"baseline": "latest:commit=n3", "window": 2}, "give a baseline"),
        ({"window": 0}, "at least 1, not 0"),
        ({"baseline": "latest:commit=n4"}, "share runs"),
        ({"baseline": "latest:commit=n3", "site_of": "elsewhere"}, "not 'elsewhere'"),
    ],
)
def test_a_request_that_cannot_be_answered(con, fields: dict, message: str) -> None:
    with pytest.raises(SelectionError, match=message):
        report_of(con, **fields)


def test_short_module_keys() -> None:
    assert compute._short_key("0123456789abcdef") == "0123456789abcdef"
    assert compute._short_key("0123456789abcdef0") == "0123456789ab…"
    assert compute._short_key("path:/a/very/long/path/libfoo.so") == "path:/a/very/long/path/libfoo.so"
    assert compute._short_key("invalid:/a/very/long/path/libfoo.so") == "invalid:/a/very/long/path/libfoo.so"


# ------------------------------------------------------------------------------------------ GPU time in a whole report

# Per night, per launch site (its function's event name): the activity and its durations in ns. The
# GPU time table is filled here from these, at the stacks the nights' launches really have.
GPU_NIGHTS = {
    "n1": {"grow": ("kernel", "gemm", [10_000, 10_200, 9_800, 10_000]), "gone": ("memset", "memset", [500, 500])},
    "n2": {"grow": ("kernel", "gemm", [10_000, 10_400, 9_600, 10_400]), "gone": ("memset", "memset", [500, 500])},
    "n3": {"grow": ("kernel", "gemm", [10_000, 10_100, 9_900, 10_000]), "gone": ("memset", "memset", [500, 500])},
    "n4": {"grow": ("kernel", "gemm", [15_000, 15_200, 14_800, 15_000]), "fresh": ("kernel", "fresh_kernel", [700])},
}
SAME_EVERY_NIGHT = ("steady", ("kernel", "softmax", [3_000] * 5))


@pytest.fixture(scope="module")
def gpu_db(nights_db, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report_rules_gpu") / "gpu.duckdb"
    shutil.copy(nights_db, path)
    with duckdb.connect(str(path)) as con:
        for commit, sites in GPU_NIGHTS.items():
            for name, (kind, activity, durations) in [*sites.items(), SAME_EVERY_NIGHT]:
                ((run_number, name_id, stack_id),) = con.execute(
                    """
                    SELECT c.run_number, c.name_id, c.stack_id FROM run_stack_counts c
                    JOIN runs r USING (run_number) JOIN event_names n USING (name_id)
                    WHERE r.labels['commit'] = ? AND n.name = ?
                    """,
                    [commit, name],
                ).fetchall()
                con.execute(
                    "INSERT INTO gpu_time_counts VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                    [run_number, name_id, stack_id, kind, activity, len(durations), len(durations), sum(durations),
                     sum((d / 1000) ** 2 for d in durations), min(durations), max(durations)],
                )  # fmt: skip
            # Synchronisation is GPU time of no launch: never compared.
            con.execute(
                "INSERT INTO gpu_time_counts VALUES (?, NULL, NULL, NULL, 'sync', 'sync', 1, 1, 99, 0, 99, 99, NULL)",
                [run_number],
            )
    return path


@pytest.fixture()
def gpu_con(gpu_db):
    connection = open_database(gpu_db, read_only=True)
    yield connection
    connection.close()


def test_gpu_time_of_a_pair_in_process(gpu_con) -> None:
    report = report_of(gpu_con, baseline="latest:commit=n3")
    sites = {s.name: s for s in report.gpu_sites}
    assert set(sites) == {"gemm", "softmax", "memset", "fresh_kernel"}
    gemm = sites["gemm"]
    before, after = GPU_NIGHTS["n3"]["grow"][2], GPU_NIGHTS["n4"]["grow"][2]
    error = math.sqrt(statistics.variance(before) / 4 + statistics.variance(after) / 4)
    assert (gemm.change, gemm.flagged, gemm.baseline_ns, gemm.candidate_ns) == ("increased", True, 40_000, 60_000)
    assert (gemm.baseline_executions, gemm.candidate_executions) == (4, 4)
    assert (gemm.baseline_mean_ns, gemm.candidate_mean_ns) == (10_000, 15_000)
    assert gemm.z == pytest.approx(5_000 / error)
    assert (gemm.kind, gemm.launch_kind, gemm.site_function) == ("kernel", "kernel_launch", "grow")
    assert gemm.traceback and any(f.function == "grow" for f in gemm.traceback) and gemm.spread is None
    assert (sites["softmax"].change, sites["softmax"].z) == ("unchanged", 0.0)
    assert (sites["fresh_kernel"].change, sites["fresh_kernel"].flagged, sites["fresh_kernel"].z) == ("new", True, None)
    assert (sites["memset"].change, sites["memset"].candidate_mean_ns, sites["memset"].launch_kind) == (
        "removed",
        None,
        "op",
    )
    assert [s.name for s in report.gpu_sites] == ["gemm", "fresh_kernel", "memset", "softmax"]
    assert report.gpu_verdict() == "GPU time: 2 sites slower (1 new) (4 sites compared)"
    only = report_of(gpu_con, baseline="latest:commit=n3", kinds=("op",))
    assert [s.name for s in only.gpu_sites] == ["memset"]  # the kinds asked for are the launches' kinds


def test_gpu_time_of_a_window_in_process(gpu_con) -> None:
    report = report_of(gpu_con, window=3)
    gemm = next(s for s in report.gpu_sites if s.name == "gemm")
    assert (gemm.change, gemm.flagged, gemm.baseline_ns, gemm.z) == ("increased", True, 40_000, None)
    assert (gemm.spread.values, gemm.spread.low, gemm.spread.high) == ([40_000, 40_400, 40_000], 40_000, 40_400)
    assert gemm.baseline_executions == 4 and gemm.baseline_mean_ns == pytest.approx(sum(
        sum(GPU_NIGHTS[n]["grow"][2]) for n in ("n1", "n2", "n3")) / 12)  # fmt: skip


def test_gpu_time_per_marker_in_process(gpu_con) -> None:
    report = report_of(gpu_con, baseline="latest:commit=n3", per=("user", "step"))
    gemm = next(s for s in report.gpu_sites if s.name == "gemm")
    # Totals per marker (2, then 4 steps); executions per marker fall, so less time is no surprise.
    assert (gemm.baseline_ns, gemm.candidate_ns, gemm.baseline_executions, gemm.candidate_executions) == (
        20_000, 15_000, 2, 1)  # fmt: skip
    assert (gemm.change, gemm.baseline_mean_ns, gemm.candidate_mean_ns) == ("decreased", 10_000, 15_000)


def test_rebuilt_modules_are_listed_up_to_a_limit(nights_db, tmp_path) -> None:
    path = tmp_path / "rebuilt.duckdb"
    shutil.copy(nights_db, path)
    rebuilt = compute.MODULES_SHOWN + 3
    with duckdb.connect(str(path)) as con:
        for commit, key in (("n3", "{:02d}aaaaaaaaaaaaaaaaaaaa"), ("n4", "{:02d}bbbbbbbbbbbbbbbbbbbb")):
            (run,) = con.execute("SELECT run_id FROM runs WHERE labels['commit'] = ?", [commit]).fetchone()
            for i in range(rebuilt):
                con.execute(
                    "INSERT INTO run_modules VALUES (?, ?, ?, ?, 0, [])",
                    [run, 1000 + i, key.format(i), f"/x/lib{i:02d}.so"],
                )
            # Not rebuilt: the same key on both sides; loaded on one side only: not a difference.
            con.execute("INSERT INTO run_modules VALUES (?, 2000, 'same', '/x/libsame.so', 0, [])", [run])
            con.execute("INSERT INTO run_modules VALUES (?, 2001, 'k', ?, 0, [])", [run, f"/x/only-{commit}.so"])
    with open_database(path, read_only=True) as con:
        report = report_of(con, baseline="latest:commit=n3")
    modules = [e for e in report.environment if e.what.startswith("module ")]
    assert [e.what for e in modules] == [f"module lib{i:02d}.so" for i in range(compute.MODULES_SHOWN)]
    assert (modules[0].baseline, modules[0].candidate) == ("00aaaaaaaaaa…", "00bbbbbbbbbb…")
    assert report.environment[-1].what == "3 more modules rebuilt"
    assert report.environment[0].what == "label commit" and len(report.environment) == compute.MODULES_SHOWN + 2
