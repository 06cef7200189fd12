"""Call sites: exact event counts per site of the workload at known lines (tests/support/known_lines.py,
ingested once per session: `workload_db`), portable site keys, user-code rules applied to stored
stacks, sites without user frames, and the in-memory siting and site counts held to their SQL
definitions."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pyarrow as pa
from support import known_lines
from support.ingest import _synthetic_night, ingest, rows
from support.known_lines import LIBRARY_LINE, LINES, workload

from tbpipe import capture
from tbpipe.pipeline.db import open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.rawrun import find_run_dirs


def site_counts(db: Path) -> dict[tuple, int]:
    found = rows(db, "SELECT kind, name, site_function, site_file, site_line, events FROM call_sites")
    return {
        (kind, name, function.rsplit(".", 1)[-1] if function else None, file, line): events
        for kind, name, function, file, line, events in found
    }


def test_exact_event_counts_per_call_site(workload_db, library) -> None:
    here = known_lines.__file__
    assert site_counts(workload_db) == {
        ("kernel_launch", "gemm", "launch_gemm", here, LINES["gemm"]): 7,
        ("kernel_launch", "gemm", "launch_pair", here, LINES["pair_gemm"]): 3,
        ("op", "aten::mm", "launch_pair", here, LINES["pair_mm"]): 3,
        # The library's own frames are skipped: the site is the user line that called it.
        ("kernel_launch", "softmax", "workload", here, LINES["softmax"]): 5,
        # Called back from C (sorted): the site is the callback, whose frame sits under `sorted`.
        ("kernel_launch", "sort_kernel", "_key", here, LINES["sort"]): 4,
    }
    (launches,) = rows(workload_db, "SELECT sum(events) FROM kernel_launch_sites")[0]
    assert launches == 7 + 3 + 5 + 4
    (kinds,) = rows(workload_db, "SELECT list(DISTINCT kind) FROM kernel_launch_sites")[0]
    assert kinds == ["kernel_launch"]


def test_site_keys_name_file_function_and_line_offset(workload_db) -> None:
    # A Python site's key: its file relative to the longest import root holding it, its function's
    # qualified name, and its line's offset from the function's first line. No absolute path, no
    # address, no database-local id.
    import hashlib

    here = os.path.abspath(known_lines.__file__)
    roots = sorted({os.path.abspath(p or ".") for p in sys.path}, key=len, reverse=True)
    root = next(r for r in roots if here.startswith(r.rstrip("/") + "/"))
    portable = here[len(root.rstrip("/")) + 1 :]
    function, file, line, key, stored_portable = rows(
        workload_db,
        "SELECT site_function, site_file, site_line, site_key, site_portable_file FROM call_sites "
        "WHERE name = 'softmax'",
    )[0]
    assert (function, file, line) == ("workload", here, LINES["softmax"])
    assert stored_portable == portable
    offset = LINES["softmax"] - workload.__code__.co_firstlineno
    assert key == hashlib.md5(f"py\x1f{portable}\x1f{function}\x1f{offset}".encode()).hexdigest()[:16]
    keys = rows(workload_db, "SELECT DISTINCT site_key FROM call_sites WHERE site_key IS NOT NULL")
    assert keys and all(len(k) == 16 for (k,) in keys)


def test_user_code_rule_changes_sites(workload_db, symbol_cache, library) -> None:
    here = known_lines.__file__
    library_file = library.__file__
    # Saying the library is user code moves the softmax site into it, for stacks already stored.
    ingest(workload_db, cache=symbol_cache, user_code=["fakelib_tbpipe/"])
    counts = site_counts(workload_db)
    assert counts[("kernel_launch", "softmax", "launch", library_file, LIBRARY_LINE)] == 5
    # '!PREFIX' takes it back.
    ingest(workload_db, cache=symbol_cache, user_code=["!fakelib_tbpipe/"])
    counts = site_counts(workload_db)
    assert counts[("kernel_launch", "softmax", "workload", here, LINES["softmax"])] == 5
    rules = dict(rows(workload_db, "SELECT prefix, is_user FROM user_code WHERE origin = 'user'"))
    assert rules == {"fakelib_tbpipe/": False}
    # A rule changed by hand (another DuckDB client) is applied by the next ingest.
    import duckdb

    con = duckdb.connect(str(workload_db))
    con.execute("UPDATE user_code SET is_user = true WHERE prefix = 'fakelib_tbpipe/'")
    con.close()
    ingest(workload_db, cache=symbol_cache)
    assert site_counts(workload_db)[("kernel_launch", "softmax", "launch", library_file, LIBRARY_LINE)] == 5
    ingest(workload_db, cache=symbol_cache, user_code=["!fakelib_tbpipe/"])


def test_sites_without_user_frames_use_the_innermost_symbolized_frame(tmp_path, symbol_cache) -> None:
    out = tmp_path / "runs"
    with capture.session(out, native=False):
        # Only threading.py (standard library) is on this thread's Python stack.
        thread = threading.Thread(target=capture.record, args=("kernel_launch", "from_thread"))
        thread.start()
        thread.join()
    db = tmp_path / "t.duckdb"
    ingest(db, out, cache=symbol_cache)
    function, file, line, events = rows(
        db, "SELECT site_function, site_file, site_line, events FROM call_sites WHERE name = 'from_thread'"
    )[0]
    assert function.endswith("run") and file == threading.__file__ and events == 1
    (is_user,) = rows(db, "SELECT bool_or(site_is_user) FROM stack_sites")[0]
    assert is_user is False


def test_site_counts_of_stacks_from_transactions_it_cannot_see(tmp_path, symbol_cache) -> None:
    """A transaction counts its runs' sites in memory, from their event counts and the sites of
    their stacks: stored before its batch, brought in by the transactions before it (which it cannot
    see), or by itself. Counting every run again with `count_sites` (the rule's SQL reference, which
    tests/test_rules.py holds the fast path to) gives the rows the ingest stored."""
    from tbpipe.pipeline.db.ingest.site_counts import count_sites
    from tbpipe.pipeline.db.ingest.tables import IngestDb

    runs = tmp_path / "runs"
    _synthetic_night(runs, 7)
    db = tmp_path / "night.duckdb"
    run_dirs = find_run_dirs([runs])
    for chosen in (run_dirs[:3], run_dirs[3:]):  # the second ingest's runs use stored stacks too
        assert ingest(db, *chosen, cache=symbol_cache).ingested == len(chosen)
    query = (
        "SELECT run_number, name_id, site_id, events, site_file, site_line, site_is_user FROM site_counts ORDER BY ALL"
    )
    counted = rows(db, query)
    assert len(counted) > 50
    con = open_database(db)
    try:
        con.execute("DELETE FROM site_counts")
        count_sites(IngestDb(con), None)
    finally:
        con.close()
    assert rows(db, query) == counted


def test_site_counts_in_memory_place_a_site_as_the_sql_does(tmp_path) -> None:
    """Where a run's stacks show one site at several files and lines, the site is placed at the file
    and line of its stack with the most events (ties to the greater file, then line), each taken
    only from stacks that have one; stacks without a site and events without a stack count under
    no site."""
    from tbpipe.pipeline.db.ingest.site_counts import count_sites, insert_site_counts
    from tbpipe.pipeline.db.ingest.tables import IngestDb

    con = open_database(tmp_path / "sites.duckdb")
    db = IngestDb(con)
    stack_sites = pa.table(
        {
            "stack_id": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
            "site_id": pa.array([10, 10, 10, None, 11, 11], pa.int64()),
            "site_file": pa.array(["a.py", "b.py", None, None, "c.py", "c.py"]),
            "site_line": pa.array([5, 3, 7, None, None, 2], pa.int32()),
            "site_is_user": [True, True, False, False, False, False],
        }
    )
    counts = pa.table(
        {
            "run_number": pa.array([1, 1, 1, 1, 1, 1, 1, 2, 2, 2], pa.int32()),
            "name_id": pa.array([1, 1, 1, 1, 1, 1, 1, 1, 2, 2], pa.int32()),
            "stack_id": pa.array([1, 2, 3, None, 4, 5, 99, 1, 5, 6], pa.int64()),
            "events": pa.array([5, 5, 9, 4, 2, 8, 3, 1, 6, 6], pa.int64()),
        }
    )
    try:
        db.insert("INSERT INTO stack_sites BY NAME SELECT * FROM {}", stack_sites)
        db.insert("INSERT INTO event_counts BY NAME SELECT * FROM {}", counts)
        query = "SELECT run_number, name_id, site_id, events, site_file, site_line, site_is_user FROM site_counts"
        count_sites(db, [1, 2])
        by_sql = sorted(query_rows(con, query), key=str)
        con.execute("DELETE FROM site_counts")
        insert_site_counts(db, counts, stack_sites)
        in_memory = query_rows(con, query)
    finally:
        con.close()
    assert sorted(in_memory, key=str) == by_sql
    assert (1, 1, 10, 19, "b.py", 7, True) in by_sql  # file from the 5/5 tie, line from the 9 without a file
    assert (1, 1, None, 9, None, None, False) in by_sql  # no stack (4), no site (2), a stack not stored (3)
    assert (2, 2, 11, 12, "c.py", 2, False) in by_sql
    # Rows in the order of `site_counts_by_site`: by site, those without one last.
    assert [row[2] for row in in_memory] == sorted((row[2] for row in in_memory), key=lambda s: (s is None, s or 0))
