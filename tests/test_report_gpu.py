"""tbpipe report's second metric, GPU time per site, over nights captured with the `cuda` source driving
the labelled CUPTI TEST DOUBLE (tests/cupti_double/; the durations are the double's numbers, chosen
here, never measured), ingested for real.

Counts are compared exactly and keep their verdict; GPU time gets its own: against one baseline a
site is slower when its time grew past the thresholds and it ran more often or its per-execution
time moved past its spread; against a window, outside the window's band.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import TBPIPE, run_python
from support.cupti_double import PRELUDE, build_double

GEMM = "_Z4gemmIfEvPT_S1_"

NIGHT = """
GEMM, SOFTMAX = b"_Z4gemmIfEvPT_S1_", b"softmax_kernel"
durations = json.loads(os.environ["DURATIONS"])
launches = json.loads(os.environ["LAUNCHES"])

def gemm_site(c):
    double.tbpipe_double_cuda_launch_kernel(GEMM, 4, 2, 1, 128, 1, 1, c_size_t(0), c_size_t(0), c)

def softmax_site(c):
    double.tbpipe_double_cu_launch_kernel_ex(SOFTMAX, 3, 2, 64, 0, c_size_t(0), c)

labels = {"suite": os.environ["SUITE"], "commit": os.environ["COMMIT"]}
with capture.session(os.environ["OUT"], labels=labels, sources=["cuda"]):
    correlation = 1
    for key, site, name in (("gemm", gemm_site, GEMM), ("softmax", softmax_site, SOFTMAX)):
        for i in range(launches[key]):
            site(correlation)
            # The same spread of durations every night, around the night's mean.
            assert kernel_record(name, correlation, int(durations[key] * (1 + 0.02 * (i % 5 - 2)))) == 1
            correlation += 1
    double.tbpipe_double_activity_deliver(1)
"""


def _night(double: Path, tmp: Path, suite: str, commit: str, gemm_ns: int, softmax_ns: int, softmax_runs: int = 10):
    env = {
        "TBPIPE_CUPTI_LIBRARY": str(double),
        "OUT": str(tmp / "runs"),
        "SUITE": suite,
        "COMMIT": commit,
        "DURATIONS": json.dumps({"gemm": gemm_ns, "softmax": softmax_ns}),
        "LAUNCHES": json.dumps({"gemm": 20, "softmax": softmax_runs}),
    }
    result = run_python(PRELUDE + textwrap.dedent(NIGHT), cwd=tmp, env=env)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def nights(tmp_path_factory, symbol_cache: Path) -> Path:
    """Nights of two suites, ingested into one database."""
    tmp = tmp_path_factory.mktemp("gpu_nights")
    double = build_double(tmp)
    if double is None:
        pytest.skip("no C compiler to build the libcupti test double")
    _night(double, tmp, "pair", "c1", 10_000, 3_000)
    _night(double, tmp, "pair", "c2", 13_000, 3_050)  # gemm 30% slower per run; softmax within noise
    _night(double, tmp, "pair", "c3", 10_000, 3_000, softmax_runs=20)  # softmax runs twice as often
    for night, factor in enumerate((1.00, 1.06, 0.95, 1.03, 0.98), start=1):
        _night(double, tmp, "window", f"w{night}", int(10_000 * factor), 3_000)
    _night(double, tmp, "window", "w6", 10_500, 4_200)  # gemm inside its band, softmax 40% out of it
    db = tmp / "nights.duckdb"
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache))
    loaded = subprocess.run(
        [*TBPIPE, "ingest", str(tmp / "runs"), "--db", str(db)], capture_output=True, text=True, env=env
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    return db


def report(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TBPIPE, "report", "--db", str(db), *args], capture_output=True, text=True)


def report_json(db: Path, *args: str) -> dict:
    result = report(db, "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def gpu_by_name(data: dict) -> dict[str, dict]:
    return {s["name"]: s for s in data["gpu_time"]["sites"]}


def test_slower_kernels_are_flagged_while_the_counts_stay_unchanged(nights: Path) -> None:
    data = report_json(nights, "--candidate", "commit=c2", "--baseline", "commit=c1")
    # The counts: the same launches, nothing flagged; their verdict does not mention GPU time.
    assert data["ok"] is True and data["verdict"].startswith("No regressions")
    assert {s["change"] for s in data["sites"]} == {"unchanged"}
    gpu = data["gpu_time"]
    assert gpu["ok"] is False
    assert gpu["verdict"] == "GPU time: 1 site slower (2 sites compared)"
    assert [s["name"] for s in gpu["regressions"]] == [GEMM]
    gemm, softmax = gpu_by_name(data)[GEMM], gpu_by_name(data)["softmax_kernel"]
    assert (gemm["change"], gemm["launch_kind"], gemm["site_function"]) == ("increased", "kernel_launch", "gemm_site")
    assert (gemm["baseline_ns"], gemm["candidate_ns"]) == (200_000, 260_000)
    assert gemm["relative"] == pytest.approx(0.30)
    assert (gemm["baseline_mean_ns"], gemm["candidate_mean_ns"]) == (10_000, 13_000)
    assert gemm["z"] > 3  # per-execution times moved far past their own spread
    assert gemm["traceback"] and any(f["function"] == "gemm_site" for f in gemm["traceback"])
    assert (softmax["change"], softmax["flagged"]) == ("unchanged", False)  # +1.7%: below the 10% threshold
    assert gpu["thresholds"] == {"relative": 0.10, "absolute_ns": 0.0}

    # Exit status: the counts' flag is untouched; GPU time fails only when asked to.
    assert report(nights, "--candidate", "commit=c2", "--baseline", "commit=c1", "--fail-on-regression").returncode == 0
    assert (
        report(nights, "--candidate", "commit=c2", "--baseline", "commit=c1", "--fail-on-gpu-regression").returncode
        == 1
    )
    looser = report_json(nights, "--candidate", "commit=c2", "--baseline", "commit=c1", "--gpu-threshold-rel", "0.5")
    assert looser["gpu_time"]["ok"] is True
    higher = report_json(nights, "--candidate", "commit=c2", "--baseline", "commit=c1", "--gpu-threshold-abs-us", "100")
    assert higher["gpu_time"]["ok"] is True  # +60 µs in all is below 100 µs


def test_more_executions_make_more_gpu_time_beside_the_count_change(nights: Path) -> None:
    data = report_json(nights, "--candidate", "commit=c3", "--baseline", "commit=c1")
    counts = {s["name"]: s for s in data["sites"]}
    assert (counts["softmax_kernel"]["change"], counts["softmax_kernel"]["flagged"]) == ("increased", True)
    softmax, gemm = gpu_by_name(data)["softmax_kernel"], gpu_by_name(data)[GEMM]
    assert (softmax["change"], softmax["flagged"]) == ("increased", True)
    assert (softmax["baseline_executions"], softmax["candidate_executions"]) == (10, 20)
    assert softmax["baseline_mean_ns"] == softmax["candidate_mean_ns"]  # each run as fast as before
    assert gemm["change"] == "unchanged" and gemm["z"] == 0.0

    markdown = report(nights, "--candidate", "commit=c3", "--baseline", "commit=c1").stdout
    assert markdown.splitlines()[0].startswith(":x: **1 regression ")  # the counts' verdict comes first, as before
    assert "**GPU time: 1 site slower (2 sites compared)**" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| increased (+100%), runs 10 -> 20"))
    assert "`softmax_kernel`" in row and "30 µs | 60 µs | 3 µs -> 3 µs |" in row


def test_against_a_window_only_times_outside_its_band_are_flagged(nights: Path) -> None:
    data = report_json(nights, "--candidate", "commit=w6", "--baseline-window", "5", "--label", "suite=window")
    assert data["ok"] is True  # same launches every night
    gpu = gpu_by_name(data)
    gemm, softmax = gpu[GEMM], gpu["softmax_kernel"]
    assert gemm["spread"]["method"] == "median-mad" and len(gemm["spread"]["values"]) == 5
    assert gemm["spread"]["low"] < gemm["candidate_ns"] < gemm["spread"]["high"]
    assert (gemm["change"], gemm["flagged"], gemm["z"]) == ("unchanged", False, None)
    assert (softmax["change"], softmax["flagged"]) == ("increased", True)
    assert softmax["relative"] == pytest.approx(0.40)
    assert data["gpu_time"]["verdict"] == "GPU time: 1 site slower (2 sites compared)"

    html = report(nights, "--candidate", "commit=w6", "--baseline-window", "5", "--label", "suite=window", "-f", "html")
    assert html.returncode == 0, html.stderr
    assert 'id="gpu-verdict" class="verdict bad"' in html.stdout and 'id="gpu-regressions"' in html.stdout
    assert html.stdout.count('<svg class="trend"') >= 1


def test_an_accept_entry_lets_a_slower_site_pass(nights: Path, tmp_path: Path) -> None:
    accepted = tmp_path / "accepted.toml"
    accepted.write_text(f'[[accept]]\nsite = "{_gemm_site(nights)}"\nname = "_Z4gemm*"\nreason = "bigger tiles"\n')
    data = report_json(nights, "--candidate", "commit=c2", "--baseline", "commit=c1", "--accept", str(accepted))
    assert data["gpu_time"]["ok"] is True
    (entry,) = data["gpu_time"]["accepted"]
    assert entry["name"] == GEMM and "bigger tiles" in entry["accepted"]


def _gemm_site(db: Path) -> str:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(f"SELECT DISTINCT site_key FROM kernel_gpu_time_sites WHERE name = '{GEMM}'").fetchone()[0]
    finally:
        con.close()
