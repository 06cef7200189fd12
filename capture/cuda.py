"""The `cuda` source: a `kernel_launch` event for every CUDA kernel launch, through CUPTI.

The work is native (native/cupti.cpp): a CUPTI callback on every runtime and
driver launch entry point (cudaLaunchKernel and its _ptsz, ExC, cooperative
and CUDA 13 `__cudaLaunchKernel` forms, cuLaunchKernel, cuLaunchKernelEx,
cuLaunchCooperativeKernel, legacy cudaLaunch/cuLaunch*), recorded on the
launching thread with its combined stack, the GIL not taken. One launch is one
event: a driver launch made inside a runtime launch is not recorded twice.

Event: kind `kernel_launch`, name = the kernel's symbol as CUPTI reports it
(mangled C++; demangled at ingest), attributes api, cbid, correlation_id (the
id CUPTI activity records and torch.profiler traces carry), grid, block,
shared_mem, stream, stream_id, device, context, and for driver launches
function (the CUfunction, equal to a Triton launch's `function`).

CUDA graphs: cudaGraphLaunch/cuGraphLaunch is one `graph_launch` event (name =
the API, attribute graph_exec), sited where the graph is replayed. Per-kernel
attribution of a replay would take CUPTI's resource callbacks for graph node
creation and cloning (CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED/_CLONED: stacks taken
while the graph is captured or built, keyed by node id), then the activity
API's per-kernel graphNodeId at replay to join each kernel to the stack that
created its node; not done here.

libcupti is found at run time, in this order: $TBPIPE_CUPTI_LIBRARY (alone, if
set); a libcupti already loaded in the process; the nvidia-cuda-cupti wheel in
sys.path (the one torch's CUDA version needs first); the CUDA toolkit
($CUDA_HOME, $CUDA_PATH, /usr/local/cuda); the loader's search path. With no
library, no driver or no GPU, and when another CUPTI client (Kineto, Nsight,
cuda-gdb) holds the process, the source prints one line saying so, records
nothing, and the program runs on.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tbpipe import _native
from tbpipe.capture import after_import

ENV_LIBRARY = "TBPIPE_CUPTI_LIBRARY"

_WHEEL_PATTERNS = ("nvidia/cuda_cupti/lib/libcupti.so*", "nvidia/cu[0-9]*/lib/libcupti.so*")
_TOOLKIT_DIRS = ("extras/CUPTI/lib64", "lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")


@dataclass
class CudaHandle:
    status: str
    library: str | None = None


def start() -> CudaHandle:
    candidates = cupti_candidates()
    result = _native._cupti_start(candidates)
    if result["status"] == "started":
        return CudaHandle("recording", result["library"])
    if result["status"] == "no_library":
        reason = (
            f"no CUPTI library found (tried {os.environ[ENV_LIBRARY]})"
            if os.environ.get(ENV_LIBRARY)
            else "no CUPTI library found (no CUDA toolkit, no nvidia-cuda-cupti wheel, none on the loader path; "
            f"set {ENV_LIBRARY})"
        )
    else:
        reason = result["message"]
    print(f"tbpipe: cuda source: {reason}; CUDA kernel launches are not recorded", file=sys.stderr)
    return CudaHandle(f"not recording: {reason}", result["library"] or None)


def stop(handle: CudaHandle | None = None) -> None:
    if handle is None or handle.status == "recording":
        _native._cupti_stop()


def counters() -> dict[str, int]:
    return dict(_native._cupti_counters())


def cupti_candidates() -> list[str]:
    """Paths and sonames to try, best first."""
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        return [explicit]
    found: list[str] = []
    found += _already_loaded()
    found += _wheel_libraries(_torch_cuda_major())
    found += _toolkit_libraries()
    found += ["libcupti.so", "libcupti.so.13", "libcupti.so.12", "libcupti.so.11.8"]
    return list(dict.fromkeys(found))


def _already_loaded() -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "/libcupti.so" in line})


def _wheel_libraries(cuda_major: str | None) -> list[str]:
    found = []
    for entry in sys.path:
        if not entry or not os.path.isdir(os.path.join(entry, "nvidia")):
            continue
        for pattern in _WHEEL_PATTERNS:
            found += sorted(glob.glob(os.path.join(entry, pattern)))
    if cuda_major:
        # The wheel matching torch's CUDA runtime first: a CUPTI newer than the
        # runtime and driver refuses to subscribe.
        found.sort(key=lambda path: 0 if re.search(rf"\.so\.{cuda_major}(\.|$)", path) else 1)
    return found


def _toolkit_libraries() -> list[str]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = []
    for root in dict.fromkeys(r for r in roots if r):
        for sub in _TOOLKIT_DIRS:
            found += sorted(glob.glob(os.path.join(root, sub, "libcupti.so*")))
    return found


def _torch_cuda_major() -> str | None:
    """Major CUDA version torch was built with, read without importing torch."""
    torch = after_import.fully_imported("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    if version is None:
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
            locations = list(spec.submodule_search_locations or []) if spec else []
        except (ImportError, ValueError):
            locations = []
        for location in locations:
            try:
                text = Path(location, "version.py").read_text()
            except OSError:
                continue
            match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+)", text, re.MULTILINE)
            if match:
                version = match.group(1)
                break
    return str(version).split(".")[0] if version else None
