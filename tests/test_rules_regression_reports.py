"""The regression report's rules in whole reports computed in process over nights of captured runs:
the sites' verdicts and order, tracebacks of the flagged ones, --per, accepted changes, refused
requests, and GPU time per site. The rules themselves are stated on hand-made inputs in
tests/test_report_rules.py and tests/test_rules_regression_db.py; these tests check that a report
puts them together over a real capture and ingest (too slow for every mutant of `make mutate`)."""

from __future__ import annotations

import datetime as dt
import math
import shutil
import statistics
from pathlib import Path

import duckdb
import pytest

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.reports.regression.accept import load_accept_file
from tbpipe.pipeline.reports.regression.compute import compare
from tbpipe.pipeline.reports.regression.model import RegressionReport, ReportRequest
from tbpipe.pipeline.reports.regression.select import SelectionError

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
        '[[accept]]\nsite = "test_rules_regression_reports.py:grow"\nname = "gr*"\nreason = "bigger batch"\n'
        '[[accept]]\nsite = "test_rules_regression_reports.py:fresh"\nuntil = 2026-12-05\nreason = "old"\n'
        '[[accept]]\nsite = "test_rules_regression_reports.py:steady"\nuntil = 2026-12-06\nreason = "today still"\n'
    )
    report = compare(
        con,
        ReportRequest("latest:commit=n4", baseline="latest:commit=n3"),
        load_accept_file(path),
        dt.date(2026, 12, 6),
    )
    sites = {s.name: s for s in report.sites}
    assert (sites["grow"].flagged, sites["grow"].accepted) == (
        False,
        "test_rules_regression_reports.py:grow gr*: bigger batch",
    )
    assert sites["fresh"].flagged and sites["fresh"].accepted is None
    assert report.expired_accepts == ["test_rules_regression_reports.py:fresh until 2026-12-05: old"]


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
