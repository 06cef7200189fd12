"""The `cuda` source's CUPTI path, end to end, on machines without a GPU.

Most tests load a TEST DOUBLE of libcupti (tests/cupti_double/libcupti_double.c,
built here): a small shared library that implements the CUPTI subscribe/enable
calls and, when the test asks, invokes the registered callback with the callback
data real CUPTI passes for cudaLaunchKernel, cudaLaunchKernelExC,
cuLaunchKernelEx and cudaGraphLaunch (CUpti_CallbackData, functionParams laid out
as in NVIDIA's headers), on the calling thread with the GIL released (ctypes)
or on a native thread. It is not NVIDIA's library. Each test runs in a fresh
interpreter, because a process keeps the first libcupti it loads.

Where a real libcupti or NVIDIA's CUPTI headers are installed, further tests
check the no-GPU message against the real library and tbpipe's CUPTI
declarations against the headers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_python
from support.runs import read_runs

from tbpipe import _native

DOUBLE_SOURCE = Path(__file__).parent / "cupti_double" / "libcupti_double.c"

# Shared by the scripts below: load the double and launch through it.
PRELUDE = """
import ctypes, json, os, sys
from ctypes import c_size_t
from tbpipe import _native, capture
double = ctypes.CDLL(os.environ["TBPIPE_CUPTI_LIBRARY"])      # ctypes.CDLL releases the GIL per call
holding_gil = ctypes.PyDLL(os.environ["TBPIPE_CUPTI_LIBRARY"])  # PyDLL keeps it
RUNTIME, DRIVER = 2, 1
def gemm_launch_site(correlation):
    double.tbpipe_double_cuda_launch_kernel(b"_Z4gemmIfEvPT_S1_", 4, 2, 1, 128, 1, 1, c_size_t(2048),
                                            c_size_t(0x5000), correlation)
"""


@pytest.fixture(scope="module")
def double_library(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the libcupti test double")
    out = tmp_path_factory.mktemp("cupti_double") / "libcupti_double.so"
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(out),
            str(DOUBLE_SOURCE),
            "-lpthread",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def run_with_double(double_library: Path, tmp_path: Path, body: str, *, timeout: float = 60):
    env = {"TBPIPE_CUPTI_LIBRARY": str(double_library), "OUT": str(tmp_path / "runs")}
    return run_python(PRELUDE + textwrap.dedent(body), cwd=tmp_path, env=env, timeout=timeout)


def events(run) -> list[dict]:
    rows = run.tables["events"].drop_columns(["ts"]).to_pylist()
    for row in rows:
        row["attrs"] = json.loads(row["attrs"]) if row["attrs"] else {}
    return rows


def python_frames(run, stack_id: int) -> list[tuple[str, str, int]]:
    code = {c["code_id"]: c for c in run.tables["code"].to_pylist()}
    stack = next(s for s in run.tables["stacks"].to_pylist() if s["stack_id"] == stack_id)
    return [(code[f["code_id"]]["filename"], code[f["code_id"]]["qualname"], f["line"]) for f in stack["python"]]


def test_kernel_launches_are_recorded_with_attributes_and_stack(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        with capture.session(os.environ["OUT"], sources=["cuda"]) as session:
            enabled = {(d, c) for d, c in [(RUNTIME, 211), (RUNTIME, 214), (RUNTIME, 430), (RUNTIME, 269),
                                           (RUNTIME, 311), (DRIVER, 307), (DRIVER, 652), (DRIVER, 477), (DRIVER, 514)]
                       if double.tbpipe_double_enabled(d, c)}
            print("ENABLED", len(enabled))
            gemm_launch_site(41)
            double.tbpipe_double_cuda_launch_kernel_exc(b"exc_kernel", 9, 32, c_size_t(0), c_size_t(2), 42)
            double.tbpipe_double_cu_launch_kernel_ex(b"triton_add_kernel", 3, 2, 64, 512, c_size_t(5), 43)
            double.tbpipe_double_cuda_graph_launch(c_size_t(0xabc0), c_size_t(0), 44)
            print("COUNTERS", json.dumps(_native._cupti_counters()))
        print("SUBSCRIBED_AFTER", double.tbpipe_double_subscribed())
    """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""
    assert "ENABLED 9" in result.stdout
    assert "SUBSCRIBED_AFTER 0" in result.stdout  # stop unsubscribes: Kineto or Nsight may take CUPTI after us
    counters = json.loads(next(t for t in result.stdout.splitlines() if t.startswith("COUNTERS"))[9:])
    assert counters == {"kernel_launches": 3, "graph_launches": 1, "nested_skipped": 1, "not_recorded": 0}

    (run,) = read_runs(tmp_path / "runs")
    assert run.manifest["source_status"] == {"cuda": "recording"}
    rows = events(run)
    assert [(r["kind"], r["name"]) for r in rows] == [
        ("kernel_launch", "_Z4gemmIfEvPT_S1_"),  # the nested driver cuLaunchKernel is not a second event
        ("kernel_launch", "exc_kernel"),
        ("kernel_launch", "triton_add_kernel"),
        ("graph_launch", "cudaGraphLaunch"),
    ]
    gemm, exc, driver_ex, graph = (r["attrs"] for r in rows)
    assert [r["correlation_id"] for r in rows] == [41, 42, 43, 44]  # a column of its own, not an attribute
    assert gemm == {
        "api": "cudaLaunchKernel",
        "cbid": 211,
        "grid": [4, 2, 1],
        "block": [128, 1, 1],
        "shared_mem": 2048,
        "stream": 0x5000,
        "stream_id": 0x5000 + 7,
        "device": 0,
        "context": 1,
    }
    assert (exc["api"], exc["grid"], exc["block"], exc["stream"]) == ("cudaLaunchKernelExC", [9, 1, 1], [32, 1, 1], 2)
    assert (driver_ex["api"], driver_ex["grid"], driver_ex["shared_mem"]) == ("cuLaunchKernelEx", [3, 2, 1], 512)
    assert isinstance(driver_ex["function"], int)
    assert (graph["api"], graph["graph_exec"]) == ("cudaGraphLaunch", 0xABC0)

    # The stack was taken inside the callback, on the launching thread, without the GIL.
    frames = python_frames(run, rows[0]["stack_id"])
    assert frames[0][1] == "gemm_launch_site"
    assert frames[1][1] == "<module>"
    stacks = {s["stack_id"]: s for s in run.tables["stacks"].to_pylist()}
    assert len(stacks[rows[0]["stack_id"]]["native"]) > 3  # libffi/ctypes and the interpreter below the double


def test_launch_from_a_thread_the_interpreter_never_saw(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            assert double.tbpipe_double_cu_launch_on_native_thread(b"worker_kernel", 7) == 0
    """,
    )
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    (row,) = events(run)
    assert (row["kind"], row["name"], row["attrs"]["api"]) == ("kernel_launch", "worker_kernel", "cuLaunchKernel")
    assert python_frames(run, row["stack_id"]) == []
    assert row["thread_id"] != run.manifest["pid"]


def test_callback_never_takes_the_gil(double_library: Path, tmp_path: Path) -> None:
    # PyDLL keeps the GIL while the double's native thread launches and is joined:
    # a callback that waited for the GIL would deadlock here (and time out).
    result = run_with_double(
        double_library,
        tmp_path,
        """
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            for i in range(20):
                assert holding_gil.tbpipe_double_cu_launch_on_native_thread(b"k", i) == 0
            gemm_launch_site(99)
        print("done")
    """,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    assert len(events(run)) == 21


def test_another_cupti_subscriber_is_named_in_one_line(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        double.tbpipe_double_set_subscribe_result(39, b"CUPTI for Kineto")
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            gemm_launch_site(1)                    # not recorded
            capture.record("user", "still recorded")
        print("program ran")
    """,
    )
    assert result.returncode == 0, result.stderr
    assert "program ran" in result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tbpipe: cuda source: another CUPTI client already holds this process (CUPTI for Kineto)")
    assert "one subscriber per process" in line and "Nsight" in line and line.endswith("not recorded")
    (run,) = read_runs(tmp_path / "runs")
    assert run.manifest["source_status"]["cuda"].startswith("not recording: another CUPTI client")
    assert [(r["kind"], r["name"]) for r in events(run)] == [("user", "still recorded")]


def _only_stderr_line_of_a_cuda_session(tmp_path: Path, prelude: str = "") -> str:
    """Runs a program that records one event with the cuda source on; it must run to its end.
    Returns the one line tbpipe wrote to stderr."""
    code = f"""{prelude}
from tbpipe import capture
with capture.session({str(tmp_path / "runs")!r}, sources=["cuda"]):
    capture.record("user", "x")
print("program ran")
"""
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "program ran" in result.stdout
    (line,) = result.stderr.strip().splitlines()
    return line


def test_missing_library_is_one_line_and_the_program_runs_on(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "libcupti.so")
    line = _only_stderr_line_of_a_cuda_session(tmp_path, f"import os\nos.environ['TBPIPE_CUPTI_LIBRARY'] = {missing!r}")
    assert line.startswith("tbpipe: cuda source: no CUPTI library found")
    (run,) = read_runs(tmp_path / "runs")
    assert run.complete and run.tables["events"].num_rows == 1


def test_tbpipe_run_with_the_cuda_source(double_library: Path, tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(PRELUDE + "gemm_launch_site(5)\ngemm_launch_site(6)\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tbpipe.pipeline",
            "run",
            "--out",
            str(tmp_path / "runs"),
            "--source",
            "cuda",
            "--",
            sys.executable,
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TBPIPE_CUPTI_LIBRARY": str(double_library)},
    )
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    rows = events(run)
    assert [r["correlation_id"] for r in rows] == [5, 6]
    frames = python_frames(run, rows[0]["stack_id"])
    assert (frames[0][0], frames[0][1]) == (str(script), "gemm_launch_site")
    assert (frames[1][1], frames[1][2]) == ("<module>", PRELUDE.count("\n") + 1)


def test_overhead_limit_applies_to_native_launches(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        def launches(first, count):
            for i in range(first, first + count):
                gemm_launch_site(i)
        launches(100, 50)  # no subscriber yet: warms CPython's call path (a specialized call is another stack)
        with capture.session(os.environ["OUT"], sources=["cuda"], max_events_per_stack_per_s=3):
            launches(1, 10)
    """,
    )
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    assert [r["correlation_id"] for r in events(run)] == [1, 2, 3]
    assert run.manifest["counters"]["events_rate_limited"] == 7


# -- against NVIDIA's own files, where this machine has them -------------------------------------


def _real_cupti_library() -> str | None:
    from tbpipe.capture.cuda import cupti_candidates

    saved = os.environ.pop("TBPIPE_CUPTI_LIBRARY", None)
    try:
        return next((c for c in cupti_candidates() if os.path.isabs(c) and os.path.exists(c)), None)
    finally:
        if saved is not None:
            os.environ["TBPIPE_CUPTI_LIBRARY"] = saved


def _has_cuda_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_real_cupti_library() is None, reason="no real libcupti on this machine")
@pytest.mark.skipif(_has_cuda_driver(), reason="this machine has a CUDA driver; the no-GPU message is not expected")
def test_real_libcupti_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    line = _only_stderr_line_of_a_cuda_session(tmp_path)
    assert line.startswith("tbpipe: cuda source: cuptiSubscribe failed:")
    assert "no CUDA driver (libcuda.so.1) on this machine" in line


def _cupti_include_dir() -> Path | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        for include in (Path(root) / "include", Path(root) / "extras" / "CUPTI" / "include"):
            if (include / "cupti_callbacks.h").is_file() and (include / "cuda.h").is_file():
                return include
    return None


@pytest.mark.skipif(_cupti_include_dir() is None, reason="NVIDIA's CUPTI headers are not installed here")
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_declared_cupti_abi_matches_nvidia_headers(tmp_path: Path) -> None:
    include = _cupti_include_dir()
    abi = _native._cupti_abi()
    # Activity records are read through the prefix their versions share (CUpti_ActivityKernel9, 10, 11...
    # append fields): check it against the newest version these headers declare, the one CUPTI fills.
    header = (include / "cupti_activity.h").read_text(errors="replace")
    newest = {}
    for record in ("Kernel", "Memcpy", "Memset"):
        versions = [int(v) for v in re.findall(rf"\}}\s*CUpti_Activity{record}(\d+)\s*;", header)]
        newest[record] = f"CUpti_Activity{record}{max(versions)}" if versions else None

    def as_in_headers(name: str) -> str:
        return re.sub(r"CUpti_Activity(Kernel|Memcpy|Memset)\d+", lambda m: newest[m.group(1)] or m.group(0), name)

    lines = ["#include <cstddef>", "#include <cstdio>", "#include <cupti.h>", "int main() {"]
    for name, _ in abi["declared"]:
        lines.append(f'  std::printf("%s=%llu\\n", "{name}", (unsigned long long)({as_in_headers(name)}));')
    for _, _, _api, enumerator, _ in abi["callbacks"]:
        lines.append(f'  std::printf("%s=%llu\\n", "{enumerator}", (unsigned long long)({enumerator}));')
    lines += ["  return 0;", "}"]
    source = tmp_path / "abi.cpp"
    source.write_text("\n".join(lines) + "\n")
    binary = tmp_path / "abi"
    subprocess.run(
        ["g++", "-std=c++17", f"-I{include}", str(source), "-o", str(binary)],
        check=True,
        capture_output=True,
        text=True,
    )
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    real = dict(line.rpartition("=")[::2] for line in output.splitlines())
    declared = {name: str(value) for name, value in abi["declared"]}
    declared.update({enumerator: str(cbid) for _, cbid, _, enumerator, _ in abi["callbacks"]})
    assert {k: real[k] for k in declared} == declared


def test_a_launch_while_another_thread_holds_the_gil_records_its_own_stack(
    double_library: Path, tmp_path: Path
) -> None:
    # The callback runs on the launching thread while it has released the GIL, often the moment
    # another thread takes it. Before 3.12 CPython's "current thread state" is the GIL holder's,
    # whichever thread asks: the stack must still be the launching thread's own.
    result = run_with_double(
        double_library,
        tmp_path,
        """
        import threading
        sys.setswitchinterval(0.0001)  # the GIL changes hands as often as it can
        stop = False
        def spinner_busy_loop():
            count = 0
            while not stop:
                count += 1
        spinner = threading.Thread(target=spinner_busy_loop)
        spinner.start()
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            for c in range(20_000):
                gemm_launch_site(c)
        stop = True
        spinner.join()
    """,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp_path / "runs")
    code = {c["code_id"]: c["qualname"] for c in run.tables["code"].to_pylist()}
    innermost = {
        s["stack_id"]: code[s["python"][0]["code_id"]] if s["python"] else None
        for s in run.tables["stacks"].to_pylist()
    }
    rows = run.tables["events"].select(["thread_id", "stack_id"]).to_pylist()
    assert len(rows) == 20_000
    assert {innermost[r["stack_id"]] for r in rows} == {"gemm_launch_site"}
    assert {r["thread_id"] for r in rows} == {run.manifest["pid"]}
