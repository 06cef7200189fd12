"""The regression report's rules, stated exactly: the band of a window (hand-computed and against a
plain-Python reference), the verdict at each of its edges and at the thresholds' edges, for counts
and GPU time, and the per-execution statistics (mean, variance, Welch's z)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.reports.regression import compute, gpu_time, stats
from tbpipe.pipeline.reports.regression.model import ReportRequest, RunSet, SiteChange, Thresholds

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


def test_fractions_of_an_event_change_too() -> None:
    # With --per counts are events per marker: a change of 0.3 is a change.
    assert count_verdicts([1.0, 1.2, 1.4], [1.5, 0.9, 1.3]) == ["increased", "decreased", "unchanged"]
    assert count_verdicts([1.0], [1.5, 0.5]) == ["increased", "decreased"]


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
    assert sites["fresh"].baseline_line is None and sites["elsewhere"].baseline_line is None  # nowhere before
    assert (sites["grew"].baseline_events, sites["grew"].candidate_events) == (10, 14)
    assert all(s.spread is None for s in sites.values())


def test_a_window_gives_each_site_its_spread() -> None:
    rows = [(i, "varies", "s1", v, 3) for i, v in enumerate([10, 12, 14, 20])]
    rows += [(i, "steady", "s2", 5, 4) for i in range(4)]
    sites = {s.name: s for s in compute._classify(site_values(rows), run_sets(4), request())}
    assert (sites["varies"].change, sites["varies"].flagged, sites["varies"].baseline_events) == ("increased", True, 12)
    assert (sites["varies"].spread.low, sites["varies"].spread.high) == (10, 14)
    assert sites["steady"].change == "unchanged" and sites["steady"].spread.values == [5, 5, 5]


@pytest.mark.filterwarnings("error")  # a missing line is no NaN cast to an integer
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


def test_line_0_is_a_line_and_the_first_row_is_a_row() -> None:
    # DWARF's line 0 (no line) is still where a native site is; the table's row 0 is a baseline row.
    values = site_values(
        [(0, "same", "s2", 3, 0), (1, "same", "s2", 3, 4), (0, "zero", "s3", 2, 7), (1, "zero", "s3", 2, 0)]
    )
    sites = {s.name: s for s in compute._classify(values, run_sets(2), request())}
    assert (sites["same"].change, sites["same"].site_line, sites["same"].baseline_line) == ("moved", 4, 0)
    assert (sites["zero"].change, sites["zero"].site_line, sites["zero"].baseline_line) == ("moved", 0, 7)


def test_a_site_is_named_from_the_candidate_else_the_newest_baseline() -> None:
    def row(set_index, kind, name, key, function, path, line):
        return (set_index, kind, name, key, 5.0, function, path.removeprefix("/src/"), path, line)

    rows = [
        row(0, "kernel_launch", "gemm", "s1", "old_train", "/src/old/train.py", 3),
        row(1, "kernel_launch", "gemm", "s1", "train", "/src/app/train.py", 3),
        row(2, "kernel_launch", "gemm", "s1", "newest", "/src/app/newest.py", 3),  # the candidate
        row(0, "op", "gone", "s2", "first", "/src/app/first.py", 8),
    ]
    names = ["set_index", "kind", "name", "site_key", "events", "site_function", "site_portable_file", "site_file"]
    names.append("site_line")
    values = pa.table({n: pa.array([r[i] for r in rows]) for i, n in enumerate(names)})
    values = values.set_column(0, "set_index", values["set_index"].cast(pa.int32()))
    sites = {s.name: s for s in compute._classify(values, run_sets(3), request())}
    gemm, gone = sites["gemm"], sites["gone"]
    assert (gemm.kind, gemm.site_key, gemm.site_function, gemm.site_file, gemm.site_portable_file) == (
        "kernel_launch", "s1", "newest", "/src/app/newest.py", "app/newest.py")  # fmt: skip
    assert (gone.kind, gone.site_key, gone.site_function, gone.site_file, gone.site_portable_file) == (
        "op", "s2", "first", "/src/app/first.py", "app/first.py")  # fmt: skip


site_rows = st.dictionaries(
    st.tuples(
        st.integers(0, 1),
        st.sampled_from(["a", "ab", "op"]),
        st.text("ab", max_size=2),
        st.one_of(st.none(), st.text("ab", max_size=2)),
    ),
    st.integers(1, 9),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(site_rows)
def test_a_site_is_one_kind_name_and_key_whatever_their_text(rows: dict) -> None:
    # The reference: one site per distinct (kind, name, key), no key being a key of its own.
    expected: dict[tuple, list[float]] = {}
    for (set_index, kind, name, key), events in rows.items():
        expected.setdefault((kind, name, key), [0.0, 0.0])[set_index] = float(events)
    keys = list(rows)
    values = pa.table(
        {
            "set_index": pa.array([k[0] for k in keys], pa.int32()),
            "kind": [k[1] for k in keys],
            "name": [k[2] for k in keys],
            "site_key": pa.array([k[3] for k in keys], pa.string()),
            "events": [float(rows[k]) for k in keys],
            "site_function": ["f"] * len(keys),
            "site_portable_file": ["a.py"] * len(keys),
            "site_file": ["/a.py"] * len(keys),
            "site_line": pa.array([1] * len(keys), pa.int64()),
        }
    )
    sites = compute._classify(values, run_sets(2), request())
    assert len(sites) == len(expected)
    assert {(s.kind, s.name, s.site_key): [s.baseline_events, s.candidate_events] for s in sites} == expected


def test_the_newest_row_of_each_site() -> None:
    row_at = np.array([[3, -1, 5], [-1, -1, -1], [2, 4, -1]])
    assert compute._newest_row(row_at, 3).tolist() == [5, -1, 4]
    assert compute._newest_row(row_at, 2).tolist() == [3, -1, 4]  # the first two sets only
    assert compute._newest_row(row_at, 0).tolist() == [-1, -1, -1]


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
        change("op", "a", "0000000000000001", 3),
        change("op", "same", "k", 0, what="unchanged"),
        change("op", "big", "k", -9, what="decreased"),
        change("op", "small", "k", 1, flagged=True),
    ]
    ordered = [(s.kind, s.name, s.site_key) for s in sorted(sites, key=compute._order)]
    assert ordered == [
        ("op", "small", "k"),
        ("op", "big", "k"),
        ("kernel_launch", "z", "k"),
        ("op", "a", None),  # no site sorts first
        ("op", "a", "0000000000000001"),
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


def test_short_module_keys() -> None:
    assert compute._short_key("0123456789abcdef") == "0123456789abcdef"
    assert compute._short_key("0123456789abcdef0") == "0123456789ab…"
    assert compute._short_key("path:/a/very/long/path/libfoo.so") == "path:/a/very/long/path/libfoo.so"
    assert compute._short_key("invalid:/a/very/long/path/libfoo.so") == "invalid:/a/very/long/path/libfoo.so"
