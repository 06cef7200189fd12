"""Events counted per run, name and call site (pipeline/db/ingest/site_counts.py) on a small
hand-made case: which rows count under which site (none for events without a stack, stacks without
a `stack_sites` row), the site's file and line from its stack with the most events (ties to the
greatest file and line, nulls passed over), user code if any stack is; the runs counted, the stored
stacks' rows read for a batch, and the distinct ids of a batch's stacks."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.db.connection import open_database, query_rows
from tbpipe.pipeline.db.ingest import site_counts
from tbpipe.pipeline.db.ingest.tables import IngestDb

# stack_id: (site_id, site_file, site_line, site_is_user); stack 4 has no row.
SITES = {
    1: (10, "a.py", 3, True),
    2: (10, "b.py", 7, False),
    3: (20, None, None, False),
    5: (10, None, 9, False),
}
# (run_number, name_id, stack_id, events)
COUNTS = [
    (1, 1, 1, 5),
    (1, 1, 2, 5),  # a tie with stack 1: the greatest (file, line), b.py:7
    (1, 1, 3, 2),
    (1, 1, 4, 1),  # no stack_sites row: no site
    (1, 1, None, 4),  # no stack: no site
    (1, 2, 1, 1),
    (2, 1, 1, 3),
    (2, 1, 2, 6),  # more events than stack 1: b.py:7 though a.py < b.py does not matter
    (3, 1, 2, 5),
    (3, 1, 5, 100),  # the most events but no file: the file from the next stack, the line its own
]
COLUMNS = ("run_number", "name_id", "site_id", "events", "site_file", "site_line", "site_is_user")
EXPECTED = [
    (1, 1, 10, 10, "b.py", 7, True),
    (1, 1, 20, 2, None, None, False),
    (1, 1, None, 5, None, None, None),
    (1, 2, 10, 1, "a.py", 3, True),
    (2, 1, 10, 9, "b.py", 7, True),
    (3, 1, 10, 105, "b.py", 9, False),
]


def tables(sites: dict = SITES, counts: list = COUNTS) -> tuple[pa.Table, pa.Table]:
    """(event counts, stack sites) as the ingest hands them to the site counts, from `sites`
    (stack id -> site id, file, line, is user) and `counts` (run, name, stack id, events)."""
    ids = sorted(sites)
    stack_sites = pa.table(
        {
            "stack_id": pa.array(ids, pa.int64()),
            **{
                name: pa.array([sites[i][k] for i in ids], site_counts.COUNTED_SITE_COLUMNS[name])
                for k, name in enumerate(("site_id", "site_file", "site_line", "site_is_user"))
            },
        }
    )
    kinds = (pa.int32(), pa.int32(), pa.int64(), pa.int64())
    event_counts = pa.table(
        {
            name: pa.array([row[k] for row in counts], kinds[k])
            for k, name in enumerate(("run_number", "name_id", "stack_id", "events"))
        }
    )
    return event_counts, stack_sites


@pytest.fixture
def db(tmp_path):
    con = open_database(tmp_path / "counts.duckdb")
    try:
        counts, stack_sites = tables()
        ingest = IngestDb(con)
        ingest.insert("INSERT INTO stack_sites BY NAME SELECT * FROM {}", stack_sites)
        ingest.insert("INSERT INTO event_counts BY NAME SELECT * FROM {}", counts)
        yield ingest
    finally:
        con.close()


def stored(db) -> list[tuple]:
    return query_rows(db.con, f"SELECT {', '.join(COLUMNS)} FROM site_counts ORDER BY ALL NULLS LAST")


def test_the_fast_path_counts_the_hand_made_case() -> None:
    counted = site_counts.site_counts_of(*tables())
    rows = [tuple(row[c] for c in COLUMNS) for row in counted.to_pylist()]
    assert sorted(rows, key=repr) == sorted(EXPECTED, key=repr)
    # By site, none last (the order of `site_counts_by_site`).
    sites = [row[2] for row in rows]
    assert sites == sorted(sites, key=lambda s: (s is None, s or 0))


def test_the_reference_counts_the_hand_made_case_for_all_runs_or_those_named(db) -> None:
    site_counts.count_sites(db, None)
    assert stored(db) == EXPECTED
    db.con.execute("DELETE FROM site_counts")
    site_counts.count_sites(db, [2])
    assert stored(db) == [row for row in EXPECTED if row[0] == 2]
    db.con.execute("DELETE FROM site_counts")
    site_counts.count_sites(db, [1, 3])
    assert stored(db) == [row for row in EXPECTED if row[0] in (1, 3)]


def test_counting_every_run_makes_the_rolled_up_runs_leads_again_and_counting_some_does_not(db) -> None:
    # No run is rolled up here: made again, the leads are none; a lead left over from before shows which.
    db.con.execute("INSERT INTO rolled_up_leads VALUES (1, 1, 1, 10, 5, 'a.py', 3)")
    site_counts.count_sites(db, [1])
    assert query_rows(db.con, "SELECT count(*) FROM rolled_up_leads") == [(1,)]
    site_counts.count_sites(db, None)
    assert query_rows(db.con, "SELECT count(*) FROM rolled_up_leads") == [(0,)]


def test_inserted_counts_are_the_fast_paths_rows(db) -> None:
    counts, stack_sites = tables()
    site_counts.insert_site_counts(db, counts, stack_sites)
    assert stored(db) == EXPECTED
    site_counts.insert_site_counts(db, counts.slice(0, 0), stack_sites)
    assert len(stored(db)) == len(EXPECTED)


def test_a_batch_reads_the_stored_stacks_rows_it_uses_then_its_own(db) -> None:
    new = pa.table(
        {
            "stack_id": pa.array([9], pa.int32()),
            "site_id": pa.array([30], pa.int32()),
            "site_file": ["c.py"],
            "site_line": pa.array([1], pa.int64()),
            "site_is_user": [True],
            "extra": ["dropped"],
        }
    )
    rows = site_counts.sites_for_counting(db, np.array([5, 1, 5, 3, 1, 8], dtype=np.int64), new)
    assert rows.schema == pa.schema(site_counts.COUNTED_SITE_COLUMNS)
    assert rows.to_pylist() == [dict(zip(site_counts.COUNTED_SITE_COLUMNS, (i, *SITES[i]))) for i in (1, 3, 5)] + [
        {"stack_id": 9, "site_id": 30, "site_file": "c.py", "site_line": 1, "site_is_user": True}
    ]
    assert site_counts.sites_for_counting(db, np.array([2], dtype=np.int64), None)["stack_id"].to_pylist() == [2]
    assert len(rows["stack_id"].chunks) == 1
    # The batch's ids are not left registered.
    with pytest.raises(duckdb.CatalogException):
        db.con.execute("SELECT * FROM ingest_stored_stacks")


@settings(max_examples=200, deadline=None, database=None)
@given(
    ids=st.lists(st.integers(0, 40), max_size=30) | st.lists(st.integers(-(2**40), 2**40), max_size=5),
    base=st.integers(0, 2**50),
)
def test_distinct_ids_are_numpys_unique(ids, base) -> None:
    array = np.array(ids, dtype=np.int64) + base
    found = site_counts._distinct_ids(array)
    assert found.dtype == np.int64
    assert found.tolist() == np.unique(array).tolist()


def test_distinct_ids_at_the_edge_of_the_dense_range() -> None:
    span = 4 * 2 + (1 << 20)  # two ids this far apart are still marked in an array
    for high in (span, span + 1):
        assert site_counts._distinct_ids(np.array([0, high], dtype=np.int64)).tolist() == [0, high]
    assert site_counts._distinct_ids(np.array([7], dtype=np.int64)).tolist() == [7]


def counted_rows(counted: pa.Table) -> list[tuple]:
    return [tuple(row[c] for c in COLUMNS) for row in counted.to_pylist()]


def test_the_fast_paths_rows_are_typed_as_the_table(db) -> None:
    counted = site_counts.site_counts_of(*tables())
    stored_types = dict(
        db.con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'site_counts'"
        ).fetchall()
    )
    arrow_names = {pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN"}
    assert {f.name: arrow_names[f.type] for f in counted.schema} == {c: stored_types[c] for c in COLUMNS}


@pytest.mark.parametrize(
    ("sites", "counts"),
    [
        ({}, [(1, 1, 1, 3), (1, 1, None, 2)]),  # no stack has a row
        ({5: (7, "a.py", 1, True)}, [(1, 1, 5, 3), (1, 1, 9, 2), (1, 1, 1, 4)]),  # one row, stacks on both sides
        # Tied events: a stack without a file ranks below one with a file ('' first, bytewise, 'B' < 'X').
        ({1: (7, None, 5, True), 2: (7, "B.py", 1, False)}, [(1, 1, 1, 3), (1, 1, 2, 3)]),
        # Stack id 0, site id 0 (ordered first, not as no site), ids a float would not tell apart.
        (
            {0: (0, "z.py", 1, False), 1: (2**60, "a.py", 1, True), 2: (2**60 + 1, "b.py", 2, False)},
            [(1, 1, 0, 1), (1, 1, 1, 2), (1, 1, 2, 3), (1, 1, None, 4)],
        ),
    ],
)
def test_the_fast_path_is_the_reference_at_the_edges(db, sites, counts) -> None:
    event_counts, stack_sites = tables(sites, counts)
    db.con.execute("DELETE FROM stack_sites; DELETE FROM event_counts")
    db.insert("INSERT INTO stack_sites BY NAME SELECT * FROM {}", stack_sites)
    db.insert("INSERT INTO event_counts BY NAME SELECT * FROM {}", event_counts)
    site_counts.count_sites(db, None)
    fast = counted_rows(site_counts.site_counts_of(event_counts, stack_sites))
    assert fast == query_rows(db.con, f"SELECT {', '.join(COLUMNS)} FROM site_counts ORDER BY site_id NULLS LAST")
