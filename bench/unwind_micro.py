"""Micro-benchmark: tbpipe's native unwinder against glibc backtrace().

Deepens the native stack by recursing through a C boundary (each level is
list(map(...)), several C frames plus one eval-loop entry), then times, at each
depth:
  * unwind_native() in a C++ loop (tbpipe._native_test._time_unwind), warm cache;
  * glibc backtrace() in a C++ loop (tbpipe._native_test._time_glibc_backtrace);
  * the Python bindings _unwind_pcs() and _glibc_backtrace_pcs(), list building
    included.
A least-squares line over the depths gives the cost per frame and the fixed
cost per call. Usage: python bench/unwind_micro.py [--depths 0,10,20,40,80]
"""

from __future__ import annotations

import argparse
import time

from tbpipe import _native_test as native  # the test extension: the unwinder's timing entry points


def at_depth(depth: int, fn):
    if depth == 0:
        return fn()
    return list(map(lambda _: at_depth(depth - 1, fn), [0]))[0]


def python_loop(fn, iterations: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(iterations):
        fn()
    return (time.perf_counter_ns() - start) / iterations


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(ns per frame, fixed ns) by least squares over (frames, ns)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="0,10,20,40,80")
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    iters = args.iterations

    rows = []
    for depth in depths:

        def measure():
            # Best of a few runs: this is about the code, not about neighbours.
            ours_ns, ours_frames = min(native._time_unwind(iters, False) for _ in range(5))
            glibc_ns, glibc_frames = min(native._time_glibc_backtrace(max(iters // 20, 50)) for _ in range(5))
            py_ours = min(python_loop(native._unwind_pcs, max(iters // 10, 100)) for _ in range(5))
            py_glibc = min(python_loop(native._glibc_backtrace_pcs, max(iters // 50, 20)) for _ in range(5))
            return ours_ns, ours_frames, glibc_ns, glibc_frames, py_ours, py_glibc

        rows.append((depth, *at_depth(depth, measure)))

    print(
        f"{'depth':>5} {'frames':>6} {'unwind ns':>10} {'ns/frame':>8} "
        f"{'glibc ns':>10} {'ns/frame':>8} {'_unwind_pcs':>11} {'_glibc_bt':>10}"
    )
    for depth, ours_ns, ours_frames, glibc_ns, glibc_frames, py_ours, py_glibc in rows:
        print(
            f"{depth:>5} {ours_frames:>6} {ours_ns:>10.0f} {ours_ns / ours_frames:>8.1f} "
            f"{glibc_ns:>10.0f} {glibc_ns / max(glibc_frames, 1):>8.1f} "
            f"{py_ours:>11.0f} {py_glibc:>10.0f}"
        )

    ours_slope, ours_fixed = fit([(r[2], r[1]) for r in rows])
    glibc_slope, glibc_fixed = fit([(r[4], r[3]) for r in rows])
    py_slope, py_fixed = fit([(r[2], r[5]) for r in rows])
    print()
    print(f"unwind_native (C++ loop, warm): {ours_slope:6.1f} ns/frame + {ours_fixed:6.0f} ns/call")
    print(f"glibc backtrace (C++ loop):     {glibc_slope:6.1f} ns/frame + {glibc_fixed:6.0f} ns/call")
    print(f"_unwind_pcs (Python binding):   {py_slope:6.1f} ns/frame + {py_fixed:6.0f} ns/call")


if __name__ == "__main__":
    main()
