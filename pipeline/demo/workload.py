"""Demo program captured by `tbpipe demo`: fake "kernel launches" from a tiny model.

The launches happen inside Python callbacks that C code calls (`sorted` with a
key function, libc `qsort` through ctypes), so the combined tracebacks show
Python frames interleaved with the native frames that called them.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from tbpipe.capture import record

_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))


def launch(kernel: str, grid: int) -> None:
    record("kernel_launch", kernel, grid=grid, block=128)


def attention(scores: list[int]) -> list[int]:
    def key(value: int) -> int:
        launch("softmax_kernel", grid=len(scores))
        return -value

    return sorted(scores, key=key)


def feed_forward(values: list[int]) -> list[int]:
    def compare(a, b) -> int:
        launch("gemm_kernel", grid=4)
        return a[0] - b[0]

    array = (ctypes.c_int * len(values))(*values)
    _libc.qsort(array, len(values), ctypes.sizeof(ctypes.c_int), _COMPARE(compare))
    return list(array)


def layer(values: list[int]) -> list[int]:
    return feed_forward(attention(values))


def main(steps: int = 20) -> None:
    values = [7, 3, 9, 1, 4, 8]
    for _ in range(steps):
        values = layer(values)
        launch("allreduce_kernel", grid=1)


if __name__ == "__main__":
    main()
