"""GPU check of the `cuda`, `torch-ops` and `triton` sources: run on a machine with an NVIDIA GPU.

    pip install -e .            # tbpipe, in an environment with a CUDA build of torch (and triton, optional)
    python tests/gpu/check_launch_sites.py [--steps 3] [--out DIR] [--skip-overhead] [--no-ingest]

Takes a few minutes (Triton's first compile, the ingest's symbols, three overhead runs). It trains a small
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

Checks 1-7 run with GPU activity off (TBPIPE_CUDA_ACTIVITY=0, launches only, as
they were written): the profiler inside that session would take CUPTI's activity
buffers. Then GPU time, in sessions of their own with the cuda source alone:

  8. (in a fresh process, as are 9 and 10) per-site GPU time from tbpipe (the
     raw run's activity records joined to their launch events by correlation
     id, and, unless --no-ingest, the database's kernel_gpu_time_sites after a
     real `tbpipe ingest`) agrees within 5% with CUDA events recorded around
     the same kernels, per line;
  9. a CUDA graph captured inside the session and replayed K times: every
     node's kernel has K executions, each attributed to the graph launch at the
     replay line and, through the node's clones, to the line where it was
     captured (one node per captured line);
 10. (information) overhead: the step time of the training loop with the
     source off, launches only, and launches + activity (each in a fresh
     process; medians), against the target of 1.10x for launches + activity.

Prints one PASS/FAIL line per check and a RESULT line; exits 0 on PASS, 1 on FAIL,
2 when the machine has no usable GPU. Timings are printed, never asserted, except
the 5% agreement of check 8 (two measurements of the same GPU work).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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


def line_of(marker: str, path: str = THIS_FILE) -> int:
    """Line number in `path` (this file) of the line ending with `# <marker>`."""
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
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


def make_timed_ops(torch):
    """Two sites of long kernels (milliseconds each, so CUDA events' own cost is noise), each launch
    bracketed by a pair of CUDA events on the same stream."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    big = torch.randn(1 << 27, device="cuda")
    timings: dict[str, list[tuple]] = {"MATMUL LINE": [], "ADD LINE": []}

    def run(reps: int) -> None:
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)  # MATMUL LINE
            end.record()
            timings["MATMUL LINE"].append((start, end))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.add(big, 1.0)  # ADD LINE
            end.record()
            timings["ADD LINE"].append((start, end))
        torch.cuda.synchronize()

    def event_ns() -> dict[int, float]:
        """Per line, the summed CUDA-event time of its launches, in ns."""
        return {line_of(m): sum(s.elapsed_time(e) for s, e in pairs) * 1e6 for m, pairs in timings.items()}

    return run, timings, event_ns


def graph_body(torch, x):
    doubled = x * 2.0  # NODE ONE
    shifted = doubled + 1.0  # NODE TWO
    return torch.relu(shifted)  # NODE THREE


def make_node_graph(torch):
    """The graph's body warmed up on a side stream (outside the session); capture() then records the
    graph (call it inside the session: its launches and nodes are what check 9 follows)."""
    x = torch.randn(1 << 22, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            graph_body(torch, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()

    def capture() -> None:
        with torch.cuda.graph(graph):
            graph_body(torch, x)

    def replay(times: int) -> None:
        for _ in range(times):
            graph.replay()  # NODE REPLAY LINE
        torch.cuda.synchronize()

    return capture, replay


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


def _rows(table) -> list[dict]:
    """Rows of an Arrow table, timestamps as integer nanoseconds."""
    import pyarrow as pa

    for index, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            table = table.set_column(index, field.name, table[field.name].cast(pa.int64()))
    return table.to_pylist()


class Run:
    def __init__(self, run_dir: Path, source_file: str = THIS_FILE):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
        from support.runs import read_run

        raw = read_run(run_dir)
        self.path = run_dir
        self.source_file = source_file
        self.manifest = raw.manifest
        self.events = []
        for row in _rows(raw.tables["events"]):
            row["attrs"] = json.loads(row["attrs"]) if row["attrs"] else {}
            self.events.append(row)
        self.code = {c["code_id"]: c for c in raw.tables["code"].to_pylist()}
        self.stacks = {s["stack_id"]: s for s in raw.tables["stacks"].to_pylist()}
        self.gpu_activity = _rows(raw.tables["gpu_activity"])
        self.graph_nodes = _rows(raw.tables["gpu_graph_nodes"])

    def site(self, event: dict) -> int | None:
        """Line of the innermost frame of the source file (this script) on the event's stack."""
        stack = self.stacks.get(event["stack_id"])
        for frame in stack["python"] if stack else []:
            info = self.code.get(frame["code_id"])
            if info is not None and info["filename"] == self.source_file:
                return frame["line"]
        return None

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


# -- GPU time from the raw run (the same join the ingest makes) ------------------------------------


def launch_by_correlation(run: Run) -> dict[int, dict]:
    """The launch events (kernel, graph, copy, set) by the CUPTI correlation id they carry."""
    kinds = ("kernel_launch", "graph_launch", "memcpy", "memset")
    out: dict[int, dict] = {}
    for event in run.events:
        correlation = event["correlation_id"]  # a column of its own (raw schema 3)
        if event["kind"] in kinds and correlation is not None:
            out.setdefault(correlation, event)
    return out


def gpu_time_by_line(run: Run, kind: str = "kernel") -> dict[int, tuple[int, int]]:
    """Per line of the source file: (executions, summed GPU ns) of the activity its launches caused."""
    launches = launch_by_correlation(run)
    out: dict[int, list[int]] = {}
    for record in run.gpu_activity:
        event = launches.get(record["correlation_id"])
        line = run.site(event) if event is not None else None
        if record["kind"] != kind or line is None:
            continue
        duration = (
            record["gpu_end"] - record["gpu_start"] if None not in (record["gpu_start"], record["gpu_end"]) else 0
        )
        entry = out.setdefault(line, [0, 0])
        entry[0] += 1
        entry[1] += duration
    return {line: (count, ns) for line, (count, ns) in out.items()}


def captured_correlations(run: Run) -> dict[int, int]:
    """Per graph node id: the correlation id of the launch captured into the node it descends from."""
    made = {n["graph_node_id"]: n["correlation_id"] for n in run.graph_nodes if n["original_graph_node_id"] is None}
    cloned = {n["graph_node_id"]: n["original_graph_node_id"] for n in run.graph_nodes if n["original_graph_node_id"]}
    out = {}
    for node in set(made) | set(cloned):
        current = node
        for _ in range(64):
            if current in made:
                if made[current] is not None:
                    out[node] = made[current]
                break
            if current not in cloned:
                break
            current = cloned[current]
    return out


def graph_nodes_by_node(run: Run) -> dict[int, dict]:
    """Per graph node id of the replayed kernels: executions, kernel names, the lines of the graph
    launches they were replayed by, and the line of the launch captured into the node (or None)."""
    launches = launch_by_correlation(run)
    captured = captured_correlations(run)
    out: dict[int, dict] = {}
    for record in run.gpu_activity:
        node = record["graph_node_id"]
        if record["kind"] != "kernel" or node is None:
            continue
        entry = out.setdefault(node, {"executions": 0, "names": set(), "replay_lines": set(), "capture_line": None})
        entry["executions"] += 1
        entry["names"].add(record["name"])
        replay = launches.get(record["correlation_id"])
        entry["replay_lines"].add(run.site(replay) if replay is not None and replay["kind"] == "graph_launch" else None)
        capture = launches.get(captured.get(node))
        entry["capture_line"] = run.site(capture) if capture is not None else None
    return out


def database_gpu_time_by_line(db: Path, source_file: str) -> dict[int, tuple[int, int]]:
    """Per line of `source_file`: (executions, GPU ns) from the database's kernel_gpu_time_sites."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            """
            SELECT site_line, sum(executions)::BIGINT, sum(gpu_time_ns)::BIGINT FROM kernel_gpu_time_sites
            WHERE site_file = ? GROUP BY site_line
            """,
            [source_file],
        ).fetchall()
    finally:
        con.close()
    return {line: (count, ns) for line, count, ns in rows}


def agreement(measured: dict[int, float], tbpipe: dict[int, tuple[int, int]], tolerance: float) -> list[str]:
    """Lines whose tbpipe GPU time is off the measured time by more than `tolerance` (a fraction)."""
    bad = []
    for line, expected in measured.items():
        got = tbpipe.get(line, (0, 0))[1]
        if expected <= 0 or abs(got - expected) > tolerance * expected:
            bad.append(f"line {line}: tbpipe {got / 1e6:.3f} ms, CUDA events {expected / 1e6:.3f} ms")
    return bad


def overhead_lines(step_seconds: dict[str, list[float]], target: float = 1.10) -> list[str]:
    """One line per mode: median step time and its ratio to the source-off median."""
    off = statistics.median(step_seconds["off"])
    lines = []
    for mode, times in step_seconds.items():
        median = statistics.median(times)
        ratio = median / off if off > 0 else float("nan")
        note = f" (target <= {target:.2f}x: {'met' if ratio <= target else 'NOT met'})" if mode == "activity" else ""
        lines.append(f"{mode}: median step {median * 1e3:.3f} ms over {len(times)} steps, {ratio:.3f}x{note}")
    return lines


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
    ours = {e["correlation_id"] for e in run.events if e["kind"] in ("kernel_launch", "graph_launch")}
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


def check_gpu_time(run: Run, event_ns: dict[int, float], db: Path | None) -> None:
    lines = {line_of("MATMUL LINE"), line_of("ADD LINE")}
    raw = {line: value for line, value in gpu_time_by_line(run).items() if line in lines}
    bad = agreement(event_ns, raw, 0.05)
    detail = "; ".join(
        f"line {line}: tbpipe {raw.get(line, (0, 0))[1] / 1e6:.3f} ms in {raw.get(line, (0, 0))[0]} kernels, "
        f"CUDA events {ns / 1e6:.3f} ms"
        for line, ns in sorted(event_ns.items())
    )
    counters = run.manifest["counters"]
    detail += (
        f"; records {counters.get('gpu_records_written')}, dropped {counters.get('gpu_records_dropped')}, "
        f"lost {counters.get('gpu_records_lost')}, malformed {counters.get('gpu_records_malformed')}"
    )
    report("FAIL" if bad else "PASS", "per-site GPU time (raw run) within 5% of CUDA events", detail)
    if db is None:
        return
    from_db = {line: value for line, value in database_gpu_time_by_line(db, run.source_file).items() if line in lines}
    bad = agreement(event_ns, from_db, 0.05)
    report(
        "FAIL" if bad else "PASS",
        "per-site GPU time (kernel_gpu_time_sites) within 5% of CUDA events",
        "; ".join(bad) or f"{dict(sorted(from_db.items()))}",
    )


def check_graph_nodes(run: Run, replays: int) -> None:
    nodes = graph_nodes_by_node(run)
    replay_line = line_of("NODE REPLAY LINE")
    captured = {line_of(m) for m in ("NODE ONE", "NODE TWO", "NODE THREE")}
    ours = {n: e for n, e in nodes.items() if e["capture_line"] in captured}
    ok = (
        len(ours) >= 3
        and {e["capture_line"] for e in ours.values()} == captured
        and all(e["executions"] == replays and e["replay_lines"] == {replay_line} for e in ours.values())
    )
    detail = "; ".join(
        f"node {node}: {e['executions']} runs of {sorted(e['names'])[0][:50]}, replayed at {sorted(map(str, e['replay_lines']))}, "
        f"captured at line {e['capture_line']}"
        for node, e in sorted(nodes.items())
    )
    report(
        "PASS" if ok else "FAIL",
        f"graph replays attributed per node (replay line {replay_line}, captured lines {sorted(captured)})",
        detail or "no graph kernels recorded",
    )


def gpu_time_child(args) -> int:
    """Checks 8 and 9 in this (fresh) process: no earlier CUPTI session or profiler in it."""
    import torch

    run_gpu_time_checks(torch, args.out, args.gpu_time_reps, args.graph_replays, not args.no_ingest)
    return 0


def run_gpu_time_in_child(out: Path, args) -> None:
    """Checks 8 and 9 in a process of their own; its PASS/FAIL/INFO lines become this run's."""
    command = [
        sys.executable,
        THIS_FILE,
        "--gpu-time-child",
        "--out",
        str(out),
        "--gpu-time-reps",
        str(args.gpu_time_reps),
        "--graph-replays",
        str(args.graph_replays),
    ] + (["--no-ingest"] if args.no_ingest else [])
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        report("FAIL", "GPU time checks", "did not finish in 900 s")
        return
    for text in result.stdout.splitlines():
        if text.startswith("[") and "] " in text:
            status, _, rest = text[1:].partition("] ")
            check, _, detail = rest.partition(": ")
            RESULTS.append((status, check, detail))
        print(text, flush=True)
    if result.returncode != 0:
        report("FAIL", "GPU time checks", f"exit status {result.returncode}: {result.stderr.strip()[-800:]}")


def run_gpu_time_checks(torch, out: Path, reps: int, replays: int, ingest: bool) -> None:
    """Checks 8 and 9, in a session with the cuda source alone and GPU activity on."""
    from tbpipe import capture

    os.environ["TBPIPE_CUDA_ACTIVITY"] = "kernel,memcpy,memset"
    run_ops, timings, event_ns = make_timed_ops(torch)
    run_ops(2)  # warm-up: cuBLAS handles and kernels loaded
    capture_graph, replay = make_node_graph(torch)
    timings["MATMUL LINE"].clear()
    timings["ADD LINE"].clear()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        session = capture.session(out / "gpu_time", sources=["cuda"]).start()
    try:
        run_ops(reps)
        capture_graph()
        replay(replays)
    finally:
        session.close()
    statuses = [str(getattr(handle, "status", handle)) for _source, handle in session._source_handles]
    report("INFO", "GPU time session", f"{statuses} {stderr.getvalue().strip()}".strip())
    (run_dir,) = [p for p in (out / "gpu_time").iterdir() if (p / "manifest.json").is_file()]
    run = Run(run_dir)
    db = None
    if ingest:
        db = out / "gpu_time.duckdb"
        started = time.monotonic()
        try:
            result = subprocess.run(
                [sys.executable, "-m", "tbpipe.pipeline", "ingest", str(run_dir.parent), "--db", str(db)],
                capture_output=True,
                text=True,
                timeout=420,
            )
            if result.returncode != 0:
                report("FAIL", "tbpipe ingest of the GPU time run", result.stderr.strip()[-500:])
                db = None
            else:
                report("INFO", "tbpipe ingest of the GPU time run", f"{time.monotonic() - started:.0f} s")
        except subprocess.TimeoutExpired:
            report("INFO", "tbpipe ingest of the GPU time run", "did not finish in 420 s; checked the raw run only")
            db = None
    for check in (lambda: check_gpu_time(run, event_ns(), db), lambda: check_graph_nodes(run, replays)):
        try:
            check()
        except Exception:
            report("FAIL", "check crashed", traceback.format_exc().strip().splitlines()[-1])


def overhead_child(mode: str, steps: int, out: Path) -> int:
    """One overhead measurement in this process: prints the step times as JSON."""
    import torch

    from tbpipe import capture

    os.environ["TBPIPE_CUDA_ACTIVITY"] = "0" if mode == "launches" else "kernel,memcpy,memset"
    step = make_training(torch)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    session = capture.session(out, sources=["cuda"]).start() if mode != "off" else None
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    finally:
        if session is not None:
            session.close()
    print("STEP_TIMES " + json.dumps(times), flush=True)
    return 0


def run_overhead(out: Path, steps: int) -> None:
    times: dict[str, list[float]] = {}
    for mode in ("off", "launches", "activity"):
        result = subprocess.run(
            [
                sys.executable,
                THIS_FILE,
                "--overhead-child",
                mode,
                "--overhead-steps",
                str(steps),
                "--out",
                str(out / mode),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        line = next((t for t in result.stdout.splitlines() if t.startswith("STEP_TIMES ")), None)
        if result.returncode != 0 or line is None:
            report("INFO", f"overhead ({mode})", f"failed: {result.stderr.strip()[-300:]}")
            return
        times[mode] = json.loads(line[len("STEP_TIMES ") :])
    for text in overhead_lines(times):
        report("INFO", "overhead of the cuda source on the training step", text)


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--gpu-time-reps", type=int, default=20, help="launches per timed site (check 8)")
    parser.add_argument("--graph-replays", type=int, default=5, help="replays of the captured graph (check 9)")
    parser.add_argument("--no-ingest", action="store_true", help="check 8 on the raw run only")
    parser.add_argument("--skip-overhead", action="store_true", help="leave out check 10")
    parser.add_argument("--overhead-steps", type=int, default=50)
    parser.add_argument("--overhead-child", choices=("off", "launches", "activity"), help=argparse.SUPPRESS)
    parser.add_argument("--gpu-time-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead_child:
        return overhead_child(args.overhead_child, args.overhead_steps, args.out)
    if args.gpu_time_child:
        return gpu_time_child(args)
    # Checks 1-7 as written: launches only (torch.profiler inside the session would take CUPTI's
    # activity buffers). GPU time has sessions of its own below.
    os.environ["TBPIPE_CUDA_ACTIVITY"] = "0"

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

    # In a fresh process: CUPTI state left by the sessions and the profiler above stays out of it.
    run_gpu_time_in_child(out / "gpu_time_child", args)
    if not args.skip_overhead:
        run_overhead(out / "overhead", args.overhead_steps)

    failed = [r for r in RESULTS if r[0] == "FAIL"]
    passed = [r for r in RESULTS if r[0] == "PASS"]
    print(f"RESULT: {'FAIL' if failed else 'PASS'} ({len(passed)} passed, {len(failed)} failed); runs in {out}")
    if args.out is None and not failed:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
