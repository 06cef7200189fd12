"""A workload at known lines: each `record` notes its line in `LINES` as it runs, and the ingest
tests expect the call sites at those lines of this file. Keep each call and its note on one line."""

from __future__ import annotations

import sys

from tbpipe import capture

LINES: dict[str, int] = {}


def _here() -> int:
    return sys._getframe(1).f_lineno


def launch_gemm(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "gemm", grid=1); LINES["gemm"] = _here()  # noqa: E702  # fmt: skip


def launch_pair() -> None:
    capture.record("kernel_launch", "gemm", grid=2); LINES["pair_gemm"] = _here()  # noqa: E702  # fmt: skip
    capture.record("op", "aten::mm"); LINES["pair_mm"] = _here()  # noqa: E702  # fmt: skip


def _key(value: int) -> int:
    capture.record("kernel_launch", "sort_kernel"); LINES["sort"] = _here()  # noqa: E702  # fmt: skip
    return -value


def workload(library) -> None:
    launch_gemm(7)
    for _ in range(3):
        launch_pair()
    library.launch("softmax", 5); LINES["softmax"] = _here()  # noqa: E702  # fmt: skip
    sorted(range(4), key=_key)  # a C function calling back into Python


LIBRARY = """
from tbpipe.capture import record


def launch(name, count):
    for _ in range(count):
        record("kernel_launch", name)  # line 7
"""


LIBRARY_LINE = 7
