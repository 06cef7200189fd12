"""The regression report's rules that read the database, stated on small hand-made databases (the real
schema, rows written here): GPU time per site (which launches are one site, totals per marker, the
window's medians and bands, where a site is shown from, the order), the environment that differs
between the two sides (versions, labels, rebuilt modules) and accepted changes."""

from __future__ import annotations

import datetime as dt
import math
import shutil
from pathlib import Path

import duckdb
import pytest

from tbpipe.pipeline.db import open_database
from tbpipe.pipeline.reports.regression import compute, gpu_time
from tbpipe.pipeline.reports.regression.accept import Accepted, AcceptList
from tbpipe.pipeline.reports.regression.model import (
    GpuSiteChange,
    ReportRequest,
    RunSet,
    SiteChange,
    Thresholds,
)


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regression_db") / "empty.duckdb"
    open_database(path).close()
    return path


@pytest.fixture()
def con(empty_db, tmp_path):
    path = tmp_path / "report.duckdb"
    shutil.copy(empty_db, path)
    connection = duckdb.connect(str(path))
    yield connection
    connection.close()


def add_run(con, number: int, labels: dict[str, str] | None = None, **fields) -> RunSet:
    """A run `r<number>` whose environment fields are `fields` (python_version, sources, ...)."""
    run_id = f"r{number}"
    columns = ["run_id", "run_number", "complete", "labels", "events", "stacks", "new_stacks", "source_dir"]
    columns += ["parts", "ingested_at", "manifest", *fields]
    values = [run_id, number, True, labels or {}, 0, 0, 0, "/runs", "{}", dt.datetime(2026, 12, 6), "{}"]
    con.execute(
        f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
        values + list(fields.values()),
    )
    return RunSet(run_id, [run_id], labels or {}, None)


def run_set(*runs: RunSet, markers: float | None = None) -> RunSet:
    return RunSet(runs[0].name, [r for run in runs for r in run.run_ids], {}, None, markers)


# ------------------------------------------------------------------------------------------ GPU time

# Sites of launches: (site_id, key, function, portable file); the stacks below are at them.
SITES = [
    (1, "k_train", "train", "app/train.py"),
    (2, "k_loss", "loss", "app/loss.py"),
    (3, "k_trai", "t", "app/t.py"),
    (4, "0_site", "z", "app/z.py"),
]
# (stack_id, site_id or None, line of the site in that stack)
STACKS = [(10, 1, 10), (11, 1, 14), (12, 2, 30), (13, None, None), (14, 3, 2), (15, 4, 1)]
LAUNCH, MEMSET = 1, 2


def gpu_tables(con) -> None:
    for site_id, key, function, portable in SITES:
        con.execute(
            "INSERT INTO sites VALUES (?, ?, ?, ?, 1, 'python', ?, 0, NULL)",
            [site_id, key, function, f"/src/{portable}", portable],
        )
    for stack_id, site_id, line in STACKS:
        file = next((f"/src/{s[3]}" for s in SITES if s[0] == site_id), None)
        con.execute("INSERT INTO stack_sites VALUES (?, ?, 1, 'python', true, ?, ?)", [stack_id, site_id, file, line])
    con.execute(
        "INSERT INTO event_names VALUES (?, 'kernel_launch', 'launch'), (?, 'memset', 'memset')", [LAUNCH, MEMSET]
    )


def gpu(
    con, run: RunSet, stack: int | None, kind: str, name: str, durations: list[int], executions=None, launch=LAUNCH
):
    """GPU time of `run` at `stack`: `durations` (ns) timed, of `executions` (default: as many)."""
    (number,) = con.execute("SELECT run_number FROM runs WHERE run_id = ?", [run.run_ids[0]]).fetchone()
    con.execute(
        "INSERT INTO gpu_time_counts VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL)",
        [number, launch, stack, kind, name, executions if executions is not None else len(durations),
         len(durations), sum(durations), sum((d / 1000) ** 2 for d in durations)],
    )  # fmt: skip


def gpu_request(**fields) -> ReportRequest:
    fields.setdefault("gpu_thresholds", Thresholds(0.0, 0.0))
    return ReportRequest("candidate", baseline="baseline", **fields)


def by_name(sites: list[GpuSiteChange]) -> dict[tuple, GpuSiteChange]:
    return {(s.kind, s.name, s.site_key): s for s in sites}


def test_no_gpu_time_is_no_gpu_sites(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    assert gpu_time.compare_gpu_time(con, [base, cand], gpu_request()) == []
    # Synchronisation is GPU time of no launch, and a kind not asked for is not read.
    con.execute("INSERT INTO gpu_time_counts VALUES (1, NULL, NULL, NULL, 'sync', 'sync', 1, 1, 9, 0, 9, 9, NULL)")
    assert gpu_time.compare_gpu_time(con, [base, cand], gpu_request()) == []
    gpu(con, cand, 10, "kernel", "gemm", [1000])
    assert gpu_time.compare_gpu_time(con, [base, cand], gpu_request(kinds=("op",))) == []
    assert [s.name for s in gpu_time.compare_gpu_time(con, [base, cand], gpu_request())] == ["gemm"]


def test_a_pair_by_hand(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    # Means 2000 and 4000 ns; each side's deviations are +-1000 four times: sample variance 4e6 / 3.
    gpu(con, base, 10, "kernel", "gemm", [1000, 1000, 3000, 3000])
    gpu(con, cand, 11, "kernel", "gemm", [3000, 3000, 5000, 5000])
    # Another site's durations say nothing about gemm's spread.
    gpu(con, base, 12, "kernel", "small", [100, 300])
    gpu(con, cand, 12, "kernel", "small", [100, 300])
    sites = by_name(gpu_time.compare_gpu_time(con, [base, cand], gpu_request(spread=2.0)))
    gemm, small = sites[("kernel", "gemm", "k_train")], sites[("kernel", "small", "k_loss")]
    assert (small.z, small.change, small.baseline_mean_ns) == (0.0, "unchanged", 200)
    assert (gemm.kind, gemm.name, gemm.site_key, gemm.launch_kind) == ("kernel", "gemm", "k_train", "kernel_launch")
    assert (gemm.baseline_ns, gemm.candidate_ns, gemm.baseline_executions, gemm.candidate_executions) == (
        8000, 16000, 4, 4)  # fmt: skip
    assert (gemm.baseline_mean_ns, gemm.candidate_mean_ns) == (2000, 4000)
    # Standard error sqrt(4e6/3 / 4 * 2) = sqrt(2e6/3): z = 2000 / that = sqrt(6), past 2 not past 3.
    assert gemm.z == pytest.approx(math.sqrt(6))
    assert (gemm.change, gemm.flagged, gemm.spread) == ("increased", True, None)
    # Shown where the candidate has it: its function, file and the line of its own stack.
    assert (gemm.site_function, gemm.site_portable_file, gemm.site_file, gemm.site_line) == (
        "train", "app/train.py", "/src/app/train.py", 14)  # fmt: skip
    same = by_name(gpu_time.compare_gpu_time(con, [base, cand], gpu_request(spread=3.0)))[("kernel", "gemm", "k_train")]
    assert (same.change, same.flagged) == ("unchanged", False)


def test_one_site_per_activity_kind_name_and_launch_site(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    # One name, two activity kinds, one site; the same at another site; launches with no site at all.
    for run, scale in ((base, 1), (cand, 2)):
        gpu(con, run, 10, "kernel", "fill", [100 * scale], executions=scale)
        gpu(con, run, 10, "memset", "fill", [7 * scale], executions=scale, launch=MEMSET)
        gpu(con, run, 12, "kernel", "fill", [1000 * scale], executions=scale)
        gpu(con, run, None, "kernel", "fill", [30 * scale], executions=scale)
        gpu(con, run, 13, "kernel", "orphan", [5 * scale], executions=scale)
        # Texts that run together alike ('k_train' + 'x', 'k_trai' + 'nx') are still two sites.
        gpu(con, run, 10, "kernel", "x", [10 * scale], executions=scale)
        gpu(con, run, 14, "kernel", "nx", [20 * scale], executions=scale)
    sites = by_name(gpu_time.compare_gpu_time(con, [base, cand], gpu_request()))
    assert {key: (s.baseline_ns, s.candidate_ns) for key, s in sites.items()} == {
        ("kernel", "x", "k_train"): (10, 20),
        ("kernel", "nx", "k_trai"): (20, 40),
        ("kernel", "fill", "k_train"): (100, 200),
        ("memset", "fill", "k_train"): (7, 14),
        ("kernel", "fill", "k_loss"): (1000, 2000),
        ("kernel", "fill", None): (30, 60),
        ("kernel", "orphan", None): (5, 10),
    }
    assert sites[("memset", "fill", "k_train")].launch_kind == "memset"
    assert sites[("kernel", "fill", None)].site_function is None
    assert all(s.change == "increased" and s.flagged for s in sites.values())


def test_sites_come_in_the_report_order(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    # (name, GPU time before and after, executions before and after): more executions explain more time.
    for name, before, after, runs_before, runs_after in [
        ("b", 100, 300, 1, 2), ("a", 100, 300, 1, 2), ("big", 100, 1000, 1, 2), ("same", 50, 50, 1, 1),
        ("less", 900, 100, 2, 1), ("new", 0, 150, 0, 2), ("gone", 40, 0, 1, 0),
    ]:  # fmt: skip
        for run, time, runs in ((base, before, runs_before), (cand, after, runs_after)):
            if runs:
                gpu(con, run, 10, "kernel", name, [time], executions=runs)
    for stack in (12, 15, None):
        gpu(con, base, stack, "kernel", "a", [100], executions=1)
        gpu(con, cand, stack, "kernel", "a", [300], executions=2)
    gpu(con, cand, 12, "copy", "a", [300], executions=2)
    sites = gpu_time.compare_gpu_time(con, [base, cand], gpu_request())
    assert [(s.kind, s.name, s.site_key, s.change, s.flagged) for s in sites] == [
        ("kernel", "big", "k_train", "increased", True),  # flagged, biggest change first
        ("copy", "a", "k_loss", "new", True),  # then by kind, name and site, no site first
        ("kernel", "a", None, "increased", True),
        ("kernel", "a", "0_site", "increased", True),
        ("kernel", "a", "k_loss", "increased", True),
        ("kernel", "a", "k_train", "increased", True),
        ("kernel", "b", "k_train", "increased", True),
        ("kernel", "new", "k_train", "new", True),
        ("kernel", "less", "k_train", "decreased", False),  # changes not flagged
        ("kernel", "gone", "k_train", "removed", False),
        ("kernel", "same", "k_train", "unchanged", False),
    ]


def test_a_new_site_is_flagged_only_past_the_absolute_threshold(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    gpu(con, base, 10, "kernel", "old", [100])
    gpu(con, cand, 10, "kernel", "old", [100])
    gpu(con, cand, 10, "kernel", "fresh", [500, 500])
    for absolute, flagged in ((999, True), (1000, False)):
        sites = by_name(
            gpu_time.compare_gpu_time(con, [base, cand], gpu_request(gpu_thresholds=Thresholds(0, absolute)))
        )
        fresh = sites[("kernel", "fresh", "k_train")]
        assert (fresh.change, fresh.flagged, fresh.baseline_mean_ns, fresh.z) == ("new", flagged, None, None)
        assert (fresh.candidate_mean_ns, fresh.baseline_executions, fresh.candidate_executions) == (500, 0, 2)


def test_untimed_executions_have_no_mean(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    gpu(con, base, 10, "kernel", "gemm", [1500], executions=3)
    gpu(con, cand, 10, "kernel", "gemm", [], executions=4)
    gpu(con, base, 12, "kernel", "gone", [300, 500])
    (gemm, gone) = sorted(gpu_time.compare_gpu_time(con, [base, cand], gpu_request()), key=lambda s: s.name)
    # One timed execution: a mean but no spread, so no z; none timed: no mean either. Less time over
    # more executions, with no z to tell, is not a change.
    assert (gemm.baseline_mean_ns, gemm.candidate_mean_ns, gemm.z) == (1500, None, None)
    assert (gemm.baseline_executions, gemm.candidate_executions, gemm.change) == (3, 4, "unchanged")
    assert (gone.change, gone.baseline_mean_ns, gone.candidate_mean_ns, gone.candidate_ns) == ("removed", 400, None, 0)
    # A removed site is shown where the baseline had it.
    assert (gone.site_key, gone.site_function, gone.site_line) == ("k_loss", "loss", 30)


def test_a_window_by_hand(con) -> None:
    nights = [add_run(con, n) for n in (1, 2, 3, 4)]
    gpu_tables(con)
    # Night by night: executions 2, 4, 3, then 5; GPU time 200, 400, 300, then 1000 ns.
    for night, (runs, line_stack) in zip(nights, [(2, 10), (4, 11), (3, 10), (5, 10)]):
        gpu(con, night, line_stack, "kernel", "gemm", [100] * runs)
    # Absent from the third night and the candidate: inside the window's band (0..60), shown where
    # the newest night that has it had it.
    gpu(con, nights[0], 10, "kernel", "early", [50])
    gpu(con, nights[1], 11, "kernel", "early", [60])
    sites = by_name(gpu_time.compare_gpu_time(con, nights, gpu_request()))
    gemm = sites[("kernel", "gemm", "k_train")]
    assert (gemm.baseline_ns, gemm.candidate_ns, gemm.z) == (300, 500, None)
    assert (gemm.baseline_executions, gemm.candidate_executions) == (3, 5)  # the window's median
    assert (gemm.baseline_mean_ns, gemm.candidate_mean_ns) == (100, 100)  # all 9 baseline executions
    assert (gemm.spread.values, gemm.spread.low, gemm.spread.high) == ([200, 400, 300], 200, 400)
    assert (gemm.change, gemm.flagged, gemm.site_line) == ("increased", True, 10)
    early = sites[("kernel", "early", "k_train")]
    assert (early.change, early.baseline_ns, early.site_line, early.spread.values) == ("unchanged", 50, 14, [50, 60, 0])


def test_two_nights_are_a_window(con) -> None:
    nights = [add_run(con, n) for n in (1, 2, 3)]
    gpu_tables(con)
    for night, runs in zip(nights, (2, 4, 3)):
        gpu(con, night, 10, "kernel", "gemm", [100] * runs)
    (gemm,) = gpu_time.compare_gpu_time(con, nights, gpu_request())
    assert (gemm.baseline_ns, gemm.baseline_executions, gemm.z, gemm.change) == (300, 3, None, "unchanged")
    assert (gemm.spread.low, gemm.spread.high) == (200, 400)


def test_totals_per_marker_and_means_per_execution(con) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    gpu_tables(con)
    gpu(con, base, 10, "kernel", "gemm", [1000] * 4)
    gpu(con, cand, 10, "kernel", "gemm", [1000] * 6)
    sets = [run_set(base, markers=2.0), run_set(cand, markers=4.0)]
    (gemm,) = gpu_time.compare_gpu_time(con, sets, gpu_request(per=("user", "step")))
    assert (gemm.baseline_ns, gemm.candidate_ns) == (2000, 1500)
    assert (gemm.baseline_executions, gemm.candidate_executions) == (2, 1.5)
    assert (gemm.baseline_mean_ns, gemm.candidate_mean_ns, gemm.change) == (1000, 1000, "decreased")
    # Without --per the markers a set carries divide nothing.
    (whole,) = gpu_time.compare_gpu_time(con, sets, gpu_request())
    assert (whole.baseline_ns, whole.candidate_ns, whole.candidate_executions) == (4000, 6000, 6)


def test_a_set_of_several_runs_sums_them(con) -> None:
    first, second, cand = add_run(con, 1), add_run(con, 2), add_run(con, 3)
    gpu_tables(con)
    gpu(con, first, 10, "kernel", "gemm", [1000, 3000])
    gpu(con, second, 10, "kernel", "gemm", [1000, 3000])
    gpu(con, cand, 10, "kernel", "gemm", [2000, 2000, 2000, 2000])
    (gemm,) = gpu_time.compare_gpu_time(con, [run_set(first, second), cand], gpu_request())
    assert (gemm.baseline_ns, gemm.baseline_executions, gemm.baseline_mean_ns) == (8000, 4, 2000)
    assert (gemm.z, gemm.change) == (0.0, "unchanged")


# ------------------------------------------------------------------------------------------ environment

VERSIONS = {"python_version": "3.11.9", "torch_version": "2.13.0", "cuda_version": "12.4", "tbpipe_version": "1.0"}


def differences(con, baseline: RunSet, candidate: RunSet) -> list[tuple]:
    return [(e.what, e.baseline, e.candidate) for e in compute.environment(con, baseline, candidate)]


def test_the_same_environment_differs_in_nothing(con) -> None:
    base = add_run(con, 1, {"commit": "a"}, **VERSIONS, sources=["python", "native"])
    cand = add_run(con, 2, {"commit": "a"}, **VERSIONS, sources=["native", "python"])
    assert differences(con, base, cand) == []


@pytest.mark.parametrize("field", [*VERSIONS, "sources"])
def test_each_field_that_differs_is_named(con, field: str) -> None:
    changed = {**VERSIONS, "sources": ["python"]}
    changed[field] = ["native", "python"] if field == "sources" else "9"
    base = add_run(con, 1, **VERSIONS, sources=["python"])
    cand = add_run(con, 2, **changed)
    before = "python" if field == "sources" else VERSIONS[field]
    assert differences(con, base, cand) == [(field, before, "native, python" if field == "sources" else "9")]


def test_a_set_of_runs_lists_its_values_and_a_missing_one_is_none(con) -> None:
    one = add_run(con, 1, python_version="3.12.1", torch_version="2.13.0")
    two = add_run(con, 2, python_version="3.11.9", torch_version="2.13.0")
    cand = add_run(con, 3, python_version="3.11.9", torch_version=None)
    assert differences(con, run_set(one, two), cand) == [
        ("python_version", "3.11.9 | 3.12.1", "3.11.9"),
        ("torch_version", "2.13.0", None),
    ]


def test_labels_that_differ_on_either_side(con) -> None:
    labels = ({"commit": "a", "only_base": "x", "same": "s"}, {"commit": "b", "only_cand": "y", "same": "s"})
    base, cand = add_run(con, 1, labels[0]), add_run(con, 2, labels[1])
    assert differences(con, base, cand) == [
        ("label commit", "a", "b"),
        ("label only_base", "x", None),
        ("label only_cand", None, "y"),
    ]


def module(con, run: RunSet, index: int, key: str, path: str) -> None:
    con.execute("INSERT INTO run_modules VALUES (?, ?, ?, ?, 0, [])", [run.run_ids[0], index, key, path])


@pytest.mark.parametrize("rebuilt", [compute.MODULES_SHOWN - 1, compute.MODULES_SHOWN, compute.MODULES_SHOWN + 1])
def test_rebuilt_modules_up_to_a_limit(con, rebuilt: int) -> None:
    base, cand = add_run(con, 1), add_run(con, 2)
    for run, letter in ((base, "a"), (cand, "b")):
        for i in range(rebuilt):
            module(con, run, i, f"{i:02d}{letter * 20}", f"/x/{letter}/lib{i:02d}.so")
        module(con, run, 100, "same", "/x/libsame.so")  # not rebuilt
        module(con, run, 101, "k", f"/x/only-{letter}.so")  # loaded on one side only
    found = differences(con, base, cand)
    shown = min(rebuilt, compute.MODULES_SHOWN)
    assert found[:shown] == [
        (f"module lib{i:02d}.so", f"{i:02d}aaaaaaaaaa…", f"{i:02d}bbbbbbbbbb…") for i in range(shown)
    ]
    assert found[shown:] == ([("1 more modules rebuilt", None, None)] if rebuilt > compute.MODULES_SHOWN else [])


def test_a_module_s_keys_in_a_set_are_listed_sorted(con) -> None:
    one, two, cand = add_run(con, 1), add_run(con, 2), add_run(con, 3)
    module(con, one, 0, "path:/x/libz.so", "/x/libz.so")
    module(con, two, 0, "0123456789abcdef", "/y/libz.so")
    module(con, cand, 0, "0123456789abcdef", "/x/libz.so")
    assert differences(con, run_set(one, two), cand) == [
        ("module libz.so", "0123456789abcdef, path:/x/libz.so", "0123456789abcdef")
    ]


# ------------------------------------------------------------------------------------------ accepted changes


def site(name: str, flagged: bool = True, key: str = "00000000000000aa") -> SiteChange:
    return SiteChange("op", name, key, "f", "/src/pkg/a.py", 3, "pkg/a.py", 1.0, 9.0, "increased", flagged=flagged)


def entry(site_: str, name: str | None = None, until: dt.date | None = None, reason: str = "why") -> Accepted:
    return Accepted(site_, name, None, until, reason)


def test_accepts_unflag_the_first_matching_live_entry_and_list_the_expired() -> None:
    today = dt.date(2026, 12, 6)
    accept = AcceptList(
        Path("accept.toml"),
        [
            entry("pkg/a.py:f", "old*", today - dt.timedelta(days=1), "expired"),
            entry("pkg/a.py:f", "new*", today, "today still"),
            entry("pkg/a.py:f", "new_*", None, "second"),
            entry("pkg/a.py:f", "quiet", None, "not flagged"),
        ],
    )
    sites = [site("old_op"), site("quiet", flagged=False), site("new_op"), site("other")]
    expired = compute._apply_accepts(sites, accept, today)
    assert expired == ["pkg/a.py:f old* until 2026-12-05: expired"]
    assert [(s.flagged, s.accepted) for s in sites] == [
        (True, None),
        (False, None),  # not flagged: nothing to accept, and the sites after it are still looked at
        (False, "pkg/a.py:f new* until 2026-12-06: today still"),
        (True, None),
    ]
    assert compute._apply_accepts([site("new_op")], None, today) == []
