"""Cost of the `cuda` source's GPU activity path on the CPU, through the labelled CUPTI TEST DOUBLE.

    python bench/gpu_activity.py [--quick]

No GPU is involved (tests/cupti_double/ plays CUPTI, the runtime and the GPU), so this measures
tbpipe's side only: per launch, the launch callback with launches only and with GPU activity on
(one activity record per launch, delivered in buffers as CUPTI's worker would), next to the same
launches with no session (the anchor: ctypes and the double themselves); per record, parsing CUPTI's
buffers into the store, and draining and writing them at flush; and the ingest of a run with and
without its activity parts. The overhead on a real training step is printed by
tests/gpu/check_launch_sites.py on a GPU machine. Each number is the best of a few rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.cupti_double import PRELUDE, build_double  # noqa: E402

CHILD = """
mode, launches, rounds = os.environ["MODE"], int(os.environ["LAUNCHES"]), int(os.environ["ROUNDS"])
NAME = b"_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEvi"
launch = double.tbpipe_double_cuda_launch_kernel
def batch(first):
    # Seconds for the launches; with activity their records are queued first and delivered after
    # (the GPU's side, not timed here).
    if mode == "activity":
        for c in range(first, first + launches):
            kernel_record(NAME, c, 5_000)
    started = time.perf_counter()
    for c in range(first, first + launches):
        launch(NAME, 4, 2, 1, 128, 1, 1, c_size_t(0), c_size_t(0), c)
    elapsed = time.perf_counter() - started
    if mode == "activity":
        double.tbpipe_double_activity_deliver(0)
    return elapsed
session = capture.session(os.environ["OUT"], sources=["cuda"]).start() if mode != "none" else None
best = min(batch(1 + r * launches) for r in range(rounds))
result = {"per_launch_us": best / launches * 1e6}
if mode == "activity":
    session.flush()  # what the rounds recorded, written: the next flush holds only the records below
    # Parsing CUPTI's buffers into the store: records queued, then one flush hands them over.
    for c in range(launches):
        kernel_record(NAME, c, 5_000)
    started = time.perf_counter()
    double.cuptiActivityFlushAll(0)
    result["parse_us_per_record"] = (time.perf_counter() - started) / launches * 1e6
    # Draining the store and writing its part, as the flush thread does (the recorder has nothing new).
    started = time.perf_counter()
    session.flush()
    result["flush_us_per_record"] = (time.perf_counter() - started) / launches * 1e6
if session is not None:
    session.close()
print("RESULT " + json.dumps(result))
"""


def child(double: Path, out: Path, mode: str, launches: int, rounds: int) -> dict:
    env = {
        **os.environ,
        "TBPIPE_CUPTI_LIBRARY": str(double),
        "OUT": str(out),
        "MODE": mode,
        "LAUNCHES": str(launches),
        "ROUNDS": str(rounds),
        "TBPIPE_CUDA_ACTIVITY": "0" if mode == "launches" else "kernel,memcpy,memset",
    }
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(CHILD)], env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise SystemExit(f"{mode}: {result.stderr[-2000:]}")
    line = next(t for t in result.stdout.splitlines() if t.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def ingest_seconds(runs: Path, db: Path) -> float:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "tbpipe.pipeline", "ingest", str(runs), "--db", str(db)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(result.stdout + result.stderr)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    launches, rounds = (5_000, 2) if args.quick else (50_000, 3)
    with tempfile.TemporaryDirectory(prefix="tbpipe-bench-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        double = build_double(tmp)
        if double is None:
            print("cannot run: no C compiler for the CUPTI test double")
            return 2
        results = {mode: child(double, tmp / mode, mode, launches, rounds) for mode in ("none", "launches", "activity")}
        anchor = results["none"]["per_launch_us"]
        print(f"{launches:,} launches through the CUPTI test double, best of {rounds} rounds")
        print(f"  no session (ctypes + the double; anchor)  {anchor:8.2f} us/launch")
        for mode, label in (("launches", "launches only"), ("activity", "launches + GPU activity")):
            cost = results[mode]["per_launch_us"]
            print(f"  {label:41s} {cost:8.2f} us/launch  (+{cost - anchor:.2f} us over the anchor)")
        activity = results["activity"]
        print(f"  parsing CUPTI buffers into the store      {activity['parse_us_per_record']:8.3f} us/record")
        print(f"  drain + write gpu_activity part at flush  {activity['flush_us_per_record']:8.3f} us/record")
        with_gpu = ingest_seconds(tmp / "activity", tmp / "with.duckdb")
        without = ingest_seconds(tmp / "launches", tmp / "without.duckdb")
        print(f"  ingest, launches only                     {without:8.2f} s")
        print(f"  ingest, launches + GPU activity           {with_gpu:8.2f} s  ({with_gpu / without:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
