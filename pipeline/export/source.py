"""What every export reads: the chosen events, counted per stack, and the frames of their stacks.

`ExportSource` resolves an `ExportFilter` (runs, kind, name, call site) once, keeps the choice in
temporary tables of the (read-only) connection, and serves it as Arrow tables and record
batches; the writers in this package render those and never run SQL themselves. Everything is
counted in DuckDB (`run_stack_counts` holds the counts per run, name and stack, and
`run_thread_counts` the per-thread counts pprof labels its samples with, of runs that keep their
events and of runs `tbpipe retain` rolled up alike), and per-event data comes as record batches, so
memory stays bounded by the number of distinct stacks and frames, never by the number of events.
Per-event data (the Chrome trace) needs the runs' events: a rolled-up run is refused with a
`RolledUpError` saying so.

A *location* is one entry of a combined stack before inline expansion (a `stack_frames.slot`):
a native return address with its inline chain (innermost first), a Python frame (function, file,
line) or a marker. Equal locations of different stacks are one location, numbered from 1.

Stacks are focused by a mode of `stacks.focus` (`frames`: all by default) before any writer sees
them; a location counts as the frame that holds its address (its chain's outermost), and start-up
frames folded by program mode become one marker location named `start-up`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db import read
from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.db.read import RolledUpError
from tbpipe.pipeline.db.selectors import resolve_runs
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.progress import StepProgress
from tbpipe.pipeline.stacks import focus

BATCH_ROWS = 1 << 18

_sequence = itertools.count(1)


class NoEventsError(UsageError):
    """The filter chose no events (no such kind/name, no such site, or none of them in the runs)."""


@dataclass(frozen=True)
class ExportFilter:
    """Which events to export: those of `runs` (selectors: run id, `latest`, `latest:K=V,...`),
    optionally only of one kind, one name and one call site (`call_sites.site_key`)."""

    runs: tuple[str, ...]
    kind: str | None = None
    name: str | None = None
    site: str | None = None

    def describe(self) -> str:
        parts = []
        if self.kind is not None:
            parts.append(f"kind {self.kind!r}")
        if self.name is not None:
            parts.append(f"name {self.name!r}")
        if self.site is not None:
            parts.append(f"site {self.site}")
        return " and ".join(parts)


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    run_number: int
    pid: int | None
    host: str | None
    started_ns: int | None  # Unix epoch nanoseconds
    ended_ns: int | None
    threads: dict[int, str]  # OS thread id -> Python thread name


@dataclass(frozen=True)
class StackLocations:
    """The chosen stacks as lists of locations.

    locations: location_id, kind, module_key, module, build_id, address, exact,
               lines (list of {function, file, line, inlined}, innermost first)
    stacks:    stack_id, location_ids (innermost first)
    """

    locations: pa.Table
    stacks: pa.Table


def _arrow_batches(con: Any, sql: str, params: list, rows: int) -> Iterator[pa.RecordBatch]:
    relation = con.sql(sql, params=params)
    for name in ("to_arrow_reader", "fetch_arrow_reader", "record_batch"):
        reader = getattr(relation, name, None)
        if reader is not None:
            yield from reader(rows)
            return
    yield from query_arrow(con, sql, params).to_batches(rows)


def _starts(values: np.ndarray) -> np.ndarray:
    """Indices where a run of equal values begins in sorted `values`, and len(values) at the end."""
    if len(values) == 0:
        return np.zeros(1, np.int64)
    change = np.flatnonzero(values[1:] != values[:-1]) + 1
    return np.concatenate([[0], change, [len(values)]]).astype(np.int64)


def _grouped(table: pa.Table, key: str, value: str, name: str) -> pa.Table:
    """`table` sorted by `key` -> one row per key with the list of its `value`s, in order."""
    keys = table[key].to_numpy()
    starts = _starts(keys)
    values = table[value].combine_chunks() if table.num_rows else pa.array([], table.schema.field(value).type)
    lists = pa.LargeListArray.from_arrays(pa.array(starts, pa.int64()), values)
    return pa.table({key: pa.array(keys[starts[:-1]], table.schema.field(key).type), name: lists})


def _locations(frames: pa.Table) -> pa.Table:
    """Frames sorted by (location_id, chain_depth) -> one row per location with its lines, innermost first."""
    first = _starts(frames["location_id"].to_numpy())
    heads = frames.take(pa.array(first[:-1], pa.int64()))
    columns = {
        name: heads[name] for name in ("location_id", "kind", "module_key", "module", "build_id", "address", "exact")
    }
    line_columns = [
        frames[name].combine_chunks() if frames.num_rows else pa.array([], frames.schema.field(name).type)
        for name in ("function", "file", "line", "inlined")
    ]
    lines = pa.StructArray.from_arrays(line_columns, names=["function", "file", "line", "inlined"])
    columns["lines"] = pa.LargeListArray.from_arrays(pa.array(first, pa.int64()), lines)
    return pa.table(columns)


def focused_locations(located: StackLocations, mode: str, rules: focus.FrameRules) -> StackLocations:
    """The stacks' location lists focused by `mode` (`focus.focus_matrix`); a `start-up` marker
    location is added where program mode folds start-up frames."""
    table = located.locations
    heads = [chain[-1] if chain else {"function": None, "file": None} for chain in table["lines"].to_pylist()]
    classes = np.array(
        [
            rules.classify(kind, head["function"], head["file"], module)
            for kind, head, module in zip(table["kind"].to_pylist(), heads, table["module"].to_pylist())
        ],
        dtype=np.int64,
    ).reshape(-1)
    lists = located.stacks["location_ids"].combine_chunks()
    if isinstance(lists, pa.ChunkedArray):  # no stacks
        return located
    offsets = lists.offsets.to_numpy() - lists.offsets[0].as_py()
    values = lists.flatten().to_numpy()
    lengths = np.diff(offsets)
    width = int(lengths.max(initial=0))
    ids = np.full((len(lengths), width + 1), -1, dtype=np.int64)
    columns = np.arange(width + 1)
    inside = columns[None, :] < lengths[:, None]
    ids[inside] = values
    rows = focus.focus_matrix(
        np.where(ids[:, :width] >= 0, classes[np.maximum(ids[:, :width], 1) - 1], focus.PAD), mode
    )
    kept = np.where(rows.columns >= 0, np.take_along_axis(ids[:, :width], np.maximum(rows.columns, 0), axis=1), -1)
    start_up_id = table.num_rows + 1
    folds = rows.start_up > 0
    shown = np.full((len(lengths), width + 1), -1, dtype=np.int64)
    shown[:, :width] = kept
    shown[np.flatnonzero(folds), rows.lengths[folds]] = start_up_id
    new_lengths = rows.lengths + folds
    flat = shown[columns[None, :] < new_lengths[:, None]]
    new_offsets = np.concatenate([[0], np.cumsum(new_lengths)]).astype(np.int64)
    stacks = pa.table(
        {
            "stack_id": located.stacks["stack_id"],
            "location_ids": pa.LargeListArray.from_arrays(pa.array(new_offsets), pa.array(flat, lists.type.value_type)),
        }
    )
    if folds.any():
        start_up = {
            "location_id": start_up_id, "kind": "marker", "module_key": None, "module": None, "build_id": None,
            "address": None, "exact": None,
            "lines": [{"function": "start-up", "file": None, "line": None, "inlined": False}],
        }  # fmt: skip
        table = pa.concat_tables([table, pa.Table.from_pylist([start_up], schema=table.schema)])
    return StackLocations(table, stacks)


class ExportSource:
    """The events an `ExportFilter` chooses, read from an open tbpipe database."""

    def __init__(
        self, con: Any, choice: ExportFilter, frames: str = "all", progress: StepProgress | None = None
    ) -> None:
        """`progress`: a bar over the chosen events as they are read (its total set here)."""
        if frames not in focus.MODES:
            raise UsageError(f"frames must be one of {', '.join(focus.MODES)}, not {frames!r}")
        self.frames = frames
        if not choice.runs:
            raise UsageError("no run given: name one or more with --run (a run id, 'latest' or 'latest:K=V,...')")
        self.con = con
        self.choice = choice
        self.progress = progress or StepProgress("export", enabled=False)
        self._prefix = f"tbpipe_export_{next(_sequence)}_"
        self._tables: list[str] = []
        self.run_ids = resolve_runs(con, choice.runs)
        try:
            self._choose()
        except BaseException:
            self.close()
            raise

    def _table(self, name: str) -> str:
        return self._prefix + name

    def _create(self, name: str, sql: str, params: list | None = None) -> str:
        table = self._table(name)
        query_rows(self.con, f"CREATE TEMP TABLE {table} AS {sql}", params or [])
        self._tables.append(table)
        return table

    def _choose(self) -> None:
        choice = self.choice
        self.progress.describe(f"choosing the events of {len(self.run_ids):,} runs")
        runs = self._create(
            "runs",
            "SELECT run_id, run_number, rolled_up_at FROM runs WHERE list_contains(?, run_id)",
            [self.run_ids],
        )
        # The run numbers as literals: a constant filter reaches the rolled-up runs' blocks.
        numbers = ", ".join(str(int(n)) for (n,) in query_rows(self.con, f"SELECT run_number FROM {runs}")) or "NULL"
        names = self._create(
            "names",
            "SELECT name_id, kind, name FROM event_names WHERE (? IS NULL OR kind = ?) AND (? IS NULL OR name = ?)",
            [choice.kind, choice.kind, choice.name, choice.name],
        )
        if not query_rows(self.con, f"SELECT 1 FROM {names} LIMIT 1"):
            raise NoEventsError(f"no events of {choice.describe()} in the database")
        # `WHERE` conditions on the chosen stacks, for queries over `event_counts` (c) and `events` (e).
        self._count_filter = self._event_filter = ""
        if choice.site is not None:
            if not query_rows(self.con, "SELECT 1 FROM sites WHERE site_key = ?", [choice.site]):
                raise NoEventsError(
                    f"no call site with key {choice.site!r} in the database (keys are in `call_sites.site_key`)"
                )
            sited = self._create(
                "site_stacks",
                "SELECT s.stack_id FROM stack_sites s JOIN sites t USING (site_id) WHERE t.site_key = ?",
                [choice.site],
            )
            self._count_filter = f"AND c.stack_id IN (SELECT stack_id FROM {sited})"
            self._event_filter = f"AND e.stack_id IN (SELECT stack_id FROM {sited})"
        counts = self._create(
            "counts",
            f"""
            SELECT c.run_number, c.name_id, c.stack_id, c.events
            FROM run_stack_counts c
            WHERE c.run_number IN ({numbers}) AND c.name_id IN (SELECT name_id FROM {names})
            {self._count_filter}
            """,
        )
        self.events = int(query_rows(self.con, f"SELECT coalesce(sum(events), 0) FROM {counts}")[0][0])
        self.progress.set_total(self.events)
        if self.events == 0:
            what = f" of {choice.describe()}" if choice.describe() else ""
            raise NoEventsError(
                f"no events{what} in run{'s' if len(self.run_ids) > 1 else ''} {', '.join(self.run_ids)}"
            )
        self.runs = self._run_infos()
        self.numbers = numbers
        self.rolled_up = [
            run_id
            for (run_id,) in query_rows(
                self.con, f"SELECT run_id FROM {runs} WHERE rolled_up_at IS NOT NULL ORDER BY run_id"
            )
        ]
        self.names: dict[int, tuple[str, str]] = {
            name_id: (kind, name)
            for name_id, kind, name in query_rows(
                self.con,
                f"SELECT name_id, kind, name FROM {names} WHERE name_id IN (SELECT name_id FROM {counts}) ORDER BY name_id",
            )
        }

    def _run_infos(self) -> list[RunInfo]:
        rows = query_rows(
            self.con,
            f"""
            SELECT r.run_id, r.run_number, r.pid, r.host, epoch_ns(r.started_at), epoch_ns(r.ended_at),
                   map_keys(r.threads), map_values(r.threads)
            FROM runs r JOIN {self._table("runs")} USING (run_id)
            """,
        )
        by_id = {
            row[0]: RunInfo(row[0], row[1], row[2], row[3], row[4], row[5], dict(zip(row[6] or [], row[7] or [])))
            for row in rows
        }
        return [by_id[run_id] for run_id in self.run_ids]

    def close(self) -> None:
        for table in reversed(self._tables):
            query_rows(self.con, f"DROP TABLE IF EXISTS {table}")
        self._tables.clear()

    def __enter__(self) -> ExportSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ counts

    def stack_counts(self) -> pa.Table:
        """stack_id (NULL: events without a stack), events: the chosen events per stack, over runs and names."""
        self.progress.describe("events per stack")
        counts = query_arrow(
            self.con,
            f"""
            SELECT stack_id, sum(events)::BIGINT AS events FROM {self._table("counts")}
            GROUP BY stack_id ORDER BY stack_id NULLS FIRST
            """,
        )
        self.progress.advance(self.events)
        return counts

    def sample_batches(self, rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """run_number, name_id, thread_id, stack_id, events: the chosen events per run, name, thread and stack."""
        self.progress.describe("samples")
        for batch in _arrow_batches(
            self.con,
            f"""
            SELECT e.run_number, e.name_id, e.thread_id, e.stack_id, e.events
            FROM run_thread_counts e
            WHERE e.run_number IN ({self.numbers})
              AND e.name_id IN (SELECT name_id FROM {self._table("names")}) {self._event_filter}
            ORDER BY e.stack_id NULLS FIRST, e.run_number, e.name_id, e.thread_id
            """,
            [],
            rows,
        ):
            yield batch
            self.progress.advance(int(batch.column("events").to_numpy().sum()))

    def event_batches(self, rows: int = BATCH_ROWS, numbers_as_text: bool = False) -> Iterator[pa.RecordBatch]:
        """event_id, run_number, ts_us (Unix epoch microseconds), thread_id, name_id, stack_id, attrs (JSON text):
        every chosen event, in no particular order. `numbers_as_text`: event_id, ts_us and thread_id come
        as decimal text (DuckDB converts them on all cores, for writers of text formats)."""
        self.require_events("the events themselves (a Chrome trace has one entry per event)")
        as_text = (lambda column: f"CAST({column} AS VARCHAR)") if numbers_as_text else (lambda column: column)
        self.progress.describe("events")
        for batch in _arrow_batches(
            self.con,
            f"""
            SELECT {as_text("e.event_id")} AS event_id, r.run_number, {as_text("epoch_us(e.ts)")} AS ts_us,
                   {as_text("e.thread_id")} AS thread_id, n.name_id, e.stack_id, CAST(e.attrs AS VARCHAR) AS attrs
            FROM events e
            JOIN {self._table("runs")} r USING (run_id)
            JOIN {self._table("names")} n ON n.kind = e.kind AND n.name = e.name
            WHERE true {self._event_filter}
            """,
            [],
            rows,
        ):
            yield batch
            self.progress.advance(batch.num_rows)

    def event_threads(self) -> list[tuple[int, int]]:
        """(run_number, thread_id) of every thread with chosen events."""
        self.require_events("the events themselves (a Chrome trace has one entry per event)")
        return query_rows(
            self.con,
            f"""
            SELECT DISTINCT r.run_number, e.thread_id
            FROM events e
            JOIN {self._table("runs")} r USING (run_id)
            JOIN {self._table("names")} n ON n.kind = e.kind AND n.name = e.name
            WHERE true {self._event_filter}
            ORDER BY ALL
            """,
        )

    def require_events(self, what: str) -> None:
        """RolledUpError naming the chosen runs that `tbpipe retain` rolled up (their events are gone)."""
        if self.rolled_up:
            shown = ", ".join(self.rolled_up[:3]) + (", ..." if len(self.rolled_up) > 3 else "")
            raise RolledUpError(
                f"run{'s' if len(self.rolled_up) > 1 else ''} {shown} {'were' if len(self.rolled_up) > 1 else 'was'} "
                f"rolled up (`tbpipe retain`): this export needs {what}, which are gone; their counts remain "
                "(-f pprof or -f collapsed export them)"
            )

    # ------------------------------------------------------------------------------ frames

    def stack_locations(self) -> StackLocations:
        """The chosen stacks' locations, each distinct location once (see the module's docstring)."""
        self.progress.describe("frames of the chosen stacks")
        counts = self._table("counts")
        # One row per slot (its innermost frame) with the slot's identity as a 64-bit hash: a
        # native address of a module, or a Python frame / marker by its text. (Hashing keeps the
        # grouping below off the strings; a collision would need ~2**32 distinct locations.)
        heads = self._create(
            "heads",
            f"""
            SELECT f.stack_id, f.slot,
                   CASE WHEN f.kind = 'native' THEN hash(f.kind, f.module_key, f.address, f.exact)
                        ELSE hash(f.kind, f.function, f.file, f.line) END AS location_key
            FROM stack_frames f
            WHERE f.chain_depth = 0 AND f.stack_id IN (SELECT stack_id FROM {counts})
            """,
        )
        # Each distinct location once, numbered, with one slot that has it (to read its frames from).
        keys = self._create(
            "location_keys",
            f"""
            SELECT row_number() OVER (ORDER BY min(stack_id), arg_min(slot, stack_id)) AS location_id,
                   location_key, min(stack_id) AS some_stack, arg_min(slot, stack_id) AS some_slot
            FROM {heads}
            GROUP BY location_key
            """,
        )
        # Lists are built here from sorted rows: DuckDB's ordered list() is the slow part otherwise.
        slots = query_arrow(
            self.con,
            f"""
            SELECT h.stack_id, k.location_id
            FROM {heads} h JOIN {keys} k USING (location_key)
            ORDER BY h.stack_id, h.slot
            """,
        )
        frames = query_arrow(
            self.con,
            f"""
            SELECT k.location_id, f.chain_depth, f.kind, f.module_key, f.module, m.build_id, f.address, f.exact,
                   f.function, f.file, f.line, f.inlined
            FROM {keys} k
            JOIN stack_frames f ON f.stack_id = k.some_stack AND f.slot = k.some_slot
            LEFT JOIN modules m ON m.module_key = f.module_key
            ORDER BY k.location_id, f.chain_depth
            """,
        )
        located = StackLocations(_locations(frames), _grouped(slots, "stack_id", "location_id", "location_ids"))
        if self.frames == "all":
            return located
        return focused_locations(located, self.frames, read.focus_rules(self.con))

    def stack_sites(self) -> pa.Table:
        """stack_id, site: the call site of every chosen stack as `file:line:function` (NULL when it has none)."""
        return query_arrow(
            self.con,
            f"""
            SELECT s.stack_id,
                   CASE WHEN s.site_id IS NOT NULL
                        THEN coalesce(t.file, '??') || ':' || coalesce(CAST(t.line AS VARCHAR), '?') || ':' || coalesce(t.function, '??')
                   END AS site
            FROM stack_sites s LEFT JOIN sites t USING (site_id)
            WHERE s.stack_id IN (SELECT stack_id FROM {self._table("counts")})
            ORDER BY s.stack_id
            """,
        )
