"""The ingest's steps as plain functions over Arrow tables, for the lake's executors.

Each step works on one run, or on one shard of symbol requests, and calls tbpipe's own library:
`rawrun` (validate, read), `stacks.flatten` (flatten and hash), `stacks.layout` (combined order,
inline expansion), `symbols` (the symbolizer and its store), and the packaged SQL (siting, in an
in-memory DuckDB). The Spark job (`lake.spark_ingest`) runs them in `mapInArrow` and
`applyInArrow` UDFs; nothing here knows about Spark, so the same functions are tested alone.

1. `prepare_run`   validate a run, flatten and hash its stacks: its run row, its distinct stacks
                   (raw id -> stack id), its modules and its event names (from the events parts'
                   dictionaries and footers: no event is read here). Damaged runs come back
                   quarantined; a folder the executor cannot read comes back 'unreachable'.
2. `write_run_events`  a prepared run's events as the lake's `event_rows` and `event_counts`
                   files, by DuckDB in the task (each part read once, names and stacks re-keyed
                   through the run's own maps): the only step that reads events.
3. `lay_out_run`   for the stacks a run was chosen to bring in: their slots (combined order,
                   before inline expansion), stack rows and the Python files they name.
4. `symbolize`     one shard of (module, address) requests through the symbolizer.
5. `build_frames`  slots + symbols -> frames (each once, by content id), the stacks' frame rows,
                   and their call sites by the packaged siting SQL.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tbpipe.capture import __version__
from tbpipe.pipeline.db import schema
from tbpipe.pipeline.db.ingest.gpu import GPU_TABLES
from tbpipe.pipeline.db.ingest.siting import import_roots, portable_file, reference_sites
from tbpipe.pipeline.db.schema import sql_text
from tbpipe.pipeline.lake import ids
from tbpipe.pipeline.rawrun import (
    DamagedRunError,
    events_part,
    manifest_or_recovered,
    part_files,
    parts_fingerprint,
    read_tables,
    reference_problems,
    verify_part,
)
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.stacks.flatten import flatten_run
from tbpipe.pipeline.symbols import ModuleRef, Symbolizer
from tbpipe.pipeline.symbols.debuginfod import DebuginfodSettings
from tbpipe.schemas.lake import PARTITION, TABLES
from tbpipe.schemas.modulekey import ModuleKey
from tbpipe.schemas.op_attributes import event_attrs_sql

# ------------------------------------------------------------------------------------------ schemas of the steps

STACK_PARTS = ("stacks", "modules", "code", "code_origins")  # the raw parts that make a run's stacks

PREPARED_RUN = pa.schema(
    [
        ("path", pa.string()),
        ("status", pa.string()),  # 'ingested', 'updated', 'present', 'quarantined' or 'unreachable'
        ("reason", pa.string()),
        ("run_id", pa.string()),
        ("run_number", pa.int64()),
        ("complete", pa.bool_()),
        ("manifest", pa.string()),  # JSON
        ("fingerprint", pa.string()),
        ("notes", pa.list_(pa.string())),
        ("event_files", pa.list_(pa.string())),
        ("event_rows", pa.list_(pa.int64())),  # rows per events part
        ("events", pa.int64()),
        ("without_stack", pa.int64()),  # events that took no stack, by the parts' footers
        ("stacks", pa.int64()),  # distinct raw stacks
    ]
)
RUN_NAME = pa.schema(
    [("run_number", pa.int64()), ("name_id", pa.int64()), ("kind", pa.string()), ("name", pa.string())]
)
RAW_STACK = pa.schema(
    [
        ("run_number", pa.int64()),
        ("raw_id", pa.int64()),  # the raw (per-process) stack id's bits
        ("stack_id", pa.int64()),
    ]
)
SLOT = pa.schema(
    [
        ("stack_id", pa.int64()),
        ("slot", pa.int32()),
        ("kind", pa.string()),
        ("function", pa.string()),
        ("file", pa.string()),
        ("line", pa.int32()),
        ("first_line", pa.int32()),
        ("module", pa.string()),
        ("module_key", pa.string()),
        ("address", pa.int64()),
        ("exact", pa.bool_()),
        ("reason", pa.string()),
        ("inlined", pa.bool_()),  # Python: a user line placed inside a generated frame (code_origins)
    ]
)
NEW_STACK = pa.schema(
    [
        ("stack_id", pa.int64()),
        ("status", pa.int32()),
        ("native_frames", pa.int32()),
        ("python_frames", pa.int32()),
        ("problem", pa.string()),
        ("first_run_id", pa.string()),
    ]
)
SYMBOL_REQUEST = pa.schema(
    [("module_key", pa.string()), ("path", pa.string()), ("address", pa.int64()), ("exact", pa.bool_())]
)


def schema_of(table: str) -> pa.Schema:
    return TABLES[table].schema


# ------------------------------------------------------------------------------------------ 1. prepare


@dataclass
class PreparedRun:
    run: dict[str, Any]  # a PREPARED_RUN row
    stacks: pa.Table = field(default_factory=lambda: RAW_STACK.empty_table())  # RAW_STACK
    modules: pa.Table = field(default_factory=lambda: schema_of("run_modules").empty_table())
    names: pa.Table = field(default_factory=lambda: RUN_NAME.empty_table())  # the (kind, name) its events use


def _run_row(path: Path, status: str, **values: Any) -> dict[str, Any]:
    row = {name: None for name in PREPARED_RUN.names}
    row.update(path=str(path), status=status, notes=[], event_files=[], event_rows=[], events=0, without_stack=0)
    row.update(values)
    return row


def prepare_run(
    run_dir: str | Path, known: dict[str, tuple[bool, str]], *, recover_manifests: bool = False
) -> PreparedRun:
    """Validates, reads, flattens and hashes one run, as the DuckDB ingest does; `known` is the
    lake's runs as run_id -> (complete, parts fingerprint), for runs already there. Events whose
    stack the run does not hold are counted by the job from the loaded events (`dangling_events`)."""

    run_dir = Path(run_dir)
    if not os.access(run_dir, os.R_OK | os.X_OK) or not run_dir.is_dir():
        # The driver listed it: this executor does not share the driver's disk (or its permissions).
        return PreparedRun(_run_row(run_dir, "unreachable", reason=f"{run_dir} (on {socket.gethostname()})"))
    notes: list[str] = []
    try:
        manifest, recovery_notes = manifest_or_recovered(run_dir, recover_manifests)
        notes += recovery_notes
        files = part_files(run_dir, manifest)
        fingerprint = parts_fingerprint(run_dir, manifest, files)
    except DamagedRunError as error:
        return PreparedRun(_run_row(run_dir, "quarantined", reason=str(error)))
    run_id = manifest["run_id"]
    number = ids.run_number(run_id)
    existing = known.get(run_id)
    if existing is not None and (existing[0] or existing[1] == fingerprint):
        return PreparedRun(_run_row(run_dir, "present", run_id=run_id, run_number=number, complete=bool(existing[0])))
    try:
        event_files = [(path, events_part(path)) for path in files["events"]]
        not_json = attributes_not_json([path for path, _part in event_files])
        if not_json:
            # As DuckDB's JSON column refuses them: the run is quarantined before any event is written.
            raise DamagedRunError(f"{run_dir}: events have attributes that are not JSON ({not_json} events)")
        gpu_parts = sum(verify_part(path, table) >= 0 for table in GPU_TABLES for path in files[table])
        tables = read_tables(files, STACK_PARTS)
        notes = notes + reference_problems(tables)
        if notes and manifest.get("complete") and not manifest.get("recovered"):
            raise DamagedRunError(f"{run_dir}: {'; '.join(notes)}")
        flat = flatten_run(tables)
        if gpu_parts:
            notes.append(
                f"GPU activity ({gpu_parts} parts) is not loaded by the Spark ingest: for GPU time, ingest the run "
                "with the DuckDB engine and `tbpipe lake export` the database"
            )
    except DamagedRunError as error:
        return PreparedRun(_run_row(run_dir, "quarantined", reason=str(error), run_id=run_id, run_number=number))
    run = _run_row(
        run_dir,
        "updated" if existing is not None else "ingested",
        run_id=run_id,
        run_number=number,
        complete=bool(manifest.get("complete")),
        manifest=json.dumps(manifest),
        fingerprint=fingerprint,
        notes=notes,
        event_files=[str(path) for path, _part in event_files],
        event_rows=[part.rows for _path, part in event_files],
        events=sum(part.rows for _path, part in event_files),
        without_stack=sum(part.without_stack for _path, part in event_files),
        stacks=len(flat.raw_ids),
    )
    stacks = pa.table(
        {
            "run_number": pa.array(np.full(len(flat.raw_ids), number, dtype=np.int64)),
            "raw_id": pa.array(ids.signed(flat.raw_ids), pa.int64()),
            "stack_id": pa.array(ids.signed(flat.hashes), pa.int64()),
        },
        schema=RAW_STACK,
    )
    modules = flat.modules
    modules = pa.table(
        {
            "run_id": pa.array([run_id] * modules.num_rows, pa.string()),
            "module_index": modules["module_index"],
            "module_key": modules["module_key"],
            "path": modules["path"],
            "load_bias": pa.array(ids.signed(_numpy(modules["load_bias"], np.uint64)), pa.int64()),
            "exec_ranges": modules["exec_ranges"].cast(schema_of("run_modules").field("exec_ranges").type),
        },
        schema=schema_of("run_modules"),
    )
    pairs = sorted(set().union(*(part.names for _path, part in event_files)))
    names = pa.table(
        {
            "run_number": pa.array([number] * len(pairs), pa.int64()),
            "name_id": pa.array(ids.name_ids([p[0] for p in pairs], [p[1] for p in pairs]), pa.int64()),
            "kind": pa.array([p[0] for p in pairs], pa.string()),
            "name": pa.array([p[1] for p in pairs], pa.string()),
        },
        schema=RUN_NAME,
    )
    return PreparedRun(run, stacks, modules, names)


def attributes_not_json(paths: list[Path]) -> int:
    """Events of these parts whose attributes are not JSON text (DuckDB's `json_valid`, the parser
    its JSON type uses). Each part's attributes are read as a dictionary, so a text is checked once
    however many events repeat it, and the events are counted by their index into it."""
    con = duckdb.connect()
    bad = 0
    try:
        for path in paths:
            if "attrs" not in pq.read_schema(path).names:
                continue
            parquet = pq.ParquetFile(path, read_dictionary=["attrs"])
            for chunk in parquet.read(columns=["attrs"]).column(0).chunks:
                texts = pa.table({"i": pa.array(np.arange(len(chunk.dictionary))), "t": chunk.dictionary})
                invalid = con.from_arrow(texts).filter("NOT json_valid(t)").select("i").to_arrow_table()["i"]
                if len(invalid):
                    bad += pc.sum(pc.is_in(chunk.indices, value_set=invalid.combine_chunks())).as_py() or 0
    finally:
        con.close()
    return bad


# ------------------------------------------------------------------------------------------ 2. events


WRITTEN_EVENTS = pa.schema(
    [
        ("run_number", pa.int64()),
        ("events", pa.int64()),  # rows written
        ("stacks_used", pa.int64()),  # distinct stacks of those rows
        ("null_stack", pa.int64()),  # rows without a stack (none taken, or one the run does not hold)
    ]
)


def write_run_events(
    run: dict[str, Any], stacks: pa.Table, names: pa.Table, events_dir: Path, counts_dir: Path
) -> dict[str, int]:
    """One prepared run's events as the lake's `event_rows` file and its `event_counts` file (each
    one Parquet file in `<dir>/run_number=<n>/`), by DuckDB in this process: each events part read
    once, its event ids numbered on from the parts before it, names and raw stack ids re-keyed by
    hash joins with the run's own maps (`stacks`: RAW_STACK rows, `names`: RUN_NAME rows), the
    attributes made as the export makes them (`event_attrs`, op_* columns first); the counts per
    name and stack from the raw ids, before re-keying. Returns a WRITTEN_EVENTS row."""
    number = int(run["run_number"])
    con = _events_connection()
    # Read by DuckDB by these names (replacement scans).
    lake_stack_map = pa.table(  # noqa: F841
        {
            "raw_id": pa.array(ids.unsigned(_numpy(stacks["raw_id"], np.int64)), pa.uint64()),
            "stack_id": stacks["stack_id"],
        }
    )
    lake_names = names.select(["kind", "name", "name_id"])  # noqa: F841
    first = np.cumsum([0, *run["event_rows"]])[:-1]
    reads, columns = [], ("kind", "name", "stack_id")
    for path, start in zip(run["event_files"], first):
        held = set(pq.read_schema(path).names)
        attrs = "e.attrs" if "attrs" in held else "NULL"
        attrs = event_attrs_sql("e", attrs) if "op_id" in held else attrs
        correlation = "e.correlation_id" if "correlation_id" in held else "NULL"  # raw schema 3 on
        reads.append(
            f"SELECT {int(start)} + e.file_row_number + 1 AS event_id, CAST(e.ts AS TIMESTAMPTZ) AS ts, e.thread_id, "
            f"{', '.join('e.' + c for c in columns)}, event_attrs({attrs}, {correlation}) AS attrs "
            f"FROM read_parquet({sql_text(str(path))}, file_row_number = true) e"
        )
    events_file = _run_file(events_dir, number)
    counts_file = _run_file(counts_dir, number)
    written = [(0, 0, 0)]
    if reads:
        con.execute(
            f"""
            COPY (
                SELECT e.event_id, e.ts, e.thread_id, n.name_id, m.stack_id, e.attrs
                FROM ({" UNION ALL ".join(reads)}) e
                JOIN lake_names n ON n.kind = e.kind AND n.name = e.name
                LEFT JOIN lake_stack_map m ON m.raw_id = e.stack_id
            ) TO {sql_text(str(events_file))} (FORMAT parquet, COMPRESSION zstd)
            """
        )
        con.execute(
            f"""
            COPY (
                SELECT n.name_id, m.stack_id, sum(c.events)::BIGINT AS events
                FROM (SELECT kind, name, stack_id, count(*) AS events
                      FROM read_parquet({"[" + ", ".join(sql_text(str(p)) for p in run["event_files"]) + "]"})
                      GROUP BY ALL) c
                JOIN lake_names n ON n.kind = c.kind AND n.name = c.name
                LEFT JOIN lake_stack_map m ON m.raw_id = c.stack_id
                GROUP BY ALL
            ) TO {sql_text(str(counts_file))} (FORMAT parquet, COMPRESSION zstd)
            """
        )
        written = con.execute(
            f"""
            SELECT sum(events)::BIGINT, count(DISTINCT stack_id), coalesce(sum(events) FILTER (stack_id IS NULL), 0)::BIGINT
            FROM read_parquet({sql_text(str(counts_file))})
            """
        ).fetchall()
    events, distinct, null_stack = written[0]
    for path in (events_file, counts_file):
        if path.exists():
            os.rename(path, path.with_name(path.name.lstrip(".")))
    return {"run_number": number, "events": events or 0, "stacks_used": distinct, "null_stack": null_stack}


# An in-memory DuckDB per worker thread for the events: one thread (Spark runs a task per core) and
# the packaged `event_attrs` macro only (the siting connection's whole schema costs a third of a
# second to make, which a worker that writes events only would pay for nothing).
_events = threading.local()


def _events_connection() -> Any:
    con = getattr(_events, "con", None)
    if con is None:
        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")
        con.execute("SET threads = 1")
        (macro,) = [
            statement.sql
            for module in schema.modules()
            for statement in module.statements
            if statement.created is not None and statement.created.name == "event_attrs"
        ]
        con.execute(macro)
        _events.con = con
    return con


def _run_file(directory: Path, number: int) -> Path:
    """Where a run's one file of a partitioned table is written under `directory` (a job's staging
    folder's table): named by the run and the job, so a retried task writes its own file again and
    a partition swapped in holds only the job's files; hidden until complete."""
    directory = Path(directory)
    folder = directory / f"{PARTITION}={number}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f".part-{number}-{directory.parent.name}.parquet"


def dangling_events(run: dict[str, Any], null_stack_events: int) -> int:
    """Events of a prepared run whose stack the run does not hold (a killed process flushed the
    events, not the stack): the loaded events without a stack, less those that took none."""
    return max(0, null_stack_events - (run["without_stack"] or 0))


def _numpy(column: pa.ChunkedArray | pa.Array, dtype) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.to_numpy(zero_copy_only=False).astype(dtype) if len(column) else np.zeros(0, dtype)


# ------------------------------------------------------------------------------------------ 3. lay out


@dataclass
class LaidOutRun:
    slots: pa.Table  # SLOT rows of the owned stacks, stack after stack, slot after slot
    stacks: pa.Table  # NEW_STACK rows
    source_files: pa.Table  # the lake's `source_files` rows for the Python files of those slots


def lay_out_run(run_dir: str | Path, stack_ids: np.ndarray, *, recover_manifests: bool = False) -> LaidOutRun:
    """Slots of the given stacks (by lake stack id) of one run, which holds them all."""

    run_dir = Path(run_dir)
    manifest, _notes = manifest_or_recovered(run_dir, recover_manifests)
    flat = flatten_run(read_tables(part_files(run_dir, manifest), STACK_PARTS))
    hashes = ids.signed(flat.hashes)
    wanted = np.flatnonzero(np.isin(hashes, np.asarray(stack_ids, dtype=np.int64)))
    # One raw stack for each stack id (two raw stacks of a run may hash alike), in the run's order.
    _, first = np.unique(hashes[wanted], return_index=True)
    chosen = np.sort(wanted[first])
    slots, shapes = layout.combined_slots(
        stack_ids=hashes[chosen],
        **flat.frames(chosen).slot_arguments(),
        modules=flat.modules,
        code=flat.code,
    )
    slot_rows = slot_table(slots)
    stacks = pa.table(
        {
            "stack_id": pa.array(hashes[chosen], pa.int64()),
            "status": pa.array(flat.status[chosen].astype(np.int32), pa.int32()),
            "native_frames": pa.array(flat.native_lengths[chosen].astype(np.int32), pa.int32()),
            "python_frames": pa.array(flat.python_lengths[chosen].astype(np.int32), pa.int32()),
            "problem": shapes.problem,
            "first_run_id": pa.array([manifest["run_id"]] * len(chosen), pa.string()),
        },
        schema=NEW_STACK,
    )
    python_files = pc.unique(slots.file.filter(pa.array(slots.kind == layout.PYTHON)).cast(pa.string()).drop_null())
    python_files = python_files.to_pylist()
    roots = import_roots(manifest)
    named = [(file, *portable_file(file, roots)) for file in sorted(python_files)]
    source_files = pa.table(
        {
            "file": pa.array([n[0] for n in named], pa.string()),
            "portable_file": pa.array([n[1] for n in named], pa.string()),
            "root": pa.array([n[2] for n in named], pa.string()),
        },
        schema=schema_of("source_files"),
    )
    return LaidOutRun(slot_rows, stacks, source_files)


def slot_table(slots: layout.Slots) -> pa.Table:
    """Slots as rows (the shape `layout.slots_from_table` reads back)."""
    return pa.table(
        {
            "stack_id": pa.array(slots.stack_id, pa.int64()),
            "slot": pa.array(slots.slot, pa.int32()),
            "kind": layout.kind_names().take(pa.array(slots.kind.astype(np.int64))),
            "function": slots.function.cast(pa.string()),
            "file": slots.file.cast(pa.string()),
            "line": pa.array(slots.line, pa.int32(), mask=slots.line < 0),
            "first_line": pa.array(slots.first_line, pa.int32(), mask=slots.first_line < 0),
            "module": slots.module.cast(pa.string()),
            "module_key": slots.module_key.cast(pa.string()),
            "address": pa.array(ids.signed(slots.address.astype(np.uint64)), pa.int64()),
            "exact": pa.array(slots.exact, pa.bool_()),
            "reason": slots.reason.cast(pa.string()),
            "inlined": pa.array(slots.inlined if slots.inlined is not None else np.zeros(len(slots), bool)),
        },
        schema=SLOT,
    )


def symbol_requests(slots: pa.Table) -> pa.Table:
    """The distinct (module key, address, exact) of the native slots, with a path for each module."""
    native = slots.filter(pc.and_(pc.equal(slots["kind"], "native"), pc.is_valid(slots["module_key"])))
    keys = native.group_by(["module_key", "address", "exact"]).aggregate([("module", "min")])
    return pa.table(
        {
            "module_key": keys["module_key"],
            "path": keys["module_min"],
            "address": keys["address"],
            "exact": keys["exact"],
        },
        schema=SYMBOL_REQUEST,
    )


# ------------------------------------------------------------------------------------------ 4. symbolize


def new_symbolizer(cache_dir: str | None, debug_dirs: list[str], debuginfod: Any = None) -> Any:
    """A Symbolizer for one executor task: its own store (or the shared one), no worker pool (the
    engine runs tasks side by side); `debuginfod`: `shipped_debuginfod`'s settings."""

    return Symbolizer(cache_dir=cache_dir, debug_dirs=list(debug_dirs), jobs=1, progress=False, debuginfod=debuginfod)


def shipped_debuginfod(settings: Any = None) -> Any:
    """The debuginfod settings executors get: the servers and timeout read on the driver (executors
    on other machines have other environments), each executor's own debuginfod cache."""

    return (settings or DebuginfodSettings()).resolved()


def symbolize(requests: pa.Table, symbolizer: Any) -> tuple[pa.Table, pa.Table]:
    """The lake's `symbols` rows for SYMBOL_REQUEST rows (any modules), and `modules` rows for those modules.

    Each module is asked for in one call, by its key (a build-ID, a path, or a garbled note), as
    the DuckDB ingest asks: the same addresses give the same rows.
    """

    if requests.num_rows == 0:
        return schema_of("symbols").empty_table(), schema_of("modules").empty_table()
    requests = requests.sort_by([("module_key", "ascending"), ("address", "ascending"), ("exact", "ascending")])
    keys = requests["module_key"].combine_chunks()
    bounds = np.flatnonzero(np.r_[True, pc.not_equal(keys[1:], keys[:-1]).to_numpy(zero_copy_only=False), True])
    symbols, statuses = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        text = keys[int(start)].as_py()
        part = requests.slice(int(start), int(end - start))
        key = ModuleKey.parse(text)
        path = pc.min(part["path"]).as_py()
        ref = ModuleRef(key.symbolizer_build_id, path)
        addresses = ids.unsigned(_numpy(part["address"], np.int64))
        exact = _numpy(part["exact"], bool)
        rows = symbolizer.symbolize_arrow({ref: (addresses, exact)}, dictionary=False)
        symbols.append(_symbol_rows(rows, text))
        status = symbolizer.module_status(key.symbolizer_build_id, path)
        statuses.append(
            {
                "module_key": text,
                "path": path,
                "quality": status.quality.value,
                "reason": status.reason,
                "debug_file": status.debug_file,
                "found_via": status.found_via,
                "checked_at": int((status.checked_at or 0) * 1e6),
                "build_id": key.build_id,
            }
        )
    modules = pa.Table.from_pylist(statuses, schema=schema_of("modules"))
    return pa.concat_tables(symbols), modules


def _symbol_rows(rows: pa.Table, module_key: str) -> pa.Table:
    """The symbolizer's Arrow rows as the lake's `symbols` rows of one module."""
    schema = schema_of("symbols")
    columns = {
        "module_key": pa.array([module_key] * rows.num_rows, pa.string()),
        "address": pa.array(ids.signed(_numpy(rows["address"], np.uint64)), pa.int64()),
    }
    for name in ("exact", "depth", "function", "file", "line", "inlined", "reason"):
        columns[name] = rows[name].cast(schema.field(name).type)
    return pa.table(columns, schema=schema)


# ------------------------------------------------------------------------------------------ 5. frames and sites


@dataclass
class BuiltStacks:
    stacks: pa.Table  # the lake's `stacks` rows
    frames: pa.Table  # `frames` rows, each frame once
    stack_frame_rows: pa.Table
    sites: pa.Table
    stack_sites: pa.Table


def build_frames(
    slots: pa.Table,
    stacks: pa.Table,
    source_files: pa.Table,
    symbols: pa.Table,
    rules: list[tuple[str, bool, str]],
    generated: list[tuple[str, str, str | None]] = (),
) -> BuiltStacks:
    """Inline expansion, frame ids and call sites of new stacks.

    `slots`: SLOT rows; `stacks`: NEW_STACK rows of the same stacks; `source_files`: lake rows for
    (at least) their Python files; `symbols`: lake `symbols` rows for (at least) their native
    addresses; `rules`: the `user_code` rows as (prefix, is_user, origin); `generated`: the
    `generated_code` rows as (prefix, generator, first run id).
    """
    slots = slots.sort_by([("stack_id", "ascending"), ("slot", "ascending")])
    expanded = layout.expand(layout.slots_from_table(slots), _layout_symbols(symbols))
    frame_table = expanded.frames
    frame_ids = ids.frame_ids(frame_table)
    frames = pa.table({"frame_id": frame_ids, **{name: frame_table[name] for name in frame_table.column_names}})
    frames = _conform(frames, "frames")
    rows = expanded.rows
    local = rows["frame"].combine_chunks().to_numpy(zero_copy_only=False)
    frame_rows = pa.table(
        {
            "stack_id": rows["stack_id"],
            "depth": rows["depth"],
            "slot": rows["slot"],
            "chain_depth": rows["chain_depth"],
            "frame_id": pa.array(frame_ids.to_numpy()[local], pa.int64()),
        },
        schema=schema_of("stack_frame_rows"),
    )
    order = np.argsort(expanded.stack_order)
    stack_ids = _numpy(stacks["stack_id"], np.int64)
    at = order[np.searchsorted(expanded.stack_order, stack_ids, sorter=order)]
    counts = expanded.per_stack_frames[at].astype(np.int32)
    depth = expanded.symbolized_depth[at]
    stack_rows = pa.table(
        {
            "stack_id": stacks["stack_id"],
            "status": stacks["status"],
            "native_frames": stacks["native_frames"],
            "python_frames": stacks["python_frames"],
            "frames": pa.array(counts, pa.int32()),
            "problem": stacks["problem"],
            "symbolized_depth": pa.array(depth, pa.int32(), mask=depth < 0),
            "first_run_id": stacks["first_run_id"],
        },
        schema=schema_of("stacks"),
    )
    sites, stack_sites = _site(frame_table, rows, stack_rows, source_files, rules, generated)
    return BuiltStacks(stack_rows, frames, frame_rows, sites, stack_sites)


def _layout_symbols(symbols: pa.Table) -> pa.Table:
    """Lake `symbols` rows in the shape `layout.expand` reads (unsigned addresses)."""
    address = pa.array(ids.unsigned(_numpy(symbols["address"], np.int64)), pa.uint64())
    return symbols.set_column(symbols.column_names.index("address"), "address", address)


def _conform(table: pa.Table, name: str) -> pa.Table:
    """`table` with the lake table's columns, in its order and types (same bits for addresses)."""
    schema = schema_of(name)
    columns = []
    for field_ in schema:
        column = table[field_.name]
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if pa.types.is_uint64(column.type) and pa.types.is_int64(field_.type):
            values = ids.signed(_numpy(pc.fill_null(column, 0), np.uint64))
            column = pa.array(values, pa.int64(), mask=pc.is_null(column).to_numpy(zero_copy_only=False))
        columns.append(column.cast(field_.type))
    return pa.Table.from_arrays(columns, schema=schema)


# The packaged schema in an in-memory DuckDB, once per worker process (its views and macros are
# what sites the stacks); each call empties the tables it fills.
_siting = threading.local()


def _siting_connection() -> Any:
    con = getattr(_siting, "con", None)
    if con is None:
        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")
        con.execute(f"SET threads = {max(1, int(os.environ.get('TBPIPE_SITING_THREADS', '1')))}")
        schema.apply_migrations(con, __version__)
        schema.install_modules(con)
        _siting.con = con
    return con


def _site(
    frame_table: pa.Table,
    rows: pa.Table,
    stacks: pa.Table,
    source_files: pa.Table,
    rules: list[tuple[str, bool, str]],
    generated: list[tuple[str, str, str | None]],
) -> tuple[pa.Table, pa.Table]:
    """(sites, stack_sites) of the stacks, computed by `stack_sites_from` (sql/call_sites.sql)."""
    con = _siting_connection()
    for table in ("frames", "stack_frame_rows", "stacks", "source_files", "user_code", "generated_code"):
        con.execute(f"DELETE FROM {table}")
    local_frames = frame_table.append_column("frame_id", pa.array(np.arange(frame_table.num_rows), pa.int32()))
    user_code = pa.table(
        {
            "prefix": pa.array([r[0] for r in rules], pa.string()),
            "is_user": pa.array([r[1] for r in rules], pa.bool_()),
            "origin": pa.array([r[2] for r in rules], pa.string()),
        }
    )
    generated_code = pa.table(
        {
            "prefix": pa.array([g[0] for g in generated], pa.string()),
            "generator": pa.array([g[1] for g in generated], pa.string()),
            "first_run_id": pa.array([g[2] for g in generated], pa.string()),
        }
    )
    stack_ids = _numpy(stacks["stack_id"], np.int64)
    stacks_in = pa.table(
        {
            "stack_id": stacks["stack_id"],
            "stack_hash": pa.array(ids.unsigned(stack_ids), pa.uint64()),
            "status": stacks["status"],
            "native_frames": stacks["native_frames"],
            "python_frames": stacks["python_frames"],
            "frames": stacks["frames"],
            "problem": stacks["problem"],
            "symbolized_depth": stacks["symbolized_depth"],
            "first_run_id": stacks["first_run_id"],
        }
    )
    inputs = {
        "lake_frames": local_frames,
        "lake_rows": rows.rename_columns(["stack_id", "depth", "slot", "chain_depth", "frame_id"]),
        "lake_stacks": stacks_in,
        "lake_source_files": source_files,
        "lake_user_code": user_code,
        "lake_generated_code": generated_code,
    }
    for name, table in inputs.items():
        con.register(name, table)
    try:
        con.execute("INSERT INTO frames BY NAME SELECT *, 0::UBIGINT AS frame_hash FROM lake_frames")
        con.execute("INSERT INTO stack_frame_rows BY NAME SELECT * FROM lake_rows")
        con.execute("INSERT INTO stacks BY NAME SELECT * FROM lake_stacks")
        con.execute("INSERT INTO source_files BY NAME SELECT * FROM lake_source_files")
        con.execute("INSERT INTO user_code BY NAME SELECT *, now() AS added_at FROM lake_user_code")
        con.execute("INSERT INTO generated_code BY NAME SELECT * FROM lake_generated_code")
        sited = reference_sites(con, -9223372036854775808)
    finally:
        for name in inputs:
            con.unregister(name)
    site_id = ids.site_ids(sited["site_key"])
    stack_sites = pa.table(
        {
            "stack_id": sited["stack_id"],
            "site_id": site_id,
            "site_depth": sited["site_depth"],
            "site_kind": sited["site_kind"],
            "site_is_user": sited["site_is_user"],
            "site_file": sited["site_file"],
            "site_line": sited["site_line"],
        }
    )
    stack_sites = _conform(stack_sites, "stack_sites")
    keyed = sited.append_column("site_id", site_id).filter(pc.is_valid(sited["site_key"]))
    con.register("lake_sited", keyed)
    try:
        # One row per site, its columns from its first stack (by id): any stack gives the same key.
        sites = con.sql(
            """
            SELECT site_id, site_key, arg_min(site_function, stack_id) AS function,
                   arg_min(site_file, stack_id) AS file, arg_min(site_line, stack_id) AS line,
                   arg_min(site_kind, stack_id) AS kind, arg_min(site_portable_file, stack_id) AS portable_file,
                   arg_min(site_line_offset, stack_id) AS line_offset,
                   arg_min(regexp_extract(site_module, '[^/]*$'), stack_id) AS module
            FROM lake_sited GROUP BY site_id, site_key
            """
        ).to_arrow_table()
    finally:
        con.unregister("lake_sited")
    return _conform(sites, "sites"), stack_sites
