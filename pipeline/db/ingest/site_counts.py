"""Events counted per run, name and call site (`site_counts`, what `call_sites` reads): one rule,
its reference and its fast paths side by side.

A run's `event_counts` rows (run, name, stack, events) are summed per (run, name, site of the
stack), the site taken from `stack_sites`; events without a stack, and stacks without a site or not
sited, count under no site (NULL). Each row also says where the site was in that run: the file and
line of its stack with the most events (`SITE_PLACE_ORDER`), each taken only from stacks that have
one, and whether any of its stacks is a user frame (NULL when none is sited).

- Reference: `count_sites`, SQL over the database's tables; the ingest uses it when every stack
  is sited again.
- Fast paths: `site_counts_of` (numpy over Arrow columns), which the ingest counts a transaction's
  runs with (`insert_site_counts`: a small run's counts joined and grouped in a statement cost more
  than the rest of its transaction but the commit); `spark_site_counts`, the lake's Spark job (the
  events stay in the JVM).

tests/test_rules.py holds both fast paths to the reference on random counts and sites.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_arrow
from tbpipe.pipeline.db.ingest.tables import IngestDb, run_numbers_filter
from tbpipe.pipeline.db.retain import keep_leads

# Which stack's file and line stand for a site in a run: the stack with the most events; among
# equals the greatest (file, line), so that both come from one stack and every engine picks the same.
SITE_PLACE_ORDER = "struct_pack(n := c.events, f := coalesce(s.site_file, ''), l := coalesce(s.site_line, -1))"

# The `stack_sites` columns a count of sites reads, and their types.
COUNTED_SITE_COLUMNS = {
    "stack_id": pa.int64(),
    "site_id": pa.int64(),
    "site_file": pa.string(),
    "site_line": pa.int32(),
    "site_is_user": pa.bool_(),
}


def count_sites(db: IngestDb, run_numbers: list[int] | None) -> None:
    """The reference: `site_counts` of the given runs (all runs with None) from their `event_counts`
    and the stacks' `stack_sites`. With None the rolled-up runs' kept leads are made again too (their
    sites are derived from the same `stack_sites`)."""
    where, params = run_numbers_filter("c.run_number", run_numbers) if run_numbers is not None else ("true", [])
    db.con.execute(
        f"""
        INSERT INTO site_counts BY NAME
        SELECT c.run_number, c.name_id, s.site_id, sum(c.events) AS events,
               arg_max(s.site_file, {SITE_PLACE_ORDER}) AS site_file,
               arg_max(s.site_line, {SITE_PLACE_ORDER}) AS site_line, bool_or(s.site_is_user) AS site_is_user
        FROM event_counts c
        LEFT JOIN stack_sites s USING (stack_id)
        WHERE {where}
        GROUP BY c.run_number, c.name_id, s.site_id
        -- In the order of `site_counts_by_site` (cheaper to add at the commit; see `load_events`).
        ORDER BY s.site_id
        """,
        params,
    )
    if run_numbers is None:
        keep_leads(db.con, None)


# ------------------------------------------------------------------------------------------ numpy


def sites_for_counting(db: IngestDb, stored_stack_ids: np.ndarray, new: pa.Table | None) -> pa.Table:
    """The `stack_sites` rows (`COUNTED_SITE_COLUMNS`) of the stacks a batch's runs use, by stack id,
    for `site_counts_of`: those of stacks stored before the batch, read here, and `new`, the rows of
    the stacks it brings in (numbered after them)."""
    ids = pa.table({"stack_id": pa.array(_distinct_ids(stored_stack_ids), pa.int64())})
    db.register("ingest_stored_stacks", ids)
    try:
        stored = query_arrow(
            db.con,
            f"SELECT {', '.join(COUNTED_SITE_COLUMNS)} FROM stack_sites "
            "WHERE stack_id IN (SELECT stack_id FROM ingest_stored_stacks) ORDER BY stack_id",
        )
    finally:
        db.unregister("ingest_stored_stacks")
    tables = [
        pa.table({column: table[column].cast(kind) for column, kind in COUNTED_SITE_COLUMNS.items()})
        for table in (stored, new)
        if table is not None
    ]
    return pa.concat_tables(tables).combine_chunks()


def _distinct_ids(ids: np.ndarray) -> np.ndarray:
    """np.unique(ids) for ids numbered densely (stack ids): marked in an array over their range, one
    pass instead of a sort of every use; a sort where the range is far wider than the ids."""
    if not len(ids):
        return np.asarray(ids, dtype=np.int64)
    low, high = int(ids.min()), int(ids.max())
    if high - low > 4 * len(ids) + (1 << 20):
        return np.unique(ids)
    seen = np.zeros(high - low + 1, dtype=bool)
    seen[ids - low] = True
    return np.flatnonzero(seen) + low


def insert_site_counts(db: IngestDb, counts: pa.Table, stack_sites: pa.Table) -> None:
    """`site_counts` rows of `site_counts_of`, inserted."""
    counted = site_counts_of(counts, stack_sites)
    if counted.num_rows:
        db.insert("INSERT INTO site_counts BY NAME SELECT * FROM {}", counted)


def site_counts_of(counts: pa.Table, stack_sites: pa.Table) -> pa.Table:
    """The numpy fast path: `site_counts` rows from `event_counts` rows (run_number, name_id,
    stack_id, events) and the `stack_sites` rows of their stacks (`COUNTED_SITE_COLUMNS`, by
    increasing stack id), in the order of `site_counts_by_site` (by site, no site last). Rows are
    handled by their `stack_sites` row number; the files (text) are looked up only for the groups
    that need them ranked and for the rows written."""
    grouped = _Grouped(counts, stack_sites)
    order, group, starts = grouped.order, grouped.group, grouped.starts
    # bool_or: NULL where no row has a value.
    any_user = np.zeros(len(starts), dtype=bool)
    any_user[group[grouped.column("site_is_user", False, bool)[order]]] = True
    has_user = np.zeros(len(starts), dtype=bool)
    has_user[group[grouped.valid("site_is_user")[order]]] = True
    site = grouped.site_id[starts]
    counted = pa.table(
        {
            "run_number": pa.array(grouped.run[starts], pa.int32()),
            "name_id": pa.array(grouped.name[starts], pa.int32()),
            "site_id": pa.array(site, pa.int64(), mask=site < 0),
            "events": pa.array(np.add.reduceat(grouped.events[order], starts) if len(starts) else [], pa.int64()),
            "site_file": grouped.last_valid("site_file"),
            "site_line": grouped.last_valid("site_line"),
            "site_is_user": pa.array(any_user, pa.bool_(), mask=~has_user),
        }
    )
    by_site = np.lexsort((site, site < 0))  # as `ORDER BY site_id` (NULLs last): the index's order
    return counted.take(pa.array(by_site, pa.int64()))


class _Grouped:
    """Count rows grouped by (run, name, site), each group's rows ordered by `SITE_PLACE_ORDER` (its
    greatest last): `order` (count rows, group after group), `group` (per position of `order`),
    `starts` (each group's first position) and `row` (each count row's `stack_sites` row; one past
    the end, all null, where the stack has none)."""

    def __init__(self, counts: pa.Table, stack_sites: pa.Table):
        self.stack_sites = stack_sites
        self.run = _ints(counts["run_number"])
        self.name = _ints(counts["name_id"])
        stack = _ints(pc.fill_null(counts["stack_id"], -1))
        self.events = _ints(counts["events"])
        site_stack = stack_sites["stack_id"].to_numpy(zero_copy_only=False)
        at = np.minimum(np.searchsorted(site_stack, stack), max(len(site_stack) - 1, 0))
        found = (stack >= 0) & (site_stack[at] == stack) if len(site_stack) else np.zeros(len(stack), bool)
        self.none = stack_sites.num_rows
        self.row = np.where(found, at, self.none)
        site_id = self.column("site_id", -1, np.int64)
        # Rows by group (run, name, site): run and name numbers fit side by side in one integer.
        order = np.lexsort((site_id, (self.run << 32) | self.name))
        run, name, self.site_id = self.run[order], self.name[order], site_id[order]
        change = np.ones(len(order), dtype=bool)
        if len(order):
            change[1:] = (run[1:] != run[:-1]) | (name[1:] != name[:-1]) | (self.site_id[1:] != self.site_id[:-1])
        self.run, self.name = run, name
        self.starts = np.flatnonzero(change)
        self.group = np.cumsum(change) - 1
        self.order = self._placed(order)

    def column(self, name: str, fill: Any, dtype: type) -> np.ndarray:
        """Per count row, its `stack_sites` row's value (`fill` where null or none)."""
        values = pc.fill_null(self.stack_sites[name], fill).to_numpy(zero_copy_only=False).astype(dtype)
        return np.append(values, np.array([fill], dtype=dtype))[self.row]

    def valid(self, name: str) -> np.ndarray:
        """Per count row, whether its `stack_sites` row has a value."""
        return np.append(pc.is_valid(self.stack_sites[name]).to_numpy(zero_copy_only=False), False)[self.row]

    def _placed(self, order: np.ndarray) -> np.ndarray:
        """`order` with each group's rows by (events, file or '', line or -1), files ranked bytewise
        as DuckDB ranks them. Only groups of several rows need it (most sites have one stack a run)."""
        group = self.group
        shared = np.flatnonzero(np.diff(np.append(self.starts, len(order)))[group] > 1)
        if not len(shared):
            return order
        rows_shared = order[shared]
        sites_rows = self.row[rows_shared]
        files = self.stack_sites["site_file"].take(pa.array(sites_rows, pa.int64(), mask=sites_rows == self.none))
        padded = pc.fill_null(files, "")
        distinct = pc.unique(padded)
        file_rank = pc.index_in(padded, value_set=distinct.take(pc.sort_indices(distinct)))
        line = self.column("site_line", -1, np.int64)[rows_shared]
        ranked = np.lexsort((line, _ints(file_rank), self.events[rows_shared], group[shared]))
        placed = order.copy()
        placed[shared] = rows_shared[ranked]
        return placed

    def last_valid(self, name: str) -> pa.Array:
        """Per group, the value of its greatest row where the value is not null (arg_max skips nulls)."""
        order, group = self.order, self.group
        ordered_valid = np.flatnonzero(self.valid(name)[order])
        groups = group[ordered_valid]
        last = ordered_valid[np.append(groups[1:] != groups[:-1], True)] if len(ordered_valid) else ordered_valid
        pick = np.full(len(self.starts), self.none, dtype=np.int64)
        pick[group[last]] = self.row[order[last]]
        return self.stack_sites[name].take(pa.array(pick, pa.int64(), mask=pick == self.none))


def _ints(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return values.to_numpy(zero_copy_only=False).astype(np.int64)


# ------------------------------------------------------------------------------------------ Spark


def spark_site_counts(counts: Any, stack_sites: Any, clustered_by: str | None = None) -> Any:
    """The Spark fast path: a DataFrame of `site_counts` rows from one of `event_counts` rows and
    one of `stack_sites` rows (unordered). Spark's max_by passes over rows whose ordering is null,
    as DuckDB's arg_max passes over null values.

    `clustered_by` (a grouping column, e.g. the run number): the joined rows are repartitioned by it
    before they are counted, so each of its values ends in one task and a write partitioned by it
    needs no shuffle of its own; the count is then one aggregation without a partial one before a
    shuffle (the sort aggregation's partial step saves little: most sites have one stack a run)."""
    from pyspark.sql import functions as F

    sites = stack_sites.select(*COUNTED_SITE_COLUMNS)
    order = F.struct(
        F.col("events"), F.coalesce(F.col("site_file"), F.lit("")), F.coalesce(F.col("site_line"), F.lit(-1))
    )
    joined = counts.join(sites, "stack_id", "left")
    if clustered_by is not None:
        joined = joined.repartition(clustered_by)
    return joined.groupBy("run_number", "name_id", "site_id").agg(
        F.sum("events").alias("events"),
        F.max_by("site_file", F.when(F.col("site_file").isNotNull(), order)).alias("site_file"),
        F.max_by("site_line", F.when(F.col("site_line").isNotNull(), order)).alias("site_line"),
        F.bool_or("site_is_user").alias("site_is_user"),
    )
