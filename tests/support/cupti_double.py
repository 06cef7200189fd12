"""The labelled CUPTI TEST DOUBLE (tests/cupti_double/libcupti_double.c): building it, and driving it
from a child interpreter that records with the `cuda` source.

It is not NVIDIA's library and no GPU is involved: it implements the CUPTI entry points tbpipe
calls, plays the CUDA runtime/driver (launch callbacks) and the GPU (activity records the test
queues for the correlation ids of its launches). `tbpipe.capture.cuda` loads it in place of
libcupti through $TBPIPE_CUPTI_LIBRARY, its own library search.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "cupti_double" / "libcupti_double.c"


def build_double(out_dir: Path) -> Path | None:
    """The double as a shared library, built with warnings as errors; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    out = out_dir / "libcupti_double.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(SOURCE), "-lpthread"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


# Run first in the child: loads the double (ctypes.CDLL releases the GIL per call, so callbacks run
# without it, as under CUDA) and wraps what the tests call.
PRELUDE = """
import ctypes, json, os, sys, time
from ctypes import c_char_p, c_int, c_size_t, c_uint32, c_uint64
from tbpipe import _native, capture
double = ctypes.CDLL(os.environ["TBPIPE_CUPTI_LIBRARY"])
double.tbpipe_double_timestamp.restype = c_uint64
double.tbpipe_double_kernel_activity.argtypes = [c_char_p, c_uint32, c_uint64, c_uint64, c_uint32, c_uint32,
                                                 *[c_int] * 9, c_uint32, c_uint64]
double.tbpipe_double_memcpy_activity.argtypes = [c_uint32, c_int, c_uint64, c_uint64, c_uint64, c_uint32, c_uint32,
                                                 c_uint64]
double.tbpipe_double_memset_activity.argtypes = [c_uint32, c_uint64, c_uint64, c_uint64, c_uint32]
double.tbpipe_double_sync_activity.argtypes = [c_uint32, c_int, c_uint64, c_uint64, c_uint32]
double.tbpipe_double_capture_launch.argtypes = [c_char_p, c_uint32, c_uint64, c_uint64]
double.tbpipe_double_graph_add_kernel_node.argtypes = [c_uint64, c_uint64, c_uint32]
double.tbpipe_double_graph_clone_node.argtypes = [c_uint64, c_uint64, c_uint64]
double.tbpipe_double_activity_set_dropped.argtypes = [c_size_t]
double.tbpipe_double_activity_truncate_next.argtypes = [c_size_t]
double.tbpipe_double_activity_pending.restype = c_size_t
HTOD, DTOH = 1, 2

def kernel_record(name, correlation, duration_ns, *, graph=(0, 0), stream=7, running=False):
    \"\"\"The double's GPU ran kernel `name` for the launch with `correlation` (name: bytes kept alive).\"\"\"
    start = double.tbpipe_double_timestamp()
    end = 0 if running else start + duration_ns
    return double.tbpipe_double_kernel_activity(name, correlation, start, end, 0, stream, 4, 2, 1, 128, 1, 1,
                                                40, 1024, 2048, graph[0], graph[1])

def memcpy_record(correlation, copy_kind, size, duration_ns):
    start = double.tbpipe_double_timestamp()
    return double.tbpipe_double_memcpy_activity(correlation, copy_kind, size, start, start + duration_ns, 7, 0, 0)

def memset_record(correlation, size, duration_ns):
    start = double.tbpipe_double_timestamp()
    return double.tbpipe_double_memset_activity(correlation, size, start, start + duration_ns, 7)

def sync_record(correlation, sync_type, duration_ns):
    start = double.tbpipe_double_timestamp()
    return double.tbpipe_double_sync_activity(correlation, sync_type, start, start + duration_ns, 7)
"""
