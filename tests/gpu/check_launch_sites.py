"""GPU check of the `cuda`, `torch-ops` and `triton` sources: run on a machine with an NVIDIA GPU.

    pip install -e .            # tbpipe, in an environment with a CUDA build of torch (and triton, optional)
    python tests/gpu/check_launch_sites.py [--steps 3] [--out DIR]

Takes a minute or two (most of it Triton's first compile). It trains a small
CUDA model (forward + backward + SGD) for a few steps, launches a Triton kernel
if Triton imports, and replays a CUDA graph, all under a tbpipe session with
the cuda, torch-ops (and triton) sources on; then it checks:

  1. the cuda source subscribed to CUPTI and recorded launches, none dropped;
  2. every kernel that torch.profiler (Kineto, CUPTI's activity API) saw is
     matched by a launch event: by correlation id when the profiler could run
     inside the session, else (CUPTI allows one subscriber: the session is closed
     first) by kernel name and count over the same steps run again;
  3. every kernel launch event has a call site in this script: directly (Python
     frames on the launching thread), or for the autograd worker's backward
     launches (no Python frames) through the torch-ops link: the op that ran
     the launch (same thread, just before) -> its bwd_seq -> the forward op with
     that seq -> that op's site; AccumulateGrad has no sequence number and is
     sited at the main thread's last event before it (the backward() call);
  4. Triton: one triton_launch per launch with grid and a site at the launch
     line, and a cuda launch event with the same CUfunction;
  5. a replayed CUDA graph is one graph_launch event per replay, at the replay line;
  6. torch.compile (Inductor, Triton kernels): after `tbpipe ingest`, the Triton launches and the
     CUDA launches of the compiled module are sited at the lines of its forward that produced them
     (Inductor's line maps, recorded as the run's code_origins), none in generated code, and the
     compile of the module is a `compile` event at the line that first called it;
  7. (information) what tbpipe says when it subscribes while torch.profiler runs.

Prints one PASS/FAIL line per check and a RESULT line; exits 0 on PASS, 1 on FAIL,
2 when the machine has no usable GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

# Kineto finalizes CUPTI when a profile ends unless told not to; that would also
# end tbpipe's subscription in the middle of the check.
os.environ.setdefault("TEARDOWN_CUPTI", "0")

THIS_FILE = str(Path(__file__).resolve())
RESULTS: list[tuple[str, str, str]] = []  # (PASS|FAIL|INFO|SKIP, check, detail)


def report(status: str, check: str, detail: str = "") -> None:
    RESULTS.append((status, check, detail))
    print(f"[{status}] {check}" + (f": {detail}" if detail else ""), flush=True)


def line_of(marker: str) -> int:
    """Line number in this file of the line ending with `# <marker>`."""
    for number, text in enumerate(Path(THIS_FILE).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise LookupError(marker)


# -- the workload --------------------------------------------------------------------------------


def make_training(torch):
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)  # MODEL LINE
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()  # BACKWARD LINE
        optimizer.step()

    return step


def make_triton_kernel(torch):
    try:
        import triton
        import triton.language as tl
    except Exception as error:  # not installed, or broken in this environment
        return None, f"{type(error).__name__}: {error}"

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        total = tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, total, mask=mask)

    a = torch.randn(4096, device="cuda")
    b = torch.randn(4096, device="cuda")
    out = torch.empty_like(a)

    def launch() -> None:
        add_kernel[(4,)](a, b, out, a.numel(), BLOCK=1024)  # TRITON LINE

    launch()  # compile outside the session
    torch.cuda.synchronize()
    if not torch.allclose(out, a + b):
        return None, "the Triton kernel computed a wrong result"
    return launch, triton.__version__


def make_graph(torch):
    static_in = torch.randn(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            static_in * 2 + 1  # warm-up on a side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = static_in * 2 + 1
    del static_out

    def replay() -> None:
        graph.replay()  # GRAPH LINE

    return replay


def make_compiled(torch):
    """A module compiled by Inductor (Triton kernels for its pointwise ops, cuBLAS for the linear)."""
    from torch import nn

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x):
            h = self.fc(x)  # COMPILED FC LINE
            return torch.sigmoid(h) * 2 + torch.relu(h)  # COMPILED POINTWISE LINE

    head = torch.compile(Head().cuda())
    x = torch.randn(64, 256, device="cuda")

    def run() -> None:
        head(x)  # COMPILED CALL LINE

    return run


def workload(torch, step, triton_launch, replay, steps: int, compiled_run=None) -> None:
    for _ in range(steps):
        step()
    if triton_launch is not None:
        for _ in range(3):
            triton_launch()
    for _ in range(3):
        replay()
    if compiled_run is not None:
        for _ in range(3):
            compiled_run()
    torch.cuda.synchronize()


# -- reading the run -----------------------------------------------------------------------------


class Run:
    def __init__(self, run_dir: Path):
        import pyarrow as pa

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
        from support.runs import read_run

        raw = read_run(run_dir)
        self.manifest = raw.manifest
        events = raw.tables["events"]
        ts = events["ts"].cast(pa.int64()).to_pylist()
        self.events = []
        for t, row in zip(ts, events.drop_columns(["ts"]).to_pylist()):
            row["ts"] = t
            row["attrs"] = json.loads(row["attrs"]) if row["attrs"] else {}
            self.events.append(row)
        self.code = {c["code_id"]: c for c in raw.tables["code"].to_pylist()}
        self.stacks = {s["stack_id"]: s for s in raw.tables["stacks"].to_pylist()}

    def site(self, event: dict) -> int | None:
        """Line of the innermost frame of this script on the event's stack."""
        stack = self.stacks.get(event["stack_id"])
        for frame in stack["python"] if stack else []:
            info = self.code.get(frame["code_id"])
            if info is not None and info["filename"] == THIS_FILE:
                return frame["line"]
        return None

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


def demangled(names: list[str]) -> list[str]:
    from tbpipe import _native

    return list(_native.demangle(names))


def kernel_name_key(name: str) -> str:
    # Kineto and tbpipe both demangle with abi::__cxa_demangle; ignore spacing only.
    return "".join(name.split())


def profiler_kernels(trace_path: Path) -> list[dict]:
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("cat") == "kernel"]


# -- checks --------------------------------------------------------------------------------------


def check_sites(run: Run) -> None:
    launches = run.of_kind("kernel_launch")
    ops = run.of_kind("op")
    by_thread: dict[int, list[dict]] = collections.defaultdict(list)
    for event in run.events:
        by_thread[event["thread_id"]].append(event)
    for events in by_thread.values():
        events.sort(key=lambda e: e["ts"])
    forward_by_seq = {e["attrs"]["seq"]: e for e in ops if "seq" in e["attrs"]}
    main_thread = run.manifest["pid"]
    main_events = [e for e in by_thread.get(main_thread, []) if run.site(e) is not None]

    direct = linked = by_time = 0
    unsited = []
    for launch in launches:
        if run.site(launch) is not None:
            direct += 1
            continue
        thread_events = by_thread[launch["thread_id"]]
        before = [e for e in thread_events if e["ts"] <= launch["ts"] and e["kind"] == "op"]
        op = before[-1] if before else None
        forward = forward_by_seq.get(op["attrs"].get("bwd_seq")) if op else None
        if forward is not None and run.site(forward) is not None:
            linked += 1
            continue
        if op is not None and op["attrs"].get("bwd_node", "").endswith("AccumulateGrad"):
            earlier = [e for e in main_events if e["ts"] <= launch["ts"]]
            if earlier:
                by_time += 1
                continue
        unsited.append((launch["name"], launch["thread_id"], op["name"] if op else None))
    detail = f"{len(launches)} launches: {direct} direct, {linked} via backward op -> forward op, {by_time} by time"
    if unsited:
        examples = "; ".join(f"{n[:60]} (thread {t}, op {o})" for n, t, o in unsited[:5])
        report("FAIL", "every kernel launch has a user call site", f"{detail}, {len(unsited)} unsited, e.g. {examples}")
    elif not launches:
        report("FAIL", "every kernel launch has a user call site", "no kernel launches recorded")
    else:
        report("PASS", "every kernel launch has a user call site", detail)

    model_line, backward_line = line_of("MODEL LINE"), line_of("BACKWARD LINE")
    direct_lines = collections.Counter(run.site(e) for e in launches if run.site(e) is not None)
    if direct_lines[model_line] and (direct_lines[backward_line] or linked):
        report(
            "PASS",
            "forward launches at the model(x) line, backward ones at/through loss.backward()",
            f"model line {model_line}: {direct_lines[model_line]}, backward line {backward_line}: "
            f"{direct_lines[backward_line]} direct + {linked} linked",
        )
    else:
        report(
            "FAIL",
            "forward launches at the model(x) line, backward ones at/through loss.backward()",
            f"sites seen: {dict(direct_lines)}",
        )


def check_against_profiler_by_correlation(run: Run, kernels: list[dict]) -> bool:
    """True when the profiler's trace had kernels to compare (concurrent mode)."""
    if not kernels:
        return False
    ours = {e["attrs"].get("correlation_id") for e in run.events if e["kind"] in ("kernel_launch", "graph_launch")}
    missing = [k for k in kernels if k.get("args", {}).get("correlation") not in ours]
    if missing:
        names = collections.Counter(k["name"][:80] for k in missing).most_common(5)
        report(
            "FAIL",
            "every profiler kernel matched by a launch event (correlation id)",
            f"{len(missing)} of {len(kernels)} unmatched, e.g. {names}",
        )
    else:
        report(
            "PASS",
            "every profiler kernel matched by a launch event (correlation id)",
            f"{len(kernels)} kernels, {len(ours)} launch events",
        )
    return True


def check_against_profiler_by_name(run: Run, kernels: list[dict]) -> None:
    launches = run.of_kind("kernel_launch")
    ours = collections.Counter(kernel_name_key(n) for n in demangled([e["name"] for e in launches]))
    theirs = collections.Counter(
        kernel_name_key(k["name"]) for k in kernels if "graph node id" not in k.get("args", {})
    )
    short = {name: (count, ours.get(name, 0)) for name, count in theirs.items() if ours.get(name, 0) < count}
    if not theirs:
        report(
            "FAIL", "every profiler kernel matched by a launch event (name and count)", "the profiler saw no kernels"
        )
    elif short:
        report(
            "FAIL",
            "every profiler kernel matched by a launch event (name and count)",
            f"{len(short)} kernel names short (profiler, tbpipe): {dict(list(short.items())[:5])}",
        )
    else:
        report(
            "PASS",
            "every profiler kernel matched by a launch event (name and count)",
            f"{sum(theirs.values())} kernels of {len(theirs)} names, same steps run again without tbpipe",
        )


def check_triton(run: Run, triton_info: str | None, launched: bool) -> None:
    if not launched:
        report("SKIP", "triton launches", triton_info or "Triton not available")
        return
    events = run.of_kind("triton_launch")
    line = line_of("TRITON LINE")
    at_line = [e for e in events if run.site(e) == line]
    functions = {e["attrs"].get("function") for e in events}
    matching = [e for e in run.of_kind("kernel_launch") if e["attrs"].get("function") in functions]
    ok = len(events) == 3 and len(at_line) == 3 and all(e["attrs"].get("grid") == [4, 1, 1] for e in events)
    ok = ok and len(matching) >= 3
    detail = (
        f"{len(events)} triton_launch events, {len(at_line)} at line {line}, grids "
        f"{[e['attrs'].get('grid') for e in events]}, {len(matching)} cuda launches with the same CUfunction "
        f"(Triton {triton_info})"
    )
    report("PASS" if ok else "FAIL", "triton launches", detail)


def check_graph(run: Run) -> None:
    line = line_of("GRAPH LINE")
    graphs = run.of_kind("graph_launch")
    at_line = [e for e in graphs if run.site(e) == line]
    ok = len(graphs) == 3 and len(at_line) == 3
    report(
        "PASS" if ok else "FAIL",
        "CUDA graph replay is one graph_launch event per replay",
        f"{len(graphs)} graph_launch events ({[e['name'] for e in graphs][:3]}), {len(at_line)} at line {line}",
    )


def check_compiled(run: Run, run_dir: Path, out: Path) -> None:
    """Ingests the run and checks where the compiled module's launches and its compile are sited."""
    import duckdb

    from tbpipe.pipeline.db import IngestOptions, ingest_runs

    db = out / "compiled.duckdb"
    summary = ingest_runs([run_dir], IngestOptions(db_path=db, cache_dir=out / "symbols", progress=False))
    if not summary.ok:
        report("FAIL", "torch.compile: ingest", str([o.reason for o in summary.outcomes]))
        return
    forward_lines = {line_of("COMPILED FC LINE"), line_of("COMPILED POINTWISE LINE")}
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            """
            SELECT kind, name, site_file, site_line, sum(events)::BIGINT, bool_or(site_is_user)
            FROM call_sites WHERE kind IN ('triton_launch', 'kernel_launch', 'compile') GROUP BY ALL
            """
        ).fetchall()
        generated_sites = con.execute(
            "SELECT count(*) FROM call_sites WHERE site_file IS NOT NULL AND is_generated_path(site_file)"
        ).fetchone()[0]
        origins = con.execute(
            "SELECT count(*) FROM stack_frames WHERE kind = 'python' AND inlined AND file = ?", [THIS_FILE]
        ).fetchone()[0]
    finally:
        con.close()
    inductor = [r for r in rows if r[0] == "triton_launch" and r[1].startswith("triton_")]
    misplaced = [r for r in inductor if r[2] != THIS_FILE or r[3] not in forward_lines]
    at_forward = {r[3] for r in inductor if r[2] == THIS_FILE}
    ok = bool(inductor) and not misplaced and generated_sites == 0 and origins > 0
    report(
        "PASS" if ok else "FAIL",
        "torch.compile: Inductor's Triton launches sited at the forward's lines",
        f"{sum(r[4] for r in inductor)} launches of {len({r[1] for r in inductor})} kernels at lines "
        f"{sorted(at_forward)} (forward lines {sorted(forward_lines)}); misplaced {misplaced[:3]}; "
        f"{generated_sites} sites in generated code; {origins} inlined origin frames",
    )
    cuda_at_forward = [r for r in rows if r[0] == "kernel_launch" and r[2] == THIS_FILE and r[3] in forward_lines]
    report(
        "PASS" if cuda_at_forward else "FAIL",
        "torch.compile: CUDA launches of the compiled module sited at the forward's lines",
        f"{sum(r[4] for r in cuda_at_forward)} launches of {len(cuda_at_forward)} kernels",
    )
    compiles = [r for r in rows if r[0] == "compile" and r[1] == "forward"]
    ok = any(r[2] == THIS_FILE and r[3] == line_of("COMPILED CALL LINE") for r in compiles)
    report(
        "PASS" if ok else "FAIL",
        "torch.compile: the module's compile is an event at the line that first called it",
        f"{compiles}",
    )
    recorded = sum(1 for e in run.events if e["kind"] == "triton_launch")
    report("INFO", "torch.compile: triton_launch events in the raw run", str(recorded))


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()

    try:
        import torch
    except ImportError as error:
        print(f"cannot run: torch does not import ({error})")
        return 2
    if not torch.cuda.is_available():
        print(f"cannot run: torch {torch.__version__} sees no CUDA device")
        return 2
    from tbpipe import _native, capture

    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name(0)}, "
        f"Python {sys.version.split()[0]}",
        flush=True,
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="tbpipe-gpu-"))
    step = make_training(torch)
    triton_launch, triton_info = make_triton_kernel(torch)
    replay = make_graph(torch)
    workload(torch, step, triton_launch, replay, 1)  # warm-up: cuBLAS/cuDNN handles, allocator, autotuning
    compiled_run = make_compiled(torch) if triton_launch is not None else None  # Inductor's GPU kernels are Triton

    sources = ["cuda", "torch-ops"] + (["triton"] if triton_launch is not None else [])
    trace_path = out / "profiler_inside.json"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        session = capture.session(out / "tbpipe", sources=sources).start()
    handles = {source.name: handle for source, handle in session._source_handles}
    cuda_handle = handles["cuda"]
    if cuda_handle.status != "recording":
        report("FAIL", "cuda source subscribed to CUPTI", f"{cuda_handle.status} {stderr.getvalue().strip()}")
    else:
        report("PASS", "cuda source subscribed to CUPTI", f"libcupti {cuda_handle.library}")
    profiler_ran_inside = False
    try:
        if compiled_run is not None:
            compiled_run()  # compiled inside the session: its compile event and Dynamo's traced frames
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as profiler:
            workload(torch, step, triton_launch, replay, args.steps, compiled_run)
        profiler.export_chrome_trace(str(trace_path))
        profiler_ran_inside = True
    except Exception as error:
        report(
            "INFO",
            "torch.profiler inside the session",
            f"failed ({type(error).__name__}: {error}); running the steps without it",
        )
        workload(torch, step, triton_launch, replay, args.steps, compiled_run)
    session.close()
    counters = dict(_native._cupti_counters())

    (run_dir,) = [p for p in (out / "tbpipe").iterdir() if (p / "manifest.json").is_file()]
    run = Run(run_dir)
    recorded = run.manifest["counters"]
    launches = run.of_kind("kernel_launch")
    ok = launches and recorded["events_dropped"] == 0
    report(
        "PASS" if ok else "FAIL",
        "kernel launches recorded, none dropped",
        f"{len(launches)} kernel_launch, {len(run.of_kind('graph_launch'))} graph_launch, "
        f"{len(run.of_kind('op'))} op events; CUPTI counters {counters}; manifest {recorded}",
    )

    kernels = profiler_kernels(trace_path) if profiler_ran_inside else []
    if not check_against_profiler_by_correlation(run, kernels):
        # Kineto could not trace while tbpipe held CUPTI: compare with the same steps run again.
        report("INFO", "profiler inside the session saw no kernels", "comparing by name over a second run")
        trace_alone = out / "profiler_alone.json"
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as profiler:
            workload(torch, step, triton_launch, replay, args.steps, compiled_run)
        profiler.export_chrome_trace(str(trace_alone))
        check_against_profiler_by_name(run, profiler_kernels(trace_alone))

    for check in (
        lambda: check_sites(run),
        lambda: check_triton(run, triton_info, triton_launch is not None),
        lambda: check_graph(run),
        lambda: (
            check_compiled(run, run_dir, out)
            if compiled_run is not None
            else report("SKIP", "torch.compile on the GPU", "needs Triton")
        ),
    ):
        try:
            check()
        except Exception:
            report("FAIL", "check crashed", traceback.format_exc().strip().splitlines()[-1])

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            second = io.StringIO()
            with contextlib.redirect_stderr(second):
                with capture.session(out / "while_profiling", sources=["cuda"]):
                    step()
        report(
            "INFO",
            "tbpipe subscribing while torch.profiler runs",
            second.getvalue().strip() or "no message (Kineto held no CUPTI subscriber)",
        )
    except Exception as error:
        report("INFO", "tbpipe subscribing while torch.profiler runs", f"{type(error).__name__}: {error}")

    failed = [r for r in RESULTS if r[0] == "FAIL"]
    passed = [r for r in RESULTS if r[0] == "PASS"]
    print(f"RESULT: {'FAIL' if failed else 'PASS'} ({len(passed)} passed, {len(failed)} failed); runs in {out}")
    if args.out is None and not failed:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
