"""`tbpipe ingest` end to end: real runs (captured here or in child processes) into real DuckDB files.
The frames stored equal the in-process reference (the combined order's edge cases too), equal stacks
of different runs are stored once; the process the ingest runs in (huge pages off, reading threads
below the loading one) and the file it leaves (no free blocks).

Sites, idempotence, damaged runs, kills and concurrent ingests, transactions and runs read without
their frames have modules of their own (tests/test_ingest_*.py); the runs they share are session
fixtures (tests/conftest.py), their helpers in tests/support/."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import duckdb
import pytest
from support.ingest import _synthetic_night, _synthetic_tables, ingest, rows
from support.runs import read_run

from tbpipe.pipeline.db import open_database
from tbpipe.pipeline.db import read as db_read
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.ingest import IngestHooks
from tbpipe.pipeline.rawrun import find_run_dirs
from tbpipe.pipeline.stacks.render import symbolize_stacks


def test_db_frames_match_the_in_process_reference(workload_db, workload_runs, symbol_cache) -> None:
    assert_frames_match_reference(workload_db, workload_runs, symbol_cache)


def assert_frames_match_reference(db: Path, runs: Path, cache: Path) -> int:
    """Every stack's frames in the database equal `pipeline.stacks.symbolize_stacks` of the raw run."""
    from tbpipe.pipeline.symbols import Symbolizer

    con = open_database(db, read_only=True)
    compared = 0
    try:
        with Symbolizer(cache_dir=cache, jobs=1, progress=False) as symbolizer:
            for run_dir in find_run_dirs([runs]):
                run = read_run(run_dir)
                reference = symbolize_stacks(
                    run.tables["stacks"], run.tables["modules"], run.tables["code"], symbolizer
                )
                raw_ids = run.tables["events"]["stack_id"].to_pylist()
                db_ids = [
                    r[0]
                    for r in query_rows(
                        con, "SELECT stack_id FROM events WHERE run_id = ? ORDER BY event_id", [run.run_id]
                    )
                ]
                to_db = {}
                for raw_id, db_id in zip(raw_ids, db_ids):
                    to_db.setdefault(raw_id, db_id)
                for raw_id, expected in zip(run.tables["stacks"]["stack_id"].to_pylist(), reference):
                    if raw_id not in to_db:
                        continue
                    got = db_read.stack_frames(con, to_db[raw_id])

                    def key(f):
                        return (f["kind"], f["name"], f["filename"], f["line"], bool(f.get("inlined")))

                    assert [key(f) for f in got] == [key(f) for f in expected]
                    compared += 1
    finally:
        con.close()
    assert compared
    return compared


# -------------------------------------------------------------------------------------------- combined order edge cases


def test_interleaving_edge_cases_match_the_reference(tmp_path, symbol_cache) -> None:
    from support.synthetic import manifest_for, write_run

    runs = tmp_path / "runs"
    write_run(runs / "edge", manifest_for("20260101T000000-1-edges"), _synthetic_tables())
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.new_stacks == 6
    assert assert_frames_match_reference(db, runs, symbol_cache) == 6
    problems = dict(rows(db, "SELECT s.stack_id, s.problem FROM stacks s"))
    texts = sorted(p for p in problems.values() if p)
    assert texts == [
        "2 Python frames had no eval-loop frame to match; showing the Python stack alone",
        "native walk stopped early; 2 outer Python frames follow it",
    ]
    # Unsymbolized frames are explained, grouped by reason, with the modules they are in.
    groups = {g.reason: g for g in summary.unsymbolized.values()}
    no_debug = next(g for reason, g in groups.items() if reason.startswith("no debug info for build-ID"))
    assert no_debug.frames == 2 and list(no_debug.modules) == ["00112233445566778899aabbccddeeff00112233"]
    quality, reason = rows(db, "SELECT quality, reason FROM modules WHERE path = '/nonexistent/libfake.so'")[0]
    assert quality == "none" and "no debug info for build-ID" in reason
    # The empty stack has no site; the one sited on a native frame is not a user site.
    assert rows(db, "SELECT count(*) FROM stack_sites WHERE site_id IS NULL") == [(1,)]


def test_equal_stacks_of_different_runs_are_stored_once(tmp_path, symbol_cache) -> None:
    from support.synthetic import SyntheticConfig, generate

    runs = tmp_path / "runs"
    generated = generate(
        runs,
        SyntheticConfig(runs=3, events=6000, unique_stacks=300, native_addresses=500, code_objects=100, max_modules=4),
    )
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.events == 6000
    # Each run numbers its modules, code objects and stacks its own way; equal content is one stack.
    assert summary.new_stacks == generated.stacks_used
    assert rows(db, "SELECT count(*), count(DISTINCT stack_hash) FROM stacks") == [(generated.stacks_used,) * 2]
    assert rows(db, "SELECT sum(events) FROM call_sites") == [(6000,)]
    assert assert_frames_match_reference(db, runs, symbol_cache) >= generated.stacks_used


# --------------------------------------------------------------------------------------------- the process and the file


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_THP_DISABLE is Linux's")
def test_ingest_runs_without_transparent_huge_pages_and_restores_the_setting(tmp_path, symbol_cache) -> None:
    """While runs load, the process has transparent huge pages off (the kernel would zero a fresh
    2 MB page for each buffer the ingest makes and drops); after it, the setting is as it was."""
    import ctypes

    prctl = ctypes.CDLL(None).prctl
    get_thp_disable, set_thp_disable = 42, 41

    def thp_disabled() -> int:
        return prctl(get_thp_disable, 0, 0, 0, 0)

    seen = []
    hooks = IngestHooks(laying_out=lambda _run_ids: seen.append(thp_disabled()))
    runs = tmp_path / "runs"
    _synthetic_night(runs, 2)
    initial = thp_disabled()
    try:
        for before in (0, 1):  # a process that had them off keeps them off
            prctl(set_thp_disable, before, 0, 0, 0)
            seen.clear()
            assert ingest(tmp_path / f"{before}.duckdb", runs, cache=symbol_cache, hooks=hooks).ingested == 2
            assert seen == [1] and thp_disabled() == before
    finally:
        prctl(set_thp_disable, initial, 0, 0, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_runs_are_read_ahead_at_a_lower_priority_than_the_loading_thread(tmp_path, symbol_cache) -> None:
    """The threads that read runs ahead run READ_NICE above the loading thread's nice value (it is
    the critical path), and the loading thread's own is left as it was."""
    from tbpipe.pipeline.db.ingest.tuning import READ_NICE

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    readers, loaders = [], []
    hooks = IngestHooks(
        run_read=lambda _run_dir, _whole: readers.append(nice()), laying_out=lambda _ids: loaders.append(nice())
    )
    runs = tmp_path / "runs"
    _synthetic_night(runs, 3)
    before = nice()
    assert ingest(tmp_path / "db.duckdb", runs, cache=symbol_cache, hooks=hooks).ingested == 3
    assert loaders and set(loaders) == {before} and nice() == before
    assert len(readers) == 3 and set(readers) == {min(19, before + READ_NICE)}


def _blocks(db: Path) -> tuple[int, int]:
    """(blocks in the file, free blocks among them)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        total, free = con.execute("SELECT total_blocks, free_blocks FROM pragma_database_size()").fetchone()
    finally:
        con.close()
    return total, free


def test_runs_of_many_events_leave_no_free_blocks_and_a_reloaded_run_its_space_back(tmp_path, symbol_cache) -> None:
    """Runs past a row group of events each (122,880 rows) end in a partial row group; DuckDB's
    vacuum would merge those at the closing checkpoint and leave the blocks they were in free in
    the file. The ingest pauses it, unless it deleted rows: a run loaded again gets its old rows'
    space back (the file does not grow by the rows it replaced)."""
    from support.synthetic import SyntheticConfig, generate

    runs = tmp_path / "runs"
    generate(
        runs,
        SyntheticConfig(
            runs=3, events=390_000, unique_stacks=300, native_addresses=500, code_objects=100, max_modules=4
        ),
    )
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.events == 390_000
    total, free = _blocks(db)
    assert free == 0, f"{free} of {total} blocks free after a fresh ingest"
    assert rows(
        db, "SELECT count(DISTINCT row_group_id) > 390_000 // 122_880 FROM pragma_storage_info('event_rows')"
    ) == [(True,)]  # the partial row groups were kept, not merged

    # One run, loaded while incomplete, is loaded again once complete: its rows are deleted and
    # inserted again, and the closing checkpoint vacuums (the deleted rows' blocks are reused).
    first = sorted(p for p in runs.iterdir() if p.is_dir())[0]
    manifest = json.loads((first / "manifest.json").read_text())
    (first / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    db2 = tmp_path / "t2.duckdb"
    assert ingest(db2, runs, cache=symbol_cache).ok
    before, _free = _blocks(db2)
    (first / "manifest.json").write_text(json.dumps(manifest))
    summary = ingest(db2, runs, cache=symbol_cache)
    assert summary.ok and [o.status for o in summary.outcomes].count("updated") == 1
    assert rows(db2, "SELECT count(*) FROM event_rows") == [(390_000,)]
    after, free = _blocks(db2)
    # The replaced rows left in place would add the run's share, about a third of the blocks; how
    # DuckDB's threads split the inserts moves the count by a few blocks either way.
    assert after - free <= before * 1.15, (before, after, free)
