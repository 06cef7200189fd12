"""GPU time per call site, end to end on machines without a GPU: the `cuda` source's CUPTI activity
path driven by the labelled CUPTI TEST DOUBLE (tests/cupti_double/libcupti_double.c, loaded in place
of libcupti through $TBPIPE_CUPTI_LIBRARY), real run folders, a real `tbpipe ingest`, the views.

The double plays the GPU: each test queues activity records for the correlation ids of the launches
it made, and the double hands them back in CUPTI's buffers (CUpti_ActivityKernel9 / Memcpy5 /
Memset4 / Synchronization layouts) out of order, from a worker thread or from a flush, with dropped
and cut records when asked. Durations are the double's numbers, never measured here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from conftest import TBPIPE, run_python
from support.cupti_double import PRELUDE, build_double
from support.runs import read_run, read_runs, rewrite_as_raw_version, transaction_sizes

from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.ingest import IngestLimits
from tbpipe.schemas import raw


@pytest.fixture(scope="module")
def double_library(tmp_path_factory) -> Path:
    built = build_double(tmp_path_factory.mktemp("cupti_double"))
    if built is None:
        pytest.skip("no C compiler to build the libcupti test double")
    return built


def run_with_double(double: Path, cwd: Path, body: str, *, env: dict[str, str] | None = None, timeout: float = 90):
    full_env = {"TBPIPE_CUPTI_LIBRARY": str(double), "OUT": str(cwd / "runs"), **(env or {})}
    return run_python(PRELUDE + textwrap.dedent(body), cwd=cwd, env=full_env, timeout=timeout)


def ingest(runs: Path, db: Path, symbol_cache: Path, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache))
    command = [*TBPIPE, "ingest", str(runs), "--db", str(db), *options]
    return subprocess.run(command, capture_output=True, text=True, env=env)


def rows(con, sql: str, params=None) -> list[dict]:
    cursor = con.execute(sql, params or [])
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row)) for row in cursor.fetchall()]


def as_int_times(table: pa.Table) -> list[dict]:
    for index, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            table = table.set_column(index, field.name, table[field.name].cast(pa.int64()))
    return table.to_pylist()


# One program that does everything the cuda source records GPU time for.
WORKLOAD = """
class WatchPandas:  # the capture's flushes (GPU activity parts too) never import pandas
    asked = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pandas":
            self.asked.append(name)

sys.meta_path.insert(0, WatchPandas())
GEMM, SOFTMAX, RELU, ADD, MUL = b"_Z4gemmIfEvPT_S1_", b"softmax_kernel", b"relu_kernel", b"add_kernel", b"mul_kernel"
WORKER, ORPHAN = b"worker_kernel", b"orphan_kernel"

def gemm_site(c):
    double.tbpipe_double_cuda_launch_kernel(GEMM, 4, 2, 1, 128, 1, 1, c_size_t(2048), c_size_t(0x5000), c)

def softmax_site(c):
    double.tbpipe_double_cu_launch_kernel_ex(SOFTMAX, 3, 2, 64, 512, c_size_t(5), c)

def copy_site(c):
    double.tbpipe_double_cuda_memcpy_async(c_size_t(1 << 20), HTOD, c_size_t(0x5000), c)

def zero_site(c):
    double.tbpipe_double_cuda_memset_async(c_size_t(4096), c_size_t(0x5000), c)

def capture_graph():  # torch.cuda.graph(): launches on a capturing stream become graph nodes
    double.tbpipe_double_capture_launch(RELU, 300, 7, 1001)
    double.tbpipe_double_capture_launch(ADD, 301, 7, 1002)
    double.tbpipe_double_graph_add_kernel_node(7, 1003, 302)  # made by the graph API: no launch to site it

def instantiate():  # the executable graph's nodes are clones
    for original, clone in ((1001, 2001), (1002, 2002), (1003, 2003)):
        double.tbpipe_double_graph_clone_node(8, original, clone)

def replay(c):
    double.tbpipe_double_cuda_graph_launch(c_size_t(0xABC0), c_size_t(0), c)

with capture.session(os.environ["OUT"], sources=["cuda"], flush_interval_s=0.2):
    for c in (100, 101, 102):
        gemm_site(c)
        assert kernel_record(GEMM, c, 10_000) == 1
    for c in (200, 201):
        softmax_site(c)
        kernel_record(SOFTMAX, c, 3_000)
    copy_site(400)
    memcpy_record(400, HTOD, 1 << 20, 50_000)
    zero_site(401)
    memset_record(401, 4096, 2_000)
    print("SYNC_QUEUED", sync_record(402, 3, 9_000))
    capture_graph()
    instantiate()
    for c in (500, 501):
        replay(c)
        kernel_record(RELU, c, 1_000, graph=(8, 2001))
        kernel_record(ADD, c, 1_500, graph=(8, 2002))
        kernel_record(MUL, c, 700, graph=(8, 2003))
    double.tbpipe_double_activity_deliver(1)  # reversed, from CUPTI's worker thread
    assert double.tbpipe_double_cu_launch_on_native_thread(WORKER, 600) == 0
    kernel_record(WORKER, 600, 4_000)
    kernel_record(ORPHAN, 999, 1_234)  # its launch was never recorded
    double.tbpipe_double_activity_deliver(2)  # interleaved
    time.sleep(0.6)  # flushes write what was delivered
    gemm_site(103)
    kernel_record(GEMM, 103, 10_000)  # left in CUPTI's buffers: a flush asks for it
    gemm_site(104)
    kernel_record(GEMM, 104, 0, running=True)  # no end time: only the forced flush at the end delivers it
    double.tbpipe_double_activity_set_dropped(5)
    print("COUNTERS", json.dumps(_native._gpu_activity_counters()))
print("PENDING_AFTER", double.tbpipe_double_activity_pending())
print("FINAL", json.dumps(_native._gpu_activity_counters()))
print("PANDAS", sorted(set(WatchPandas.asked)))
"""


@pytest.fixture(scope="module")
def workload(double_library: Path, tmp_path_factory, symbol_cache: Path):
    """The workload captured once, and ingested."""
    tmp = tmp_path_factory.mktemp("gpu_workload")
    result = run_with_double(double_library, tmp, WORKLOAD)
    assert result.returncode == 0, result.stderr
    (run,) = read_runs(tmp / "runs")
    db = tmp / "gpu.duckdb"
    loaded = ingest(tmp / "runs", db, symbol_cache)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    con = duckdb.connect(str(db), read_only=True)
    yield result, run, con
    con.close()


def _line(result, prefix: str) -> str:
    return next(t for t in result.stdout.splitlines() if t.startswith(prefix))[len(prefix) + 1 :]


def test_activity_records_are_written_with_their_fields(workload) -> None:
    result, run, _con = workload
    assert result.stderr.strip() == ""
    assert run.manifest["source_status"] == {"cuda": "recording"}
    assert _line(result, "SYNC_QUEUED") == "0"  # synchronization is not asked for by default
    assert _line(result, "PENDING_AFTER") == "0"  # the end flushed everything, the running kernel too
    assert _line(result, "PANDAS") == "[]"
    final = json.loads(_line(result, "FINAL"))
    assert (final["records"], final["dropped"], final["lost"], final["malformed"]) == (17, 5, 0, 0)
    assert final["graph_nodes"] == 6 and final["active"] is False

    counters = run.manifest["counters"]
    assert (counters["gpu_records_written"], counters["gpu_records_dropped"]) == (17, 5)
    assert len(run.manifest["files"]["gpu_activity"]) >= 2  # periodic flushes, then the last one

    activity = as_int_times(run.tables["gpu_activity"])
    by_correlation: dict[int, list[dict]] = {}
    for row in activity:
        by_correlation.setdefault(row["correlation_id"], []).append(row)
    (gemm,) = by_correlation[100]
    assert {
        k: gemm[k] for k in ("kind", "name", "device", "context", "stream", "graph_id", "graph_node_id", "bytes")
    } == {
        "kind": "kernel",
        "name": "_Z4gemmIfEvPT_S1_",
        "device": 0,
        "context": 1,
        "stream": 7,
        "graph_id": None,
        "graph_node_id": None,
        "bytes": None,
    }
    assert (gemm["grid_x"], gemm["grid_y"], gemm["grid_z"], gemm["block_x"]) == (4, 2, 1, 128)
    assert (gemm["registers_per_thread"], gemm["static_shared_mem"], gemm["dynamic_shared_mem"]) == (40, 1024, 2048)
    assert gemm["gpu_end"] - gemm["gpu_start"] == 10_000
    (copy,) = by_correlation[400]
    assert (copy["kind"], copy["name"], copy["bytes"], copy["grid_x"]) == ("memcpy", "HtoD", 1 << 20, None)
    (zero,) = by_correlation[401]
    assert (zero["kind"], zero["name"], zero["bytes"]) == ("memset", "memset", 4096)
    (running,) = by_correlation[104]
    assert running["gpu_start"] is not None and running["gpu_end"] is None
    graph_rows = by_correlation[500]
    assert sorted((r["name"], r["graph_id"], r["graph_node_id"]) for r in graph_rows) == [
        ("add_kernel", 8, 2002),
        ("mul_kernel", 8, 2003),
        ("relu_kernel", 8, 2001),
    ]

    # GPU times are on the events' clock (the double's is CLOCK_MONOTONIC): near the launch.
    events = as_int_times(run.tables["events"])
    launch_ts = {e["correlation_id"]: e["ts"] for e in events if e["correlation_id"] is not None}
    assert abs(gemm["gpu_start"] - launch_ts[100]) < 2_000_000_000

    nodes = as_int_times(run.tables["gpu_graph_nodes"])
    made = {n["graph_node_id"]: n["correlation_id"] for n in nodes if n["original_graph_node_id"] is None}
    cloned = {n["graph_node_id"]: n["original_graph_node_id"] for n in nodes if n["original_graph_node_id"]}
    assert made == {1001: 300, 1002: 301, 1003: None}
    assert cloned == {2001: 1001, 2002: 1002, 2003: 1003}
    assert {n["graph_id"] for n in nodes} == {7, 8}


def test_copies_and_sets_are_events_of_their_own(workload) -> None:
    _result, run, _con = workload
    events = as_int_times(run.tables["events"])
    transfers = [
        (e["kind"], e["name"], e["correlation_id"])
        for e in events
        if e["kind"] != "kernel_launch" and e["kind"] != "graph_launch"
    ]
    # One event per API call: the driver copy inside cudaMemcpyAsync is not a second one.
    assert transfers == [("memcpy", "cudaMemcpyAsync", 400), ("memset", "cudaMemsetAsync", 401)]


def test_gpu_time_per_event_joins_records_to_their_launches(workload) -> None:
    _result, _run, con = workload
    per_event = rows(
        con,
        """
        SELECT e.kind, e.name, (e.attrs ->> 'correlation_id')::INTEGER AS correlation, g.activities, g.gpu_time_ns
        FROM event_gpu_time g JOIN events e USING (event_id) ORDER BY correlation
        """,
    )
    table = {(r["kind"], r["correlation"]): (r["activities"], r["gpu_time_ns"]) for r in per_event}
    assert table[("kernel_launch", 100)] == (1, 10_000)
    assert table[("kernel_launch", 201)] == (1, 3_000)
    assert table[("memcpy", 400)] == (1, 50_000)
    assert table[("memset", 401)] == (1, 2_000)
    assert table[("graph_launch", 500)] == (3, 3_200)  # all the replay's kernels
    assert table[("kernel_launch", 600)] == (1, 4_000)  # launched from a thread without Python
    assert table[("kernel_launch", 104)] == (1, 0)  # still running at the end: no duration
    assert ("kernel_launch", 300) not in table  # captured into the graph, never run as such
    unjoined = rows(con, "SELECT name, correlation_id FROM gpu_activity WHERE event_id IS NULL")
    assert unjoined == [{"name": "orphan_kernel", "correlation_id": 999}]


def test_kernel_gpu_time_sites_sit_beside_the_launch_counts(workload) -> None:
    _result, _run, con = workload
    sites = rows(
        con,
        """
        SELECT name, launch_kind, site_function, site_is_user, capture_site_function, executions, timed,
               gpu_time_ns, min_ns, max_ns, avg_ns
        FROM kernel_gpu_time_sites ORDER BY name
        """,
    )
    by_name = {r["name"]: r for r in sites}
    gemm = by_name["_Z4gemmIfEvPT_S1_"]
    assert (gemm["launch_kind"], gemm["site_function"], gemm["site_is_user"]) == ("kernel_launch", "gemm_site", True)
    assert (gemm["executions"], gemm["timed"], gemm["gpu_time_ns"]) == (5, 4, 40_000)
    assert (gemm["min_ns"], gemm["max_ns"], gemm["avg_ns"]) == (10_000, 10_000, 10_000.0)
    assert by_name["softmax_kernel"]["site_function"] == "softmax_site"
    # A replayed graph's kernels: at the replay site, and at the site where each node was captured.
    for name, captured, total in (("relu_kernel", "capture_graph", 2_000), ("add_kernel", "capture_graph", 3_000)):
        row = by_name[name]
        assert (row["launch_kind"], row["site_function"], row["capture_site_function"]) == (
            "graph_launch",
            "replay",
            captured,
        )
        assert (row["executions"], row["gpu_time_ns"]) == (2, total)
    mul = by_name["mul_kernel"]  # made by the graph API, not by a recorded launch
    assert (mul["site_function"], mul["capture_site_function"], mul["executions"]) == ("replay", None, 2)
    worker = by_name["worker_kernel"]
    assert (worker["site_is_user"], worker["executions"], worker["gpu_time_ns"]) == (False, 1, 4_000)
    orphan = by_name["orphan_kernel"]
    assert (orphan["launch_kind"], orphan["site_function"], orphan["gpu_time_ns"]) == (None, None, 1_234)

    # The launch counts are what they were: the captured launches count where they were captured.
    launches = {
        (r["name"], r["site_function"]): r["events"]
        for r in rows(con, "SELECT name, site_function, events FROM kernel_launch_sites")
    }
    assert launches[("_Z4gemmIfEvPT_S1_", "gemm_site")] == 5
    assert launches[("relu_kernel", "capture_graph")] == 1


def test_memcpy_and_memset_sites(workload) -> None:
    _result, _run, con = workload
    (copy,) = rows(con, "SELECT copy_kind, api, site_function, copies, bytes, gpu_time_ns, gb_per_s FROM memcpy_sites")
    assert copy == {
        "copy_kind": "HtoD",
        "api": "cudaMemcpyAsync",
        "site_function": "copy_site",
        "copies": 1,
        "bytes": 1 << 20,
        "gpu_time_ns": 50_000,
        "gb_per_s": pytest.approx((1 << 20) / 50_000),
    }
    (zero,) = rows(con, "SELECT api, site_function, sets, bytes, gpu_time_ns FROM memset_sites")
    assert zero == {
        "api": "cudaMemsetAsync",
        "site_function": "zero_site",
        "sets": 1,
        "bytes": 4096,
        "gpu_time_ns": 2_000,
    }


def test_show_prints_gpu_time_beside_tracebacks(workload, tmp_path: Path) -> None:
    _result, _run, con = workload
    db = Path(con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()[0])
    (gemm_site,) = con.execute("SELECT site_key FROM kernel_launch_sites WHERE name = '_Z4gemmIfEvPT_S1_'").fetchone()
    # A specialized call is another stack to CPython: the site's launches come from more than one.
    gemm_stack, gemm_kernels, gemm_ns = con.execute(
        """
        SELECT stack_id, executions, gpu_time_ns FROM stack_gpu_time
        WHERE role = 'launch' AND stack_id IN (SELECT stack_id FROM events WHERE name = '_Z4gemmIfEvPT_S1_')
        ORDER BY executions DESC LIMIT 1
        """
    ).fetchone()
    (capture_stack, capture_site) = con.execute(
        """
        SELECT e.stack_id, s.site_key FROM events e JOIN kernel_launch_sites s ON s.name = e.name
        WHERE e.name = 'relu_kernel' AND e.kind = 'kernel_launch'
        """
    ).fetchone()
    (graph_event,) = con.execute("SELECT min(event_id) FROM events WHERE kind = 'graph_launch'").fetchone()

    def show(*args: str) -> str:
        result = subprocess.run([*TBPIPE, "show", "--db", str(db), *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "# GPU time (launched here): 40 µs in 5 kernels" in show("--site", gemm_site)
    assert f"# GPU time (launched here): {gemm_ns / 1000:.3g} µs in {gemm_kernels} kernels" in show(
        "--stack", str(gemm_stack)
    )
    assert "# GPU time (kernels of CUDA graphs captured here, replayed elsewhere): 2 µs in 2 kernels" in show(
        "--stack", str(capture_stack)
    )
    assert "kernels of CUDA graphs captured here" in show("--site", capture_site)
    assert "# GPU time 3.2 µs in 3 activities it caused" in show("--event", str(graph_event))


# ------------------------------------------------------------------------------- settings, losses


def test_launches_only_mode_records_as_before(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        def copy_site(c):
            double.tbpipe_double_cuda_memcpy_async(c_size_t(64), HTOD, c_size_t(0), c)
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            double.tbpipe_double_cuda_launch_kernel(b"k", 1, 1, 1, 32, 1, 1, c_size_t(0), c_size_t(0), 1)
            copy_site(2)
            print("QUEUED", kernel_record(b"k", 1, 100))
            print("ENABLED", double.tbpipe_double_activity_enabled(10), double.tbpipe_double_enabled(3, 13),
                  double.tbpipe_double_enabled(2, 41))
        """,
        env={"TBPIPE_CUDA_ACTIVITY": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert "QUEUED 0" in result.stdout and "ENABLED 0 0 0" in result.stdout
    (run,) = read_runs(tmp_path / "runs")
    assert [e["kind"] for e in as_int_times(run.tables["events"])] == ["kernel_launch"]
    assert "gpu_activity" not in run.manifest["files"] and "gpu_activity" not in run.manifest
    assert not any(key.startswith("gpu_") for key in run.manifest["counters"])


def test_synchronization_on_request_and_a_bad_setting_refused(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            double.tbpipe_double_cuda_memcpy_async(c_size_t(64), HTOD, c_size_t(0), 3)  # memcpy not asked for
            print("QUEUED", sync_record(3, 3, 9_000), memcpy_record(3, HTOD, 64, 100))
        """,
        env={"TBPIPE_CUDA_ACTIVITY": "kernel,sync"},
    )
    assert result.returncode == 0, result.stderr
    assert "QUEUED 1 0" in result.stdout
    (run,) = read_runs(tmp_path / "runs")
    assert run.tables["events"].num_rows == 0
    (sync,) = as_int_times(run.tables["gpu_activity"])
    assert (sync["kind"], sync["name"], sync["device"], sync["gpu_end"] - sync["gpu_start"]) == (
        "sync",
        "stream_synchronize",
        None,
        9_000,
    )

    (tmp_path / "bad").mkdir()
    refused = run_with_double(
        double_library,
        tmp_path / "bad",
        'capture.session(os.environ["OUT"], sources=["cuda"]).start()',
        env={"TBPIPE_CUDA_ACTIVITY": "kernels"},
    )
    assert refused.returncode != 0
    assert "TBPIPE_CUDA_ACTIVITY='kernels': unknown GPU activity kind 'kernels'" in refused.stderr


def test_a_cut_buffer_and_dropped_records_are_counted_and_the_program_runs_on(
    double_library: Path, tmp_path: Path
) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        with capture.session(os.environ["OUT"], sources=["cuda"]):
            for c in (1, 2, 3):
                double.tbpipe_double_cuda_launch_kernel(b"k", 1, 1, 1, 32, 1, 1, c_size_t(0), c_size_t(0), c)
                kernel_record(b"k", c, 100)
            double.tbpipe_double_activity_truncate_next(100)  # the third record ends past the valid bytes
            double.tbpipe_double_activity_set_dropped(7)
            double.tbpipe_double_activity_deliver(0)
            print("COUNTERS", json.dumps(_native._gpu_activity_counters()))
        print("program ran")
        """,
    )
    assert result.returncode == 0, result.stderr
    counters = json.loads(_line(result, "COUNTERS"))
    assert (counters["records"], counters["malformed"], counters["dropped"]) == (2, 1, 7)
    (run,) = read_runs(tmp_path / "runs")
    assert sorted(r["correlation_id"] for r in as_int_times(run.tables["gpu_activity"])) == [1, 2]
    assert (run.manifest["counters"]["gpu_records_malformed"], run.manifest["counters"]["gpu_records_dropped"]) == (
        1,
        7,
    )


def test_a_killed_process_keeps_the_gpu_activity_of_its_flushes(double_library: Path, tmp_path: Path) -> None:
    result = run_with_double(
        double_library,
        tmp_path,
        """
        import signal
        s = capture.session(os.environ["OUT"], sources=["cuda"], flush_interval_s=0.2).start()
        double.tbpipe_double_cuda_launch_kernel(b"k", 1, 1, 1, 32, 1, 1, c_size_t(0), c_size_t(0), 11)
        kernel_record(b"k", 11, 100)  # never delivered by the "GPU": the periodic flush asks CUPTI for it
        # Killed once a flush has written it (the first flush also loads the writer's libraries).
        deadline = time.monotonic() + 30
        while not list(s.run_dir.glob("gpu_activity-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("pending", double.tbpipe_double_activity_pending(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert result.returncode == -signal.SIGKILL
    assert "pending 0" in result.stdout
    (run,) = read_runs(tmp_path / "runs")
    assert not run.complete
    assert [r["correlation_id"] for r in as_int_times(run.tables["gpu_activity"])] == [11]


# ------------------------------------------------------------------------------- older and newer runs


def _copy_run(source: Path, target_root: Path, run_id: str, version: int, *, keep_gpu: bool) -> Path:
    target = target_root / run_id
    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["run_id"] = run_id
    for part in sorted(target.glob("*.parquet")):
        if part.name.startswith("gpu_") and not keep_gpu:
            part.unlink()
            manifest["files"].pop(part.name.rsplit("-", 1)[0], None)
    (target / "manifest.json").write_text(json.dumps(manifest))
    rewrite_as_raw_version(target, version)
    return target


def test_gpu_records_count_in_the_rows_that_runs_share_a_transaction_by(
    workload, tmp_path: Path, symbol_cache: Path
) -> None:
    """Small runs share a transaction up to `rows_per_transaction` rows, their GPU activity records
    with their events: two runs whose events fit the budget together, but not with their records,
    go in one each; with room for both, together."""
    _result, run, _con = workload
    runs = tmp_path / "runs"
    for number in (1, 2):
        _copy_run(run.path, runs, f"20250101T000000-1-0000000{number}", raw.RAW_SCHEMA_VERSION, keep_gpu=True)
    tables = read_run(runs / "20250101T000000-1-00000001").tables
    events, records = tables["events"].num_rows, tables["gpu_activity"].num_rows + tables["gpu_graph_nodes"].num_rows
    assert events and records
    hooks, sizes = transaction_sizes()
    for budget, expected in ((2 * events, [1, 1]), (2 * (events + records), [2])):
        sizes.clear()
        options = IngestOptions(
            db_path=tmp_path / f"budget-{budget}.duckdb",
            cache_dir=symbol_cache,
            progress=False,
            hooks=hooks,
            limits=IngestLimits(rows_per_transaction=budget),
        )
        assert ingest_runs([runs], options).ingested == 2
        assert sizes == expected, budget


def test_a_database_of_schema_9_gets_the_correlation_ids_out_of_the_attributes(workload, tmp_path: Path) -> None:
    _result, _run, con = workload
    query = "SELECT event_id, kind, attrs::VARCHAR, correlation_id FROM events ORDER BY event_id"
    before = con.execute(query).fetchall()
    assert sum(1 for *_rest, correlation in before if correlation is not None) >= 5
    ((source,),) = con.execute(
        "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"
    ).fetchall()
    old = tmp_path / "schema9.duckdb"
    shutil.copy(source, old)
    # As schema 9 held the events: the correlation id inside the attributes, no column for it.
    downgrade = duckdb.connect(str(old))
    try:
        for statement in (
            "CREATE TABLE events_9 AS SELECT * EXCLUDE (correlation_id) REPLACE (event_attrs(attrs, correlation_id) AS attrs) "
            "FROM event_rows ORDER BY event_id",
            "DROP VIEW events",
            "DROP TABLE event_rows",
            "ALTER TABLE events_9 RENAME TO event_rows",
            "DELETE FROM schema_versions WHERE version = 10",
            "DELETE FROM sql_modules",
        ):
            downgrade.execute(statement)
        assert "correlation_id" not in [
            c for (c,) in downgrade.execute("SELECT column_name FROM (DESCRIBE event_rows)").fetchall()
        ]
    finally:
        downgrade.close()
    open_database(old).close()  # a read-write open migrates
    migrated = duckdb.connect(str(old), read_only=True)
    try:
        after = migrated.execute(query).fetchall()
        joined = migrated.execute(
            "SELECT count(*) FROM gpu_activity a JOIN event_rows e ON e.event_id = a.event_id AND e.correlation_id = a.correlation_id"
        ).fetchall()
    finally:
        migrated.close()
    assert [(i, k, json.loads(a) if a else None, c) for i, k, a, c in after] == [
        (i, k, json.loads(a) if a else None, c) for i, k, a, c in before
    ]
    assert joined[0][0] >= 5


EVENTS_BY_RUN = (
    "SELECT run_id, list((kind, name, attrs::VARCHAR, correlation_id) ORDER BY event_id) FROM events GROUP BY ALL"
)


def test_runs_of_the_previous_raw_version_are_still_ingested(workload, tmp_path: Path, symbol_cache: Path) -> None:
    _result, run, _con = workload
    runs = tmp_path / "runs"
    _copy_run(run.path, runs, "20250101T000000-1-00000001", 1, keep_gpu=False)
    _copy_run(run.path, runs, "20250101T000000-1-00000002", 1, keep_gpu=True)  # a table version 1 never had
    _copy_run(run.path, runs, "20250101T000000-1-00000003", raw.RAW_SCHEMA_VERSION + 1, keep_gpu=False)
    _copy_run(run.path, runs, "20250101T000000-1-00000004", raw.RAW_SCHEMA_VERSION, keep_gpu=True)
    # Version 2 kept a launch's correlation id in its attributes: the GPU activity still joins.
    _copy_run(run.path, runs, "20250101T000000-1-00000005", 2, keep_gpu=True)
    assert read_run(runs / "20250101T000000-1-00000001").tables["gpu_activity"].num_rows == 0
    db = tmp_path / "mixed.duckdb"
    loaded = ingest(
        runs, db, symbol_cache, "--runs-per-transaction", "1"
    )  # each run's events by a statement of its own
    assert loaded.returncode == 1, loaded.stdout + loaded.stderr  # some runs quarantined, the others loaded
    con = duckdb.connect(str(db), read_only=True)
    try:
        ingested = dict(
            con.execute(
                "SELECT r.run_id, count(a.activity_id) FROM runs r LEFT JOIN gpu_activity a USING (run_number) GROUP BY ALL"
            ).fetchall()
        )
        events = {
            run_id: [
                (kind, name, json.loads(attrs) if attrs else None, correlation)
                for kind, name, attrs, correlation in rows
            ]
            for run_id, rows in con.execute(EVENTS_BY_RUN).fetchall()
        }
        # Stored once, in its column: the version 2 run's attributes lost it to the column.
        assert con.execute("SELECT count(*) FROM event_rows WHERE attrs->>'correlation_id' IS NOT NULL").fetchall() == [
            (0,)
        ]
    finally:
        con.close()
    # The same events read back from either version: attributes with the correlation id, and the column.
    assert events["20250101T000000-1-00000005"] == events["20250101T000000-1-00000004"]
    # Both versions' events read by one statement (several runs to a transaction): the same again.
    together = runs.parent / "together"
    for run_id in ("20250101T000000-1-00000004", "20250101T000000-1-00000005"):
        shutil.copytree(runs / run_id, together / run_id)
    one_statement = tmp_path / "together.duckdb"
    options = IngestOptions(db_path=one_statement, cache_dir=symbol_cache, progress=False, runs_per_transaction=8)
    assert ingest_runs([together], options).ok
    con = duckdb.connect(str(one_statement), read_only=True)
    try:
        assert {
            run_id: [(k, n, json.loads(a) if a else None, c) for k, n, a, c in rows]
            for run_id, rows in con.execute(EVENTS_BY_RUN).fetchall()
        } == {run_id: events[run_id] for run_id in ("20250101T000000-1-00000004", "20250101T000000-1-00000005")}
    finally:
        con.close()
    assert sum(1 for _k, _n, attrs, correlation in events["20250101T000000-1-00000004"] if correlation) >= 5
    assert all(
        attrs["correlation_id"] == correlation
        for _k, _n, attrs, correlation in events["20250101T000000-1-00000004"]
        if correlation is not None
    )
    assert ingested == {
        "20250101T000000-1-00000001": 0,
        "20250101T000000-1-00000004": 17,
        "20250101T000000-1-00000005": 17,
    }
    output = loaded.stdout + loaded.stderr
    # The version-1 run with a GPU part, quarantined: that table came with version 2.
    assert (
        "20250101T000000-1-00000002/gpu_activity-000001.parquet: expected table 'gpu_activity' schema version 2"
        in output
    )
    assert f"raw schema version {raw.RAW_SCHEMA_VERSION + 1}, this tbpipe reads 1 to {raw.RAW_SCHEMA_VERSION}" in output


def test_runs_loaded_beside_one_another_number_and_join_their_activity_apart(
    workload, tmp_path: Path, symbol_cache: Path
) -> None:
    """Three copies of the run in one ingest: the later ones' events load beside the transaction
    before them, which adds the event names and the activity ids they follow. Each copy still joins
    its activity to its own launches, as the run alone does, under ids of its own."""
    _result, run, con = workload
    runs = tmp_path / "runs"
    for k in range(3):
        _copy_run(run.path, runs, f"20250101T000000-1-0000000{k}", raw.RAW_SCHEMA_VERSION, keep_gpu=True)
    db = tmp_path / "three.duckdb"
    loaded = ingest(runs, db, symbol_cache)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    per_run = """
        SELECT a.run_number, list((a.name, a.correlation_id, e.correlation_id, e.event_id IS NULL)
                                ORDER BY a.activity_id) AS joined,
               count(DISTINCT a.activity_id) AS ids
        FROM gpu_activity a LEFT JOIN event_rows e USING (event_id)
        WHERE a.event_id IS NULL OR e.run_number = a.run_number
        GROUP BY a.run_number ORDER BY a.run_number
        """
    ((alone,),) = con.execute(
        "SELECT list((a.name, a.correlation_id, e.correlation_id, e.event_id IS NULL) ORDER BY a.activity_id) FROM gpu_activity a LEFT JOIN event_rows e USING (event_id)"
    ).fetchall()
    three = duckdb.connect(str(db), read_only=True)
    try:
        copies = three.execute(per_run).fetchall()
        distinct_ids = three.execute("SELECT count(DISTINCT activity_id) = count(*) FROM gpu_activity").fetchall()
        time_counts = three.execute(
            "SELECT run_number, sum(executions), sum(gpu_time_ns), count(name_id) FROM gpu_time_counts GROUP BY ALL ORDER BY 1"
        ).fetchall()
    finally:
        three.close()
    assert [number for number, _joined, _ids in copies] == [1, 2, 3]
    assert all(joined == alone and ids == len(alone) for _number, joined, ids in copies)
    assert sum(1 for _name, _activity, launch, missing in alone if not missing) >= 5
    assert distinct_ids == [(True,)]
    assert len({tuple(totals) for _number, *totals in time_counts}) == 1 and len(time_counts) == 3
