"""Overhead control: the session's sampling rate and per-stack rate limit, and their manifest counters."""

from __future__ import annotations

import time
from pathlib import Path

from support.runs import read_runs

from tbpipe import _native_test, capture


def site_a() -> None:
    capture.record("user", "a")


def site_b() -> None:
    capture.record("user", "b")


def test_sampling_keeps_about_the_rate_and_counts_the_rest(out_dir: Path) -> None:
    with capture.session(out_dir, sample_rate=0.25) as session:
        for _ in range(8000):
            site_a()
    (run,) = read_runs(out_dir)
    counters = run.manifest["counters"]
    assert counters["events_recorded"] + counters["events_sampled_out"] == 8000
    assert 1700 <= counters["events_recorded"] <= 2300  # 2000 expected, sd ~39
    assert counters["events_written"] == counters["events_recorded"]
    assert counters["events_rate_limited"] == 0 and counters["events_dropped"] == 0
    assert run.manifest["capture"]["sample_rate"] == 0.25
    assert session.sample_rate == 0.25


def burst(site, count: int) -> None:
    for _ in range(count):
        site()


def test_per_stack_limit_keeps_n_per_second_per_stack(out_dir: Path) -> None:
    # CPython specializes a call site after a few runs and its frames then report
    # another instruction offset: one call path, two stacks. Warm up first so the
    # counts below are exact (unwarmed, a site may get its budget twice).
    burst(site_a, 100)
    burst(site_b, 100)
    with capture.session(out_dir, max_events_per_stack_per_s=5):
        burst(site_a, 100)
        burst(site_b, 100)
        time.sleep(1.1)  # a new window
        burst(site_a, 100)
    (run,) = read_runs(out_dir)
    names = run.tables["events"]["name"].to_pylist()
    assert names == ["a"] * 5 + ["b"] * 5 + ["a"] * 5
    counters = run.manifest["counters"]
    assert counters["events_rate_limited"] == 285
    assert counters["events_recorded"] == 15
    assert run.tables["stacks"].num_rows == 3  # a stack whose events were all limited is never written
    assert run.manifest["capture"]["max_events_per_stack_per_s"] == 5


def native_launches(count: int) -> None:
    for _ in range(count):
        _native_test.record_with_gil_released("kernel_launch", "k", '{"grid": [1, 1, 1]}')


def test_native_source_path_is_limited_too(out_dir: Path) -> None:
    native_launches(100)  # warm up (see above)
    with capture.session(out_dir, max_events_per_stack_per_s=2):
        native_launches(10)
    (run,) = read_runs(out_dir)
    assert run.tables["events"].num_rows == 2
    assert run.manifest["counters"]["events_rate_limited"] == 8


def test_limits_reset_with_each_session(out_dir: Path) -> None:
    with capture.session(out_dir / "one", sample_rate=0.5, max_events_per_stack_per_s=1):
        for _ in range(50):
            site_a()
    with capture.session(out_dir / "two"):
        for _ in range(50):
            site_a()
    (two,) = read_runs(out_dir / "two")
    assert two.tables["events"].num_rows == 50
    assert two.manifest["counters"]["events_sampled_out"] == 0
    assert two.manifest["counters"]["events_rate_limited"] == 0
