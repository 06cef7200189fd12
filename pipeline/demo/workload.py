"""Demo program captured by `tbpipe demo`: fake "kernel launches" from a tiny model.

Some launches happen inside Python callbacks that C code calls (`sorted` with a key function,
libc `qsort` through ctypes), so the combined tracebacks show Python frames interleaved with the
native frames that called them. Each launch is recorded on its own line, so the call sites the
demo prints point at exact lines of this file.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from tbpipe.capture import record

_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))

VALUES = [7, 3, 9, 1, 4, 8]
STEPS = 20


def attention(scores: list[int]) -> list[int]:
    def key(value: int) -> int:
        record("kernel_launch", "softmax_kernel", grid=len(scores), block=128)  # site: attention key
        return -value

    return sorted(scores, key=key)


def feed_forward(values: list[int]) -> list[int]:
    def compare(a, b) -> int:
        record("kernel_launch", "gemm_kernel", grid=4, block=128)  # site: feed_forward compare
        return a[0] - b[0]

    array = (ctypes.c_int * len(values))(*values)
    _libc.qsort(array, len(values), ctypes.sizeof(ctypes.c_int), _COMPARE(compare))
    record("kernel_launch", "gemm_kernel", grid=1, block=64)  # site: feed_forward epilogue
    return list(array)


def layer(values: list[int]) -> list[int]:
    return feed_forward(attention(values))


def main(steps: int = STEPS) -> None:
    values = list(VALUES)
    for _ in range(steps):
        values = layer(values)
        record("kernel_launch", "allreduce_kernel", grid=1, block=32)  # site: main


if __name__ == "__main__":
    main()
