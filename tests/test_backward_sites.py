"""sql/backward_sites.sql on a real capture: backward ops linked to their forward ops by autograd's
sequence numbers, kernel launches to the op recorded last before them on their thread, whatever
other events carry attributes of the same names (and on DuckDB 1.5 as on 2.0)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows

# Forward ops 0-2, then their backward in reverse order, each op launching two kernels right after it
# (a thread's events often share a microsecond); events whose `seq` and `bwd_seq` are no integers
# (what user code records, op events included, carries whatever attributes it was given).
WORKLOAD = """
import sys
from tbpipe import capture

with capture.session(sys.argv[1]):
    capture.record("user", "note", seq="first", bwd_seq=[1], fwd_thread=True)
    for step in range(3):
        capture.record("op", "aten::mm", seq=step, seq_thread=1)
    capture.record("user", "note", seq=1.5, bwd_seq="2")
    capture.record("op", "my_op", seq="x", bwd_seq={"a": 1})
    for step in reversed(range(3)):
        capture.record("op", "MmBackward0", bwd_seq=step, fwd_thread=1, bwd_node="MmBackward0")
        capture.record("kernel_launch", "gemm_bwd")
        capture.record("kernel_launch", "gemm_bwd")
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory, symbol_cache):
    root = tmp_path_factory.mktemp("backward")
    (root / "workload.py").write_text(WORKLOAD)
    done = subprocess.run(
        [sys.executable, str(root / "workload.py"), str(root / "runs")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    path = root / "db.duckdb"
    summary = ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False))
    assert summary.ingested == 1, summary.outcomes
    con = open_database(path, read_only=True)
    yield con
    con.close()


def line_of(text: str) -> int:
    return next(n for n, line in enumerate(WORKLOAD.splitlines(), 1) if text in line)


def test_backward_events_and_their_forward_ops(db) -> None:
    events = query_rows(db, "SELECT event_id, kind, name, attrs FROM events ORDER BY event_id")
    assert [name for _i, _k, name, _a in events].count("note") == 2
    forward = {json.loads(attrs)["seq"]: event_id for event_id, _k, name, attrs in events if name == "aten::mm"}
    backward = [event_id for event_id, _k, name, _a in events if name == "MmBackward0"]
    assert sorted(forward) == [0, 1, 2] and len(backward) == 3
    linked = query_rows(
        db, "SELECT event_id, kind, op_event_id, bwd_seq, forward_event_id FROM backward_forward_ops ORDER BY event_id"
    )
    assert [row[0] for row in linked if row[1] == "op"] == backward
    assert [row[1] for row in linked].count("kernel_launch") == 6
    for event_id, kind, op_event_id, bwd_seq, forward_event_id in linked:
        # A launch belongs to the backward op recorded last before it; each op to its forward op.
        assert op_event_id == (event_id if kind == "op" else max(op for op in backward if op < event_id))
        assert forward_event_id == forward[bwd_seq]
    assert query_rows(db, "SELECT count(*) FROM autograd_forward_ops") == [(3,)]
    sites = query_rows(db, "SELECT forward_site_line, count(*) FROM backward_op_sites GROUP BY ALL")
    assert sites == [(line_of('"aten::mm"'), 9)]  # all nine backward events at the forward op's line
