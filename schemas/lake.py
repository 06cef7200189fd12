"""Arrow schemas of the lake: the database's tables as Parquet files under one folder.

The lake holds what the DuckDB file holds (sql/migrations), in types that both engines read and
write: no unsigned integers (Spark has none; addresses and hashes are stored as signed 64-bit
integers with the same bits), timestamps in microseconds UTC, JSON as text. Ids are derived from
content (`tbpipe.pipeline.lake.ids`), never numbered, so any engine on any machine computes the
same id for the same thing and a distributed job needs no counter.

Layout, one folder per table under the lake's root:

    <lake>/_lake.json                                   format and version
    <lake>/event_rows/run_number=<n>/part-*.parquet     partitioned by run: a run's partition is
    <lake>/event_counts/run_number=<n>/part-*.parquet   replaced when the run is ingested again
    <lake>/site_counts/run_number=<n>/part-*.parquet
    <lake>/runs/part-*.parquet, <lake>/stacks/...       the other tables, unpartitioned

A run rolled up by `tbpipe retain --lake` has no events, GPU activity, event counts or site counts
partitions; its counts are in `rolled_up_counts` (and `rolled_up_threads`, `rolled_up_forward_counts`)
partitions, and `runs.rolled_up_at` says so (the views read each run from one side, by that column).

Tables of kind RUN are keyed by run (a re-ingested run replaces its rows); tables of kind CONTENT
are keyed by a content id (rows are only ever added, each key once); WHOLE tables are small and
rewritten as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

LAKE_FORMAT = "tbpipe-lake"
LAKE_VERSION = 1
LAKE_FILE = "_lake.json"
PARTITION = "run_number"

RUN, CONTENT, WHOLE = "run", "content", "whole"

_TS = pa.timestamp("us", tz="UTC")
_RANGE = pa.struct([pa.field("lo", pa.int64()), pa.field("hi", pa.int64())])


@dataclass(frozen=True)
class LakeTable:
    name: str
    schema: pa.Schema  # every column, the partition column included
    kind: str  # RUN, CONTENT or WHOLE
    key: tuple[str, ...]  # what identifies a row (RUN tables: the run)
    partitioned: bool = False  # Hive-partitioned by PARTITION
    doc: str = ""

    @property
    def file_schema(self) -> pa.Schema:
        """The columns stored in the files (a partition column lives in the folder names)."""
        if not self.partitioned:
            return self.schema
        return pa.schema([f for f in self.schema if f.name != PARTITION])


def _table(name: str, kind: str, key: tuple[str, ...], fields: list, *, partitioned: bool = False, doc: str = ""):
    return LakeTable(name, pa.schema([pa.field(n, t) for n, t in fields]), kind, key, partitioned, doc)


TABLES: dict[str, LakeTable] = {
    t.name: t
    for t in [
        _table(
            "runs",
            RUN,
            ("run_id",),
            [
                ("run_id", pa.string()),
                ("run_number", pa.int64()),
                ("parent_run_id", pa.string()),
                ("started_at", _TS),
                ("ended_at", _TS),
                ("complete", pa.bool_()),
                ("host", pa.string()),
                ("pid", pa.int64()),
                ("argv", pa.list_(pa.string())),
                ("cwd", pa.string()),
                ("labels", pa.map_(pa.string(), pa.string())),
                ("python_version", pa.string()),
                ("python_implementation", pa.string()),
                ("torch_version", pa.string()),
                ("cuda_version", pa.string()),
                ("sys_path", pa.list_(pa.string())),
                ("tbpipe_version", pa.string()),
                ("sources", pa.list_(pa.string())),
                ("capture", pa.string()),  # JSON
                ("threads", pa.map_(pa.int64(), pa.string())),
                ("events_recorded", pa.int64()),
                ("events_dropped", pa.int64()),
                ("events", pa.int64()),
                ("stacks", pa.int64()),
                ("new_stacks", pa.int64()),
                ("capture_errors", pa.list_(pa.string())),
                ("ingest_notes", pa.list_(pa.string())),
                ("source_dir", pa.string()),
                ("parts", pa.string()),
                ("ingested_at", _TS),
                ("manifest", pa.string()),  # JSON
                ("rolled_up_at", _TS),  # NULL while the run keeps its events (`tbpipe retain`)
            ],
            doc="one row per ingested run, from its manifest",
        ),
        _table(
            "run_modules",
            RUN,
            ("run_id",),
            [
                ("run_id", pa.string()),
                ("module_index", pa.int32()),
                ("module_key", pa.string()),
                ("path", pa.string()),
                ("load_bias", pa.int64()),
                ("exec_ranges", pa.list_(_RANGE)),
            ],
            doc="the ELF objects each run loaded",
        ),
        _table(
            "modules",
            WHOLE,
            ("module_key",),
            [
                ("module_key", pa.string()),
                ("path", pa.string()),
                ("quality", pa.string()),
                ("reason", pa.string()),
                ("debug_file", pa.string()),
                ("found_via", pa.string()),
                ("checked_at", _TS),
                ("build_id", pa.string()),
            ],
            doc="each ELF object by module key, with the debug info found for it",
        ),
        _table(
            "symbols",
            CONTENT,
            ("module_key", "address", "exact", "depth"),
            [
                ("module_key", pa.string()),
                ("address", pa.int64()),
                ("exact", pa.bool_()),
                ("depth", pa.int32()),
                ("function", pa.string()),
                ("file", pa.string()),
                ("line", pa.int32()),
                ("inlined", pa.bool_()),
                ("reason", pa.string()),
            ],
            doc="every (module, address) symbolized, with its inline chain",
        ),
        _table(
            "stacks",
            CONTENT,
            ("stack_id",),
            [
                ("stack_id", pa.int64()),  # the portable stack hash's bits
                ("status", pa.int32()),
                ("native_frames", pa.int32()),
                ("python_frames", pa.int32()),
                ("frames", pa.int32()),
                ("problem", pa.string()),
                ("symbolized_depth", pa.int32()),
                ("first_run_id", pa.string()),
            ],
            doc="each distinct stack once",
        ),
        _table(
            "frames",
            CONTENT,
            ("frame_id",),
            [
                ("frame_id", pa.int64()),
                ("kind", pa.string()),
                ("function", pa.string()),
                ("file", pa.string()),
                ("line", pa.int32()),
                ("first_line", pa.int32()),
                ("module", pa.string()),
                ("module_key", pa.string()),
                ("address", pa.int64()),
                ("exact", pa.bool_()),
                ("inlined", pa.bool_()),
                ("reason", pa.string()),
            ],
            doc="each distinct frame once",
        ),
        _table(
            "stack_frame_rows",
            CONTENT,
            ("stack_id", "depth"),
            [
                ("stack_id", pa.int64()),
                ("depth", pa.int32()),
                ("slot", pa.int32()),
                ("chain_depth", pa.int32()),
                ("frame_id", pa.int64()),
            ],
            doc="the frames of every stack in combined order, by frame id",
        ),
        _table(
            "event_names",
            CONTENT,
            ("name_id",),
            [("name_id", pa.int64()), ("kind", pa.string()), ("name", pa.string())],
            doc="each distinct (kind, name) of the events once",
        ),
        _table(
            "event_rows",
            RUN,
            (PARTITION,),
            [
                ("event_id", pa.int64()),  # position in the run, from 1, in recording order
                ("run_number", pa.int64()),
                ("ts", _TS),
                ("thread_id", pa.int64()),
                ("name_id", pa.int64()),
                ("stack_id", pa.int64()),
                # JSON, a CUDA call's correlation id included (the DuckDB file keeps that in a column)
                ("attrs", pa.string()),
            ],
            partitioned=True,
            doc="every recorded event",
        ),
        _table(
            "event_counts",
            RUN,
            (PARTITION,),
            [
                ("run_number", pa.int64()),
                ("name_id", pa.int64()),
                ("stack_id", pa.int64()),
                ("events", pa.int64()),
            ],
            partitioned=True,
            doc="events counted per run, kind/name and stack",
        ),
        _table(
            "site_counts",
            RUN,
            (PARTITION,),
            [
                ("run_number", pa.int64()),
                ("name_id", pa.int64()),
                ("site_id", pa.int64()),
                ("events", pa.int64()),
                ("site_file", pa.string()),
                ("site_line", pa.int32()),
                ("site_is_user", pa.bool_()),
            ],
            partitioned=True,
            doc="events counted per run, kind/name and call site, with where the site was in that run",
        ),
        _table(
            "gpu_activity",
            RUN,
            (PARTITION,),
            [
                ("run_number", pa.int64()),
                ("activity_id", pa.int64()),  # position in the run, from 1, in the order of its parts
                ("kind", pa.string()),
                ("name", pa.string()),
                ("gpu_start", _TS),
                ("gpu_end", _TS),
                ("duration_ns", pa.int64()),
                ("device", pa.int64()),
                ("context", pa.int64()),
                ("stream", pa.int64()),
                ("correlation_id", pa.int64()),
                ("event_id", pa.int64()),  # `event_rows.event_id` in the same run
                ("graph_id", pa.int64()),
                ("graph_node_id", pa.int64()),  # the uint64's bits
                ("capture_event_id", pa.int64()),
                ("bytes", pa.int64()),
                ("grid_x", pa.int32()),
                ("grid_y", pa.int32()),
                ("grid_z", pa.int32()),
                ("block_x", pa.int32()),
                ("block_y", pa.int32()),
                ("block_z", pa.int32()),
                ("registers_per_thread", pa.int32()),
                ("static_shared_mem", pa.int32()),
                ("dynamic_shared_mem", pa.int32()),
            ],
            partitioned=True,
            doc="GPU activity records joined to their launch events (lake export only)",
        ),
        _table(
            "gpu_time_counts",
            RUN,
            (PARTITION,),
            [
                ("run_number", pa.int64()),
                ("name_id", pa.int64()),
                ("stack_id", pa.int64()),
                ("capture_stack_id", pa.int64()),
                ("kind", pa.string()),
                ("name", pa.string()),
                ("executions", pa.int64()),
                ("timed", pa.int64()),
                ("gpu_time_ns", pa.int64()),
                ("gpu_time_sq_us", pa.float64()),
                ("min_ns", pa.int64()),
                ("max_ns", pa.int64()),
                ("bytes", pa.int64()),
            ],
            partitioned=True,
            doc="GPU time per run, launch name and stack (lake export only)",
        ),
        _table(
            "rolled_up_counts",
            RUN,
            (PARTITION,),
            [
                ("stack_id", pa.int64()),
                ("name_id", pa.int64()),
                ("thread", pa.int32()),  # the thread's number in its run (`rolled_up_threads`)
                ("run_number", pa.int64()),
                ("events", pa.int64()),
            ],
            partitioned=True,
            doc="events of rolled-up runs counted per run, kind/name, stack and thread (`tbpipe retain`)",
        ),
        _table(
            "rolled_up_name_counts",
            RUN,
            (PARTITION,),
            [("run_number", pa.int64()), ("name_id", pa.int64()), ("events", pa.int64())],
            partitioned=True,
            doc="events of rolled-up runs counted per run and kind/name",
        ),
        _table(
            "rolled_up_threads",
            RUN,
            (PARTITION,),
            [("run_number", pa.int64()), ("thread", pa.int32()), ("thread_id", pa.int64())],
            partitioned=True,
            doc="the threads of each rolled-up run, numbered in the order of their first events",
        ),
        _table(
            "rolled_up_forward_counts",
            RUN,
            (PARTITION,),
            [
                ("run_number", pa.int64()),
                ("name_id", pa.int64()),
                ("stack_id", pa.int64()),
                ("forward_stack_id", pa.int64()),
                ("events", pa.int64()),
            ],
            partitioned=True,
            doc="backward events of rolled-up runs counted per own stack and forward op's stack",
        ),
        _table(
            "sites",
            CONTENT,
            ("site_id",),
            [
                ("site_id", pa.int64()),
                ("site_key", pa.string()),
                ("function", pa.string()),
                ("file", pa.string()),
                ("line", pa.int32()),
                ("kind", pa.string()),
                ("portable_file", pa.string()),
                ("line_offset", pa.int32()),
                ("module", pa.string()),
            ],
            doc="each distinct call site once",
        ),
        _table(
            "stack_sites",
            CONTENT,
            ("stack_id",),
            [
                ("stack_id", pa.int64()),
                ("site_id", pa.int64()),
                ("site_depth", pa.int32()),
                ("site_kind", pa.string()),
                ("site_is_user", pa.bool_()),
                ("site_file", pa.string()),
                ("site_line", pa.int32()),
            ],
            doc="the call site of every stack",
        ),
        _table(
            "source_files",
            CONTENT,
            ("file",),
            [("file", pa.string()), ("portable_file", pa.string()), ("root", pa.string())],
            doc="each Python file once, with its name relative to its import root",
        ),
        _table(
            "generated_code",
            CONTENT,
            ("prefix",),
            [("prefix", pa.string()), ("generator", pa.string()), ("first_run_id", pa.string())],
            doc="folders of code torch.compile or Triton generated, from the run manifests",
        ),
        _table(
            "user_code",
            WHOLE,
            ("prefix",),
            [("prefix", pa.string()), ("is_user", pa.bool_()), ("origin", pa.string()), ("added_at", _TS)],
            doc="the rules the stacks were sited with",
        ),
    ]
}
