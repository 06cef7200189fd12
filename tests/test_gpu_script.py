"""The GPU check script (tests/gpu/check_launch_sites.py) where no GPU is needed: it must compile, say
it cannot run without a CUDA device, and its analysis of a run -- GPU time per line joined by
correlation id, graph nodes followed to their replay and capture lines, the 5% agreement, the
overhead lines -- must be right on a run recorded through the labelled CUPTI TEST DOUBLE
(tests/cupti_double/), with the double's durations standing in for the GPU's."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TBPIPE
from support.cupti_double import PRELUDE, build_double

SCRIPT = Path(__file__).parent / "gpu" / "check_launch_sites.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("check_launch_sites", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_compiles_and_declines_without_a_gpu(tmp_path: Path) -> None:
    py_compile.compile(str(SCRIPT), doraise=True)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--skip-overhead", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.startswith("cannot run:")


# The shape of the script's GPU-time workload, on the double: two timed sites, a graph of three nodes
# captured in the session (one made by the graph API) and replayed three times.
WORKLOAD = """
MM, ADD_K, N1, N2, N3 = b"mm_kernel", b"add_kernel", b"node_one", b"node_two", b"node_three"

def mm_site(c):
    double.tbpipe_double_cuda_launch_kernel(MM, 4, 2, 1, 128, 1, 1, c_size_t(0), c_size_t(0), c)  # MATMUL

def add_site(c):
    double.tbpipe_double_cuda_launch_kernel(ADD_K, 4, 2, 1, 128, 1, 1, c_size_t(0), c_size_t(0), c)  # ADD

def capture_graph():
    double.tbpipe_double_capture_launch(N1, 900, 3, 31)  # CAPTURE ONE
    double.tbpipe_double_capture_launch(N2, 901, 3, 32)  # CAPTURE TWO
    double.tbpipe_double_graph_add_kernel_node(3, 33, 0)
    for original, clone in ((31, 41), (32, 42), (33, 43)):
        double.tbpipe_double_graph_clone_node(4, original, clone)

def replay(c):
    double.tbpipe_double_cuda_graph_launch(c_size_t(0xAB), c_size_t(0), c)  # REPLAY

with capture.session(os.environ["OUT"], sources=["cuda"]):
    for i in range(4):
        mm_site(10 + i)
        kernel_record(MM, 10 + i, 2_000_000)
        add_site(20 + i)
        kernel_record(ADD_K, 20 + i, 750_000)
    capture_graph()
    for c in (50, 51, 52):
        replay(c)
        for name, node in ((N1, 41), (N2, 42), (N3, 43)):
            kernel_record(name, c, 1_000, graph=(4, node))
    double.tbpipe_double_activity_deliver(2)
"""


@pytest.fixture(scope="module")
def recorded(script, tmp_path_factory, symbol_cache: Path):
    tmp = tmp_path_factory.mktemp("gpu_script")
    double = build_double(tmp)
    if double is None:
        pytest.skip("no C compiler to build the libcupti test double")
    source = tmp / "workload.py"
    source.write_text(PRELUDE + textwrap.dedent(WORKLOAD))
    env = {**os.environ, "TBPIPE_CUPTI_LIBRARY": str(double), "OUT": str(tmp / "runs")}
    result = subprocess.run(
        [sys.executable, str(source)], cwd=tmp, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = [p for p in (tmp / "runs").iterdir()]
    db = tmp / "script.duckdb"
    loaded = subprocess.run(
        [*TBPIPE, "ingest", str(tmp / "runs"), "--db", str(db)],
        capture_output=True,
        text=True,
        env={**os.environ, "TBPIPE_CACHE_DIR": str(symbol_cache)},
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    return script.Run(run_dir, source_file=str(source)), db, str(source)


def test_gpu_time_per_line_from_the_raw_run_and_from_the_database(script, recorded) -> None:
    run, db, source = recorded
    mm, add = script.line_of("MATMUL", source), script.line_of("ADD", source)
    raw = script.gpu_time_by_line(run)
    assert raw[mm] == (4, 8_000_000) and raw[add] == (4, 3_000_000)
    from_db = script.database_gpu_time_by_line(db, source)
    assert from_db[mm] == raw[mm] and from_db[add] == raw[add]
    # The 5% agreement: CUDA events 4% off pass, 6% off fail.
    assert script.agreement({mm: 8_000_000 * 1.04, add: 3_000_000 * 0.96}, raw, 0.05) == []
    bad = script.agreement({mm: 8_000_000 * 1.06, add: 3_000_000}, raw, 0.05)
    assert len(bad) == 1 and bad[0].startswith(f"line {mm}: tbpipe 8.000 ms")


def test_graph_kernels_followed_to_their_replay_and_capture_lines(script, recorded) -> None:
    run, _db, source = recorded
    nodes = script.graph_nodes_by_node(run)
    replay = script.line_of("REPLAY", source)
    assert {node: (e["executions"], e["replay_lines"], e["capture_line"]) for node, e in nodes.items()} == {
        41: (3, {replay}, script.line_of("CAPTURE ONE", source)),
        42: (3, {replay}, script.line_of("CAPTURE TWO", source)),
        43: (3, {replay}, None),  # made by the graph API, not by a captured launch
    }


def test_overhead_lines_compare_with_the_source_off(script) -> None:
    lines = script.overhead_lines({"off": [0.010, 0.011, 0.009], "launches": [0.0104] * 3, "activity": [0.0112] * 3})
    assert lines[0] == "off: median step 10.000 ms over 3 steps, 1.000x"
    assert lines[1] == "launches: median step 10.400 ms over 3 steps, 1.040x"
    assert lines[2] == "activity: median step 11.200 ms over 3 steps, 1.120x (target <= 1.10x: NOT met)"
