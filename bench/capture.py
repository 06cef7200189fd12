"""Capture cost, side by side with the anchors, measured in one process.

    python bench/capture.py [--quick]

Prints per-gather cost at Python depths 10/50/200 for python-only, native-only
and combined stacks, next to torch's gather_traceback (when torch is installed)
and traceback.extract_stack, as ratios; then record() amortized at depth 30
with the background flush included, and bytes on disk per event when 1M events
share 1k stacks. Machines are noisy: each number is the best of several rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tbpipe import capture

try:
    from torch._C._profiler import gather_traceback as torch_gather
except ImportError:
    torch_gather = None


def at_depth(depth: int, work: Callable[[], float]) -> float:
    """Runs `work` with `depth` Python frames of this benchmark below it."""
    if depth <= 1:
        return work()
    return at_depth(depth - 1, work)


def per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    def work() -> float:
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, time.perf_counter() - start)
        return best / calls * 1e6

    return work()


def gather_table(quick: bool) -> dict[tuple[str, int], float]:
    calls, rounds = (300, 3) if quick else (3000, 5)
    variants: dict[str, Callable[[], object]] = {
        "tbpipe python-only": lambda: capture.gather(True, False),
        "tbpipe native-only": lambda: capture.gather(False, True),
        "tbpipe combined": lambda: capture.gather(True, True),
        "traceback.extract_stack": traceback.extract_stack,
    }
    if torch_gather is not None:
        variants["torch python-only"] = lambda: torch_gather(python=True, script=False, cpp=False)
        variants["torch native-only"] = lambda: torch_gather(python=False, script=False, cpp=True)
        variants["torch combined"] = lambda: torch_gather(python=True, script=False, cpp=True)
    results = {}
    for depth in (10, 50, 200):
        for name, fn in variants.items():
            slow = name == "traceback.extract_stack"
            results[(name, depth)] = at_depth(
                depth, lambda fn=fn, slow=slow: per_call_us(fn, max(calls // (20 if slow else 1), 10), rounds)
            )
    return results


def print_gather_table(results: dict[tuple[str, int], float]) -> None:
    names = sorted({name for name, _ in results})
    print(f"{'per gather (µs)':28s}" + "".join(f"{'depth ' + str(d):>12s}" for d in (10, 50, 200)))
    for name in names:
        print(f"{name:28s}" + "".join(f"{results[(name, d)]:12.3f}" for d in (10, 50, 200)))
    print()
    for depth in (10, 50, 200):
        ours = results[("tbpipe combined", depth)]
        line = f"depth {depth:3d}: "
        if ("torch combined", depth) in results:
            line += (
                f"combined tbpipe/torch = {ours / results[('torch combined', depth)]:.2f}x (target <= 0.7, goal 0.5); "
            )
            line += f"native-only tbpipe/torch = {results[('tbpipe native-only', depth)] / results[('torch native-only', depth)]:.2f}x; "
        speedup = results[("traceback.extract_stack", depth)] / results[("tbpipe python-only", depth)]
        line += f"python-only is {speedup:.0f}x faster than extract_stack (target >= 20x)"
        print(line)


def record_amortized_us(events: int, depth: int) -> float:
    import tbpipe.capture.sessions  # noqa: F401 - loaded on first use (pyarrow): not part of the timing

    with tempfile.TemporaryDirectory() as out:
        # One session first, untimed: the first write imports what pyarrow loads lazily (pandas too,
        # when it is installed: pyarrow looks for it on the first array made from a Python list), a
        # one-time cost of the process, not of its events.
        with capture.session(out):
            capture.record("kernel_launch", "warm-up")

        def work() -> float:
            start = time.perf_counter()
            with capture.session(out):
                for _i in range(events):
                    capture.record("kernel_launch", "gemm")
            return time.perf_counter() - start

        return at_depth(depth, work) / events * 1e6


def bytes_per_event(events: int, stacks: int) -> tuple[float, int]:
    # `stacks` distinct call sites: one small function each, all calling record.
    namespace: dict[str, object] = {"record": capture.record}
    for i in range(stacks):
        exec(f"def site_{i}():\n    record('kernel_launch', 'kernel_{i % 37}')", namespace)
    sites = [namespace[f"site_{i}"] for i in range(stacks)]
    with tempfile.TemporaryDirectory() as out:
        with capture.session(out):
            for i in range(events):
                sites[(i * 7919) % stacks]()
        run_dir = next(Path(out).iterdir())
        total = sum(p.stat().st_size for p in run_dir.iterdir())
        return total / events, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args()
    print(f"CPython {sys.version.split()[0]}, torch {'present' if torch_gather else 'absent'}, pid {os.getpid()}")
    print_gather_table(gather_table(args.quick))
    events = 20_000 if args.quick else 300_000
    baseline = at_depth(30, lambda: per_call_us(lambda: capture.gather(True, True), 2000, 3))
    amortized = record_amortized_us(events, 30)
    print(
        f"\nrecord() at depth 30, {events} events, flush included: {amortized:.3f} µs/event amortized "
        f"(target <= 1.5 µs); a bare combined gather there costs {baseline:.3f} µs"
    )
    n_events = 100_000 if args.quick else 1_000_000
    per_event, total = bytes_per_event(n_events, 1000)
    print(
        f"{n_events} events sharing 1000 stacks: {total / 1e6:.2f} MB on disk, "
        f"{per_event:.1f} bytes/event (target <= 32)"
    )


if __name__ == "__main__":
    main()
