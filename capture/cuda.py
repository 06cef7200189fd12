"""The `cuda` source: a `kernel_launch` event for every CUDA kernel launch, through CUPTI.

The work is native (native/cupti.cpp): a CUPTI callback on every runtime and
driver launch entry point (cudaLaunchKernel and its _ptsz, ExC, cooperative
and CUDA 13 `__cudaLaunchKernel` forms, cuLaunchKernel, cuLaunchKernelEx,
cuLaunchCooperativeKernel, legacy cudaLaunch/cuLaunch*), recorded on the
launching thread with its combined stack, the GIL not taken. One launch is one
event: a driver launch made inside a runtime launch is not recorded twice.

Event: kind `kernel_launch`, name = the kernel's symbol as CUPTI reports it
(mangled C++; demangled at ingest), its correlation_id (the id CUPTI activity
records and torch.profiler traces carry) in the events' column of that name,
attributes api, cbid, grid, block, shared_mem, stream, stream_id, device,
context, and for driver launches function (the CUfunction, equal to a Triton
launch's `function`).

CUDA graphs: cudaGraphLaunch/cuGraphLaunch is one `graph_launch` event (name =
the API, attribute graph_exec), sited where the graph is replayed.

GPU time (native/cupti_activity.cpp): the source also records CUPTI activity
records -- kernel executions (CONCURRENT_KERNEL), memory copies and sets, and
on request synchronizations -- into the run's `gpu_activity` parts: GPU start
and end, device, context, stream, grid, block, registers, shared memory, and
for a node of a replayed graph its graph and node ids. Each record carries the
correlation id of the API call that caused it, which the launch event carries
in its `correlation_id` column: the ingest joins them, so every kernel's
GPU time lands on the call site that launched it. Copies and sets become
`memcpy` / `memset` events (name = the API) for the same reason. The kernels
of a replayed graph carry the graph launch's correlation id (its replay site)
and their node id; graph nodes are followed as CUPTI makes and clones them
(`gpu_graph_nodes` parts), so a node made while a launch was being captured
(torch.cuda.graph, stream capture) leads back to that launch's event: the
site where the graph was captured. $TBPIPE_CUDA_ACTIVITY chooses the kinds:
a comma list of kernel, memcpy, memset, sync; `all`; or `0`/`off` for
launches only. Default: kernel,memcpy,memset.

CUPTI's activity buffers belong to the process, not to a subscriber: a
torch.profiler session started while tbpipe records takes them over (the
records of that time go to the profiler).

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
from tbpipe.capture.errors import SourceError

ENV_LIBRARY = "TBPIPE_CUPTI_LIBRARY"
ENV_ACTIVITY = "TBPIPE_CUDA_ACTIVITY"
ACTIVITY_KINDS = ("kernel", "memcpy", "memset", "sync")
DEFAULT_ACTIVITY_KINDS = ("kernel", "memcpy", "memset")

_WHEEL_PATTERNS = ("nvidia/cuda_cupti/lib/libcupti.so*", "nvidia/cu[0-9]*/lib/libcupti.so*")
_TOOLKIT_DIRS = ("extras/CUPTI/lib64", "lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")


@dataclass
class CudaHandle:
    status: str
    library: str | None = None
    activity_kinds: tuple[str, ...] = ()  # GPU activity recorded


def activity_kinds() -> list[str]:
    """The GPU activity kinds $TBPIPE_CUDA_ACTIVITY asks for (SourceError for one it does not know)."""
    text = os.environ.get(ENV_ACTIVITY)
    if text is None:
        return list(DEFAULT_ACTIVITY_KINDS)
    text = text.strip().lower()
    if text in ("", "0", "off", "none", "no", "false"):
        return []
    if text in ("1", "on", "yes", "true", "default"):
        return list(DEFAULT_ACTIVITY_KINDS)
    if text == "all":
        return list(ACTIVITY_KINDS)
    kinds = list(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kinds if k not in ACTIVITY_KINDS]
    if unknown:
        raise SourceError(
            f"{ENV_ACTIVITY}={os.environ[ENV_ACTIVITY]!r}: unknown GPU activity kind {unknown[0]!r} "
            f"(kinds: {', '.join(ACTIVITY_KINDS)}; all; 0 or off for launches only)"
        )
    return kinds


def start() -> CudaHandle:
    kinds = activity_kinds()  # a bad setting fails the session before CUPTI is touched
    candidates = cupti_candidates()
    result = _native._cupti_start(candidates)
    if result["status"] == "started":
        handle = CudaHandle("recording", result["library"])
        if kinds:
            _start_activity(handle, kinds)
        return handle
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


def _start_activity(handle: CudaHandle, kinds: list[str]) -> None:
    activity = _native._cupti_activity_start(kinds)
    handle.activity_kinds = tuple(activity["kinds"])
    if activity["status"] != "started":
        print(
            f"tbpipe: cuda source: {activity['message']}; GPU time is not recorded (kernel launches are)",
            file=sys.stderr,
        )
        handle.status = f"recording launches only: {activity['message']}"
    elif activity["message"]:  # some kinds refused
        print(f"tbpipe: cuda source: {activity['message']}; the other GPU activity is recorded", file=sys.stderr)


def stop(handle: CudaHandle | None = None) -> None:
    if handle is None or handle.status == "recording":
        _native._cupti_stop()


def counters() -> dict[str, int]:
    return dict(_native._cupti_counters())


def activity_counters() -> dict[str, int]:
    """GPU activity records stored, dropped by CUPTI, lost by tbpipe, malformed; buffers; graph nodes."""
    return dict(_native._gpu_activity_counters())


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
