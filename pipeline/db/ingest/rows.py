"""A run's rows, inserted by column name inside its transaction: modules, stacks, frames, events, the run.

Runs are laid out in batches (`lay_out.LaidOutBatch`: their new stacks, symbols and frames computed
once), and each transaction inserts its runs' share (`RunPart`). Events go straight from the runs'
Parquet parts into `event_rows` (DuckDB reads them faster than a detour through Arrow), their raw
stack ids re-keyed to database stack ids with a join.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_rows, query_value
from tbpipe.pipeline.db.ingest.frames import insert_frame_rows
from tbpipe.pipeline.db.ingest.symbols import upsert_module_statuses
from tbpipe.pipeline.db.ingest.tables import IngestDb, QuarantineRun, run_numbers_filter, sql_text
from tbpipe.pipeline.db.schema import correlation_id_in_attrs
from tbpipe.pipeline.errors import first_line
from tbpipe.pipeline.rawrun import dangling_events_note
from tbpipe.schemas.lake import TABLES
from tbpipe.schemas.op_attributes import event_attrs_sql
from tbpipe.schemas.raw import CORRELATED_KINDS

if TYPE_CHECKING:  # the stages' hand-offs, which import this module's helpers
    from tbpipe.pipeline.db.ingest.lay_out import LaidOutBatch, RunPart, StackIds
    from tbpipe.pipeline.db.ingest.read_ahead import PreparedRun


@dataclass(frozen=True)
class LoadedRun:
    """A run as its transaction stores it: what was read, its number, and what loading it counted."""

    run: PreparedRun
    number: int
    stacks_used: int
    new_stacks: int
    dangling_events: int  # events whose stack the run does not hold (their stack is NULL)


def part_of_row_columns(
    ids: StackIds, runs: range, numbers: dict[int, int], first_event_id: int
) -> tuple[str, str, str]:
    """SQL of the event id, run number and run index of an event read by `read_parquet` (as `e`,
    with `file_row_number`) from the events parts of the runs `runs` (parts numbered on from
    `first_event_id`): each a constant list of one value per part, indexed by the part's place in
    the list read (DuckDB's `file_index`). The lists cost a fifth to a quarter less CPU than a join
    with a table of the parts (4 parts of 62k events a run; 84 parts of 2,500 events a
    transaction)."""
    parts = ids.event_files_of(runs)
    sizes = np.array([rows for _i, _path, rows in parts], dtype=np.int64)
    starts = first_event_id + np.cumsum(sizes) - sizes

    def of_part(values: list[int], sql_type: str) -> str:
        return f"([{', '.join(str(int(v)) for v in values)}]::{sql_type}[])[(e.file_index + 1)::BIGINT]"

    return (
        f"{of_part(starts.tolist(), 'BIGINT')} + e.file_row_number",
        of_part([numbers[i] for i, _path, _rows in parts], "INTEGER"),
        of_part([i for i, _path, _rows in parts], "INTEGER"),
    )


# Parts of raw schema 1 and 2 have a CUDA call's correlation id in `attrs` only: it is moved out of
# there for the events the CUDA source records (as schema 10 moved it for the rows then stored), when
# it is an integer the column holds (0 means none, as the capture writes it). This costs these parts
# a JSON parse per event. `event_attrs` puts it back.
_CORRELATED_KINDS = "[" + ", ".join(sql_text(kind) for kind in CORRELATED_KINDS) + "]"
_CORRELATION_ID_IN_ATTRS = (
    f"CASE WHEN list_contains({_CORRELATED_KINDS}, e.kind) THEN {correlation_id_in_attrs('e.attrs')} END"
)
_ATTRS_WITHOUT_IT = f"""CASE WHEN ({_CORRELATION_ID_IN_ATTRS}) IS NULL THEN e.attrs
    ELSE json_merge_patch(e.attrs, '{{"correlation_id": null}}') END"""


def attrs_columns(ids: StackIds, parts: list[tuple[int, Path, int]]) -> tuple[str, str, str]:
    """The SQL of `event_rows.attrs` and `event_rows.correlation_id` for the events of `parts`
    (read as `e`, a part known by its `e.file_index` when there are several), and what `read_parquet`
    needs added."""
    attrs, correlation_id, options = _correlation_columns(ids, parts)
    without_op_columns = sum(path in ids.runs[i].parts_without_op_columns for i, path, _rows in parts)
    if without_op_columns == len(parts):
        return attrs, correlation_id, options
    # An op's attributes are its op_* columns (raw schema 5 on): made the JSON text the database keeps.
    # Parts without them among others: read by column name, their op columns NULL.
    union = ", union_by_name = true" if without_op_columns else ""
    return event_attrs_sql("e", attrs), correlation_id, options or union


def _correlation_columns(ids: StackIds, parts: list[tuple[int, Path, int]]) -> tuple[str, str, str]:
    """attrs_columns without the op columns: the correlation id out of the attributes of parts
    older than raw schema 3."""
    legacy = [k for k, (i, path, _rows) in enumerate(parts) if path in ids.runs[i].parts_without_correlation]
    if not legacy:
        return "e.attrs", "e.correlation_id", ""
    if len(legacy) == len(parts):
        return _ATTRS_WITHOUT_IT, _CORRELATION_ID_IN_ATTRS, ""
    # Old and new parts in one statement: read by column name, the old parts' column NULL.
    old = f"list_contains({legacy}, e.file_index)"
    return (
        f"CASE WHEN {old} THEN {_ATTRS_WITHOUT_IT} ELSE e.attrs END",
        f"CASE WHEN {old} THEN {_CORRELATION_ID_IN_ATTRS} ELSE e.correlation_id END",
        ", union_by_name = true",
    )


def file_list(files: list[tuple[int, Path, int]]) -> str:
    return "[" + ", ".join(sql_text(str(path)) for _i, path, _rows in files) + "]"


def _modules_of(runs: list[PreparedRun]) -> pa.Table:
    """The modules every run loaded, with its run id and place (run after run)."""
    modules = pa.concat_tables(
        [
            run.flat.modules.append_column("run_id", pa.array([run.run_id] * run.flat.modules.num_rows, pa.string()))
            for run in runs
        ]
    )
    return modules.append_column("position", pa.array(np.arange(modules.num_rows), pa.int64()))


def insert_run_modules(db: IngestDb, runs: list[PreparedRun]) -> None:
    """`run_modules` rows of the runs (what each loaded: no other run's rows are read)."""
    db.insert(
        "INSERT INTO run_modules BY NAME SELECT run_id, module_index, module_key, path, load_bias, exec_ranges FROM {}",
        _modules_of(runs),
    )


def insert_modules(db: IngestDb, runs: list[PreparedRun], statuses: pa.Table | None) -> None:
    """A `modules` row for every module of the runs the database lacks, and the statuses of the
    modules just symbolized."""
    if statuses is not None and statuses.num_rows:
        upsert_module_statuses(db, statuses)
    # Every module a run loaded has a row, even one none of whose addresses needed symbols yet.
    known = db.keep("module_keys", lambda: {key for (key,) in query_rows(db.con, "SELECT module_key FROM modules")})
    keys = {key for run in runs for key in run.flat.modules["module_key"].to_pylist()}
    if not keys <= known:
        # Only keys nobody gave a row yet: the transaction before this one may have, unseen here.
        modules = _modules_of(runs)
        modules = modules.filter(pc.is_in(modules["module_key"], pa.array(sorted(keys - known), pa.string())))
        db.insert(
            """
            INSERT INTO modules BY NAME
            SELECT module_key, arg_min(path, position) AS path,  -- as the first run loaded says
                   CASE WHEN NOT starts_with(module_key, 'path:') AND NOT starts_with(module_key, 'invalid:')
                        THEN module_key END AS build_id
            FROM {} ANTI JOIN modules USING (module_key)
            GROUP BY module_key
            """,
            modules,
        )
        known.update(keys)


def insert_stacks(db: IngestDb, batch: LaidOutBatch, part: RunPart) -> None:
    """`stacks` rows of the stacks a run brings in, and their frames."""
    flat, order, frames = batch.flat, part.new_order, batch.new.frames
    ids = batch.new_ids[order]
    counts = np.zeros(len(order), dtype=np.int64)
    symbolized_depth = np.full(len(order), -1, dtype=np.int32)
    # Stacks without frames (an empty stack) have no entry in the layout's per-stack arrays.
    position = np.minimum(np.searchsorted(frames.stack_order, ids), max(len(frames.stack_order) - 1, 0))
    laid_out = frames.stack_order[position] == ids if len(frames.stack_order) else np.zeros(len(ids), bool)
    counts[laid_out] = frames.per_stack_frames[position[laid_out]]
    symbolized_depth[laid_out] = frames.symbolized_depth[position[laid_out]]
    problems = batch.new.problems.take(pa.array(np.searchsorted(batch.new_ids[batch.new_order], ids)))
    stacks = pa.table(
        {
            "stack_id": pa.array(ids, pa.int64()),
            "stack_hash": pa.array(flat.hashes[order], pa.uint64()),
            "status": pa.array(flat.status[order], pa.uint32()),
            "native_frames": pa.array(flat.native_lengths[order], pa.int32()),
            "python_frames": pa.array(flat.python_lengths[order], pa.int32()),
            "frames": pa.array(counts, pa.int32()),
            "problem": problems,
            "symbolized_depth": pa.array(symbolized_depth, pa.int32(), mask=symbolized_depth < 0),
        }
    )
    run_ids = pa.array([run.run_id for run in batch.runs], pa.string())
    first_run_ids = run_ids.take(pa.array(batch.run_of_stack[order]))
    db.insert("INSERT INTO stacks BY NAME SELECT * FROM {}", stacks.append_column("first_run_id", first_run_ids))
    insert_frame_rows(db, frames, batch.new.frame_ids, part.rows, part.frames)


def next_run_numbers(db: IngestDb, count: int) -> int:
    """The first of `count` new run numbers (0: the next one, taking none)."""
    return db.next_ids(
        "run_number", count, lambda: int(query_value(db.con, "SELECT coalesce(max(run_number), 0) + 1 FROM runs"))
    )


def next_event_ids(db: IngestDb, count: int) -> int:
    """The first of `count` new event ids (0: the next one, taking none)."""
    return db.next_ids(
        "event_id", count, lambda: int(query_value(db.con, "SELECT coalesce(max(event_id), 0) + 1 FROM event_rows"))
    )


@dataclass
class EventsPlan:
    """What a transaction's events need decided in run order before they are loaded (which may
    happen on another connection, beside the previous transaction's other rows)."""

    first_event_id: int  # of its first part's first row
    names: pa.Table  # kind, name, name_id of every name its parts hold
    fresh: pa.Table | None  # `event_names` rows of those the database lacks (inserted with its other rows)


def plan_events(db: IngestDb, ids: StackIds, runs: range) -> EventsPlan:
    """The event ids of the runs' events and the ids of their names: names the database lacks get
    the next ids, run after run, each run's in (kind, name) order (as when the runs are loaded one
    by one)."""
    con = db.con
    known = event_name_ids(db)
    fresh: list[tuple[str, str]] = []
    wanted: dict[tuple[str, str], None] = {}
    for i in runs:
        for pair in ids.runs[i].event_names:
            if pair not in known and pair not in wanted:
                fresh.append(pair)
            wanted[pair] = None
    fresh_rows = None
    if fresh:  # (a failed transaction forgets `known` with the rest of what the ingest keeps)
        first = db.next_ids(
            "name_id",
            len(fresh),
            lambda: int(query_value(con, "SELECT coalesce(max(name_id), 0) + 1 FROM event_names")),
        )
        known.update({pair: first + k for k, pair in enumerate(fresh)})
        fresh_rows = _names_table(fresh, known)
    # Event ids follow the parts' order and their rows' order.
    first_event_id = next_event_ids(db, sum(rows for _i, _path, rows in ids.event_files_of(runs)))
    return EventsPlan(first_event_id, _names_table(list(wanted), known), fresh_rows)


def event_name_ids(db: IngestDb) -> dict[tuple[str, str], int]:
    """{(kind, name): name_id} of the names stored or given to a transaction under way (kept)."""
    return db.keep(
        "event_names",
        lambda: {(k, n): i for i, k, n in query_rows(db.con, "SELECT name_id, kind, name FROM event_names")},
    )


def _names_table(pairs: list[tuple[str, str]], ids: dict[tuple[str, str], int]) -> pa.Table:
    return pa.table(
        {
            "name_id": pa.array([ids[pair] for pair in pairs], pa.int32()),
            "kind": pa.array([k for k, _n in pairs], pa.string()),
            "name": pa.array([n for _k, n in pairs], pa.string()),
        }
    )


def insert_event_names(db: IngestDb, plan: EventsPlan) -> None:
    """The `event_names` rows the runs of the plan are the first to use."""
    if plan.fresh is not None:
        db.insert("INSERT INTO event_names BY NAME SELECT * FROM {}", plan.fresh)


def load_events(con: Any, ids: StackIds, runs: range, numbers: dict[int, int], plan: EventsPlan) -> bool:
    """The runs' `event_rows` straight from their Parquet parts (one statement), on `con` (a
    connection whose transaction they join); False when they have no events parts. Reads nothing
    another transaction under way writes: names and stack ids come from the plan and `ids`."""
    parts = ids.event_files_of(runs)
    if not parts:
        return False
    files = file_list(parts)
    first = plan.first_event_id
    # Read by DuckDB by these names (replacement scans: no view to register and drop per run;
    # names no view ever takes, which would come first).
    loading_stack_map = ids.stack_map(runs)  # noqa: F841
    loading_names = plan.names  # noqa: F841
    attrs, correlation_id, options = attrs_columns(ids, parts)
    if len(parts) == 1:
        # One part (most small runs): its run and first event id as constants.
        index = parts[0][0]
        event_id, run_number, run_index = f"{first} + e.file_row_number", numbers[index], index
    else:
        event_id, run_number, run_index = part_of_row_columns(ids, runs, numbers, first)
    con.execute(
        f"""
        INSERT INTO event_rows BY NAME
        SELECT {event_id} AS event_id, {run_number} AS run_number, e.ts, e.thread_id, n.name_id, m.stack_id,
               {attrs} AS attrs, {correlation_id} AS correlation_id
        FROM read_parquet({files}, file_row_number = true{options}) e
        JOIN loading_names n ON n.kind = e.kind AND n.name = e.name
        LEFT JOIN loading_stack_map m ON m.run_index = {run_index} AND m.raw_id = e.stack_id
        """
    )
    return True


def count_events(
    con: Any, ids: StackIds, runs: range, numbers: dict[int, int]
) -> tuple[pa.Table, dict[int, int], dict[int, int]]:
    """The runs' `event_counts` from their `event_rows` (`load_events`, in the same transaction on
    `con`), returned as rows, with each run's stacks used and dangling events (by run index);
    QuarantineRun for a complete run with events whose stack it does not hold."""
    where, params = run_numbers_filter("run_number", [numbers[i] for i in runs])
    # The counts come back (RETURNING: a query of the new rows costs as much again).
    counted = con.execute(
        f"""
        INSERT INTO event_counts BY NAME
        SELECT run_number, name_id, stack_id, count(*) AS events
        FROM event_rows
        WHERE {where}
        GROUP BY run_number, name_id, stack_id
        -- In the index's order: DuckDB adds the rows to `event_counts_by_stack` at the commit, and
        -- rows in key order cost it less than the same rows in hash order.
        ORDER BY stack_id
        RETURNING run_number, name_id, stack_id, events
        """,
        params,
    ).fetchnumpy()
    count_run = counted["run_number"]
    count_stack = np.ma.getdata(counted["stack_id"])
    count_stackless = np.ma.getmaskarray(counted["stack_id"])
    # Events whose stack the run does not hold (a killed process flushed the events but not the
    # stack) are those loaded without a stack beyond the ones that took none; a run that closed
    # cleanly with such events is damaged.
    stacks_used, dangling = {}, {}
    for i in runs:
        run = ids.runs[i]
        mine = count_run == numbers[i]
        stacks_used[i] = len(np.unique(count_stack[mine & ~count_stackless]))
        dangling[i] = int(counted["events"][mine & count_stackless].sum()) - run.events_without_stack
        if dangling[i] and run.complete:
            raise QuarantineRun(dangling_events_note(dangling[i]))
    table = pa.table(
        {
            "run_number": count_run,
            "name_id": counted["name_id"],
            "stack_id": pa.array(count_stack, pa.int64(), mask=count_stackless),
            "events": counted["events"],
        }
    )
    return table, stacks_used, dangling


def manifest_columns(m: dict[str, Any]) -> dict[str, Any]:
    """The `runs` columns taken from a manifest as they are (the database's and the lake's runs alike)."""
    counters = m.get("counters") or {}
    return {
        "run_id": m["run_id"],
        "parent_run_id": m.get("parent_run_id"),
        "complete": bool(m.get("complete")),
        "host": m.get("host"),
        "pid": m.get("pid"),
        "argv": list(m.get("argv") or []),
        "cwd": m.get("cwd"),
        "python_version": m.get("python_version"),
        "python_implementation": m.get("python_implementation"),
        "torch_version": m.get("torch_version"),
        "cuda_version": m.get("cuda_version"),
        "sys_path": m.get("sys_path"),
        "tbpipe_version": m.get("tbpipe_version"),
        "sources": list(m.get("sources") or []),
        "capture": json.dumps(m.get("capture") or {}),
        "events_recorded": counters.get("events_recorded"),
        "events_dropped": counters.get("events_dropped"),
        "capture_errors": list(m.get("errors") or []),
        "manifest": json.dumps(m),
    }


def _micros(text: str | None) -> int | None:
    """Microseconds since the epoch of a manifest's ISO-8601 time (checked to carry a zone)."""
    if not text:
        return None
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    delta = moment - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def run_row(
    manifest: dict[str, Any],
    *,
    run_number: int,
    events: int,
    stacks: int,
    new_stacks: int,
    notes: list[str],
    run_dir: Path,
    fingerprint: str,
    ingested_at: int | None = None,
) -> dict[str, Any]:
    """A `runs` row (shaped as the lake's `runs` table, whose columns the database's match by
    name) from a run's manifest and what the ingest counted; `ingested_at` in microseconds."""
    return {
        **manifest_columns(manifest),
        "run_number": run_number,
        "started_at": _micros(manifest.get("started_at")),
        "ended_at": _micros(manifest.get("ended_at")),
        "labels": list((manifest.get("labels") or {}).items()),
        "threads": [(int(k), v) for k, v in (manifest.get("threads") or {}).items()],
        "events": events,
        "stacks": stacks,
        "new_stacks": new_stacks,
        "ingest_notes": list(notes or []),
        "source_dir": str(run_dir.resolve()),
        "parts": fingerprint,
        "ingested_at": ingested_at,
    }


def insert_runs(db: IngestDb, runs: list[LoadedRun]) -> None:
    """The `runs` rows, from the manifests and what the ingest counted (one statement for all)."""
    try:
        values = pa.Table.from_pylist(
            [
                run_row(
                    loaded.run.manifest,
                    run_number=loaded.number,
                    events=loaded.run.events,
                    stacks=loaded.stacks_used,
                    new_stacks=loaded.new_stacks,
                    notes=loaded.run.notes_with(loaded.dangling_events),
                    run_dir=loaded.run.run_dir,
                    fingerprint=loaded.run.fingerprint,
                )
                for loaded in runs
            ],
            schema=TABLES["runs"].schema,
        )
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as error:
        # A manifest value out of the column's range (a thread id past 2^63, text that is not UTF-8).
        raise QuarantineRun(f"manifest values cannot be stored ({first_line(error)})") from None
    db.insert(
        """
        INSERT INTO runs BY NAME
        SELECT * EXCLUDE (capture, manifest, ingested_at),
               CAST(capture AS JSON) AS capture, CAST(manifest AS JSON) AS manifest, now() AS ingested_at
        FROM {}
        """,
        values,
    )
