"""Runs ingested again: an unchanged run is found present and changes nothing, and a run copied to
two folders goes in once; a run a killed capture left incomplete is loaded (noting what it lacks),
and loaded again, not twice, once its files change; better debug info arriving later re-symbolizes
the stored frames and their call sites."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pyarrow as pa
import pytest
from support.ingest import _copy, _synthetic_tables, ingest, rows, snapshot
from support.runs import read_run

from tbpipe.pipeline.db.ingest import IngestLimits
from tbpipe.pipeline.rawrun import find_run_dirs


def test_reingest_changes_nothing(workload_db, workload_runs, symbol_cache) -> None:
    before = snapshot(workload_db)
    summary = ingest(workload_db, workload_runs, cache=symbol_cache)
    assert (summary.ingested, summary.present, summary.events, summary.new_stacks) == (0, 1, 0, 0)
    assert snapshot(workload_db) == before


def test_one_run_in_two_folders_goes_in_once(tmp_path, good_run, symbol_cache) -> None:
    """A run copied to two folders goes in once, the copy found present: in one batch (the copy
    waits for the next batch, after its twin is loaded) or in batches of one run (the copy was
    prepared ahead, on the preparing thread, before its twin was loaded). Two loads of one run id
    used to fail the whole ingest on the runs table's key."""
    for batch_runs in (64, 1):
        runs = tmp_path / f"runs{batch_runs}"
        first = _copy(good_run, runs, "a")
        shutil.copytree(first, runs / "b")
        db = tmp_path / f"t{batch_runs}.duckdb"
        summary = ingest(db, runs, cache=symbol_cache, limits=IngestLimits(batch_runs=batch_runs))
        assert sorted(o.status for o in summary.outcomes) == ["ingested", "present"]
        assert rows(db, "SELECT count(*), min(run_number) FROM runs") == [(1, 1)]
        assert rows(db, "SELECT count(*) FROM events") == [(read_run(good_run).tables["events"].num_rows,)]


# ------------------------------------------------------------------------------------------------------ incomplete runs


SIGKILLED = """
import os, signal, sys, time
from tbpipe import capture
session = capture.session(sys.argv[1], flush_interval_s=0.2).start()
def deep(n):
    if n:
        return deep(n - 1)
    for i in range(500):
        capture.record("kernel_launch", "before_kill", i=i)
deep(3)
# Killed once a flush has written them (the first flush also loads the writer's libraries: past a
# second on a loaded machine), and a few flushes more.
deadline = time.monotonic() + 30
while not list(session.run_dir.glob("events-*.parquet")) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkilled_capture_is_ingested_incomplete(tmp_path, symbol_cache) -> None:
    out = tmp_path / "runs"
    script = tmp_path / "killed.py"
    script.write_text(SIGKILLED)
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    db = tmp_path / "t.duckdb"
    summary = ingest(db, out, cache=symbol_cache)
    assert (summary.ingested, summary.incomplete, summary.events) == (1, 1, 500)
    complete, ended, events = rows(db, "SELECT complete, ended_at, events FROM runs")[0]
    assert (complete, ended, events) == (False, None, 500)
    assert rows(db, "SELECT count(*), count(stack_id) FROM events") == [(500, 500)]
    assert rows(db, "SELECT site_function, events FROM call_sites") == [("deep", 500)]

    # Ingesting it again changes nothing while its files stay the same ...
    assert ingest(db, out, cache=symbol_cache).present == 1
    # ... and once they change (here: the run is marked complete) it is loaded again, not twice.
    (run_dir,) = find_run_dirs([out])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["complete"] = True
    manifest["ended_at"] = manifest["updated_at"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    summary = ingest(db, out, cache=symbol_cache)
    assert [o.status for o in summary.outcomes] == ["updated"]
    assert rows(db, "SELECT complete, events FROM runs") == [(True, 500)]
    assert rows(db, "SELECT count(*), sum(events) FROM event_counts") == [(1, 500)]


def test_a_rolled_up_incomplete_run_loaded_again_leaves_no_roll_up(tmp_path, symbol_cache) -> None:
    """An incomplete run rolled up by `tbpipe retain`, then loaded again once its files changed:
    its roll-up goes with its old rows, and the run reads as loaded, with its events."""
    from tbpipe.pipeline.db.retain import ROLLED_UP_TABLES, RetainPolicy, retain

    out = tmp_path / "runs"
    script = tmp_path / "killed.py"
    script.write_text(SIGKILLED)
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    db = tmp_path / "t.duckdb"
    assert ingest(db, out, cache=symbol_cache).incomplete == 1
    retain(db, RetainPolicy(keep_runs=0))
    assert rows(db, "SELECT count(*) FROM rolled_up_counts") != [(0,)]
    (run_dir,) = find_run_dirs([out])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["complete"] = True
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    assert [o.status for o in ingest(db, out, cache=symbol_cache).outcomes] == ["updated"]
    assert [rows(db, f"SELECT count(*) FROM {table}") for table in ROLLED_UP_TABLES] == [[(0,)]] * len(ROLLED_UP_TABLES)
    assert rows(db, "SELECT rolled_up_at, events FROM runs") == [(None, 500)]
    assert rows(db, "SELECT site_function, events FROM call_sites") == [("deep", 500)]


def test_unflushed_stacks_of_a_killed_run_are_noted(tmp_path, symbol_cache) -> None:
    from support.synthetic import manifest_for, write_run

    run = _synthetic_tables()
    events = run["events"]
    orphan = events.slice(0, 1).set_column(4, "stack_id", pa.array([12345], pa.uint64()))
    run["events"] = pa.concat_tables([events, orphan])
    write_run(tmp_path / "runs" / "orphan", manifest_for("20260101T000000-1-orphan", complete=False), run)
    db = tmp_path / "t.duckdb"
    summary = ingest(db, tmp_path / "runs", cache=symbol_cache)
    (outcome,) = summary.outcomes
    assert outcome.status == "ingested" and not outcome.complete
    assert any("1 events refer to stacks the run does not hold" in note for note in outcome.notes)
    assert rows(db, "SELECT count(*), count(stack_id) FROM events") == [(events.num_rows + 1, events.num_rows)]


def test_a_run_killed_before_its_first_flush(tmp_path, symbol_cache) -> None:
    from support.synthetic import manifest_for, write_run

    write_run(tmp_path / "runs" / "empty", manifest_for("20260101T000000-1-empty", complete=False), {})
    db = tmp_path / "t.duckdb"
    summary = ingest(db, tmp_path / "runs", cache=symbol_cache)
    assert [(o.status, o.complete, o.events) for o in summary.outcomes] == [("ingested", False, 0)]
    assert rows(db, "SELECT complete, events, stacks FROM runs") == [(False, 0, 0)]


# ---------------------------------------------------------------------------------------------- better debug info later


LIB_C = """int helper(int x) { return x * 3 + 1; }
int entry(int x) {
    return helper(x) + 2;
}
"""


@pytest.mark.skipif(not all(shutil.which(t) for t in ("gcc", "objcopy", "strip")), reason="needs gcc and binutils")
def test_better_debug_info_later_improves_stored_stacks(tmp_path) -> None:
    from elftools.elf.elffile import ELFFile
    from support.synthetic import manifest_for, write_run

    from tbpipe.pipeline.symbols.elf import inspect_elf
    from tbpipe.schemas import raw

    for folder in ("full", "debug", "stripped"):
        (tmp_path / folder).mkdir()
    (tmp_path / "lib.c").write_text(LIB_C)
    full, debug, stripped = (
        tmp_path / "full/libdemo.so",
        tmp_path / "debug/libdemo.debug",
        tmp_path / "stripped/libdemo.so",
    )
    subprocess.run(
        ["gcc", "-O0", "-g", "-shared", "-fPIC", "-Wl,--build-id", str(tmp_path / "lib.c"), "-o", str(full)], check=True
    )
    subprocess.run(["objcopy", "--only-keep-debug", str(full), str(debug)], check=True)
    subprocess.run(["strip", "--strip-all", str(full), "-o", str(stripped)], check=True)
    build_id = inspect_elf(str(stripped)).build_id
    with open(full, "rb") as handle:
        entry = ELFFile(handle).get_section_by_name(".symtab").get_symbol_by_name("entry")[0]["st_value"]

    stacks = pa.table(
        {
            "stack_id": pa.array([1], pa.uint64()),
            "thread_id": pa.array([1], pa.int64()),
            "status": pa.array([raw.STACK_NO_PYTHON], pa.uint32()),
            "native": pa.array(
                [[{"module": 0, "offset": entry + 4, "flags": raw.NATIVE_FRAME_EXACT_PC}]],
                raw.stacks_schema().field("native").type,
            ),
            "python": pa.array([[]], raw.stacks_schema().field("python").type),
        }
    )
    modules = pa.table(
        {
            "module_index": pa.array([0], pa.int32()),
            "path": [str(stripped)],
            "build_id": [build_id],
            "load_bias": pa.array([0], pa.uint64()),
            "exec_ranges": pa.array([[]], raw.modules_schema().field("exec_ranges").type),
            "eval_ranges": pa.array([[]], raw.modules_schema().field("eval_ranges").type),
        }
    )
    events = pa.table(
        {
            "ts": pa.array([1_700_000_000_000_000_000], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
            "thread_id": pa.array([1], pa.int64()),
            "kind": ["kernel_launch"],
            "name": ["native_only"],
            "stack_id": pa.array([1], pa.uint64()),
            "attrs": pa.nulls(1, pa.string()),
        }
    )
    runs = tmp_path / "runs"
    write_run(
        runs / "r",
        manifest_for("20260101T000000-1-native"),
        {"events": events, "stacks": stacks, "modules": modules, "code": raw.code_schema().empty_table()},
    )
    db, cache = tmp_path / "t.duckdb", tmp_path / "symbols"

    ingest(db, runs, cache=cache)
    assert rows(db, "SELECT quality FROM modules") == [("symbols",)]
    assert rows(db, "SELECT function, file, line FROM stack_frames") == [("entry", None, None)]
    assert rows(db, "SELECT site_function, site_file, site_line FROM call_sites") == [("entry", None, None)]

    # The debug file turns up later: the next ingest redoes the stored frames, and the call site.
    summary = ingest(db, cache=cache, debug_dirs=[tmp_path / "debug"])
    assert summary.refreshed_modules == [build_id]
    assert rows(db, "SELECT quality FROM modules") == [("dwarf",)]
    ((function, file, line),) = rows(db, "SELECT function, file, line FROM stack_frames")
    assert (function, file.endswith("lib.c"), line) == ("entry", True, 2)  # entry+4: its prologue
    assert rows(db, "SELECT site_function, site_line, events FROM call_sites") == [("entry", 2, 1)]
