"""`tbpipe ingest runs/ --engine spark --lake DIR`: the DuckDB ingest's steps as one Spark job.

Where each step runs (D = driver, E = executors):

  D  list run folders (absolute paths), read the lake's `runs` (run id -> complete, parts) and rules
  E  check the executors: the same tbpipe as the driver, the lake's folder writable (`executors`)
  E  prepare: validate, read and flatten each run (`steps.prepare_run` in `mapInArrow` over the
     paths): run rows, raw stack id -> stack id, run modules, the names its events use (from the
     parts' dictionaries), events whose attributes are not JSON (each part's distinct texts checked
     once); damaged runs come back quarantined, a folder an executor cannot read stops the job
     with its path. Then, in the same task, the run's events (`steps.write_run_events`): DuckDB
     reads each events part once, re-keys names and raw stacks by hash joins with the run's own
     maps just made, and writes the run's `event_rows` file and its `event_counts` (events per
     name and stack) into staging as run partitions (both moved into the lake once the run's
     other tables are in). No event passes through Spark's rows or Python objects: Spark's own
     read and write of every event cost more than the whole job's 3 µs an event (docs/scale.md)
  E  new stacks: distinct stack ids anti-joined with the lake's `stacks`; each new stack is laid
     out by one run holding it, picked by a hash of (stack, run) so the work spreads over runs
  E  lay out: `groupBy(run).applyInArrow(steps.lay_out_run)`: slots, stack rows, source files
  E  symbolize: the (module key, address, exact) of new slots the lake's `symbols` lacks,
     repartitioned by module key (a module with many addresses is split into buckets), each
     partition through tbpipe's Symbolizer with the executor's own symbol store
  E  frames and sites: `cogroup(...).applyInArrow(steps.build_frames)` per laying-out run: inline
     expansion, frame ids, and call sites by the packaged siting SQL in an in-memory DuckDB
  E  counts: per run, name and call site `site_counts` (what `call_sites` reads) from the staged
     event counts, written per run partition; the events' and event counts' partitions swapped in
  D  the runs rows (from the manifests: one small row per run) and the summary

Every intermediate result is written by Spark to `<lake>/_staging/<job>/` and read back, so no
step runs twice and nothing but per-run rows and per-module counts reaches the driver. Python runs
per run, per new stack and per symbol shard, never per event (a run's events are read and
written by DuckDB's vectorized C++ in the run's task). Tables are
written in dependency order and `runs` last: a job that dies leaves runs that the next job
ingests again (run partitions are replaced, content rows are added only when their id is new).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tbpipe.capture import __version__
from tbpipe.pipeline.db.ingest.outcomes import IngestSummary, RunOutcome
from tbpipe.pipeline.db.ingest.rows import run_row
from tbpipe.pipeline.db.ingest.site_counts import spark_site_counts
from tbpipe.pipeline.db.ingest.siting import generated_code_rows, parse_user_code, tbpipe_source_dirs
from tbpipe.pipeline.lake import executors, steps, store
from tbpipe.pipeline.lake.store import LakeError
from tbpipe.pipeline.rawrun import dangling_events_note, find_run_dirs
from tbpipe.schemas.lake import CONTENT, PARTITION, TABLES

if TYPE_CHECKING:
    from tbpipe.pipeline.symbols.debuginfod import DebuginfodSettings

DEFAULT_SHARD_ADDRESSES = 200_000  # addresses of one module symbolized by one task, at most
SHARD_CONF = "spark.tbpipe.symbolShardAddresses"  # --conf that sets it
DEFAULT_COMPACT_FILES = 32  # an unpartitioned table with more files than this is rewritten
SHUFFLE_CONF = "spark.sql.shuffle.partitions"


@dataclass
class SparkIngestSummary(IngestSummary):
    executors: list[str] = field(default_factory=list)  # per executor environment: host, tbpipe, Python
    events_cpu: float = 0.0  # CPU seconds the tasks spent writing events (within `prepare`)


@dataclass
class SparkIngestOptions:
    lake: Path
    master: str | None = None  # None: local[*], or what spark-submit set
    conf: dict[str, str] = field(default_factory=dict)
    debug_dirs: Sequence[Path] = ()
    cache_dir: Path | None = None  # each executor's symbol store (None: its default)
    # debuginfod servers: read here ($DEBUGINFOD_URLS, DEBUGINFOD_TIMEOUT) and shipped, so that every
    # executor asks the same ones, into its own debuginfod cache. None: $DEBUGINFOD_URLS.
    debuginfod: DebuginfodSettings | None = None
    user_code: Sequence[str] = ()
    recover_manifests: bool = False
    shard_addresses: int = DEFAULT_SHARD_ADDRESSES
    compact_files: int = DEFAULT_COMPACT_FILES
    # Called with (step name, True) before and (step name, False) after each step (benchmarks time them).
    on_step: Callable[[str, bool], None] | None = None


# ------------------------------------------------------------------------------------------ the session

LOCAL_CONF = {
    # Tests and laptops: no UI server, loopback only.
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}
JOB_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # The raw events' ts is TIMESTAMP(NANOS): read as a long, converted to microseconds as DuckDB does.
    "spark.sql.legacy.parquet.nanosAsLong": "true",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.parquet.compression.codec": "zstd",
    "spark.sql.sources.partitionOverwriteMode": "dynamic",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # Run-partitioned writes (events, their counts, site counts) without sorting every row by run
    # first: a task's rows belong to one run or a few, each given a writer of its own (a task with
    # more runs than this sorts the rest, as before).
    "spark.sql.optimizer.plannedWrite.enabled": "false",
    "spark.sql.maxConcurrentOutputFiles": "16",
}


def spark_session(master: str | None = None, conf: dict[str, str] | None = None) -> Any:
    """A SparkSession for the lake's jobs: `master` (default local[*]) and extra `conf`."""
    from pyspark.sql import SparkSession

    master = master or "local[*]"
    builder = SparkSession.builder.appName("tbpipe").master(master)
    settings = dict(JOB_CONF)
    if master.startswith("local"):
        settings.update(LOCAL_CONF)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf or {})
    # The executors' Python: PySpark takes it from PYSPARK_PYTHON when the context starts (only
    # spark-submit reads the setting), so the setting is put there.
    if settings.get("spark.pyspark.python"):
        os.environ["PYSPARK_PYTHON"] = settings["spark.pyspark.python"]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    for key, value in JOB_CONF.items():
        if key not in (conf or {}):
            session.conf.set(key, value)
    return session


def spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


# ------------------------------------------------------------------------------------------ tagged outputs
# A UDF has one output schema; steps that produce several tables emit one struct column per table
# and a `part` column naming the one that is set, and Spark writes them partitioned by `part`.


def tagged_schema(parts: dict[str, pa.Schema], extra: Sequence[pa.Field] = ()) -> pa.Schema:
    fields = [pa.field("part", pa.string()), *extra]
    fields += [pa.field(name, pa.struct(list(schema))) for name, schema in parts.items()]
    return pa.schema(fields)


def tagged_batches(schema: pa.Schema, part: str, table: pa.Table, **extra: Any):
    """RecordBatches of `schema` carrying `table` in column `part` (the other parts null)."""
    if table.num_rows == 0:
        return
    table = table.combine_chunks()
    count = table.num_rows
    columns = []
    for field_ in schema:
        if field_.name == "part":
            columns.append(pa.array([part] * count, pa.string()))
        elif field_.name in extra:
            columns.append(pa.array([extra[field_.name]] * count, field_.type))
        elif field_.name == part:
            arrays = [table[f.name].combine_chunks().cast(f.type) for f in field_.type]
            columns.append(pa.StructArray.from_arrays(arrays, fields=list(field_.type)))
        else:
            columns.append(pa.nulls(count, field_.type))
    yield from pa.Table.from_arrays(columns, schema=schema).to_batches()


PREPARED = tagged_schema(
    {
        # With what writing its events counted (`steps.write_run_events`) and the task's CPU seconds for it.
        "run": pa.schema(
            [
                *steps.PREPARED_RUN,
                steps.WRITTEN_EVENTS.field("stacks_used"),
                steps.WRITTEN_EVENTS.field("null_stack"),
                pa.field("events_cpu", pa.float64()),
            ]
        ),
        "stack": steps.RAW_STACK,
        "module": TABLES["run_modules"].schema.append(pa.field(PARTITION, pa.int64())),
        "name": steps.RUN_NAME,
    }
)
LAID_OUT = tagged_schema(
    {
        "slot": steps.SLOT,
        "stack": steps.NEW_STACK,
        "source_file": TABLES["source_files"].schema,
    },
    [pa.field(PARTITION, pa.int64())],
)
SYMBOLIZED = tagged_schema({"symbol": TABLES["symbols"].schema, "module": TABLES["modules"].schema})
BUILT = tagged_schema(
    {name: TABLES[name].schema for name in ("stacks", "frames", "stack_frame_rows", "sites", "stack_sites")}
)


# ------------------------------------------------------------------------------------------ the job


class _Job:
    def __init__(self, spark: Any, options: SparkIngestOptions, rules: list[tuple[str, bool, str]]):
        self.spark = spark
        self.options = options
        self.lake = Path(options.lake).resolve()
        self.rules = rules
        self.generated: list[tuple[str, str, str | None]] = []  # `generated_code` rows to site with
        self.staging = store.staging_dir(self.lake)
        self.symbol_store: str | None = None  # the executors' (`executors.symbol_store`)
        self.seconds: dict[str, float] = {}  # wall time per step

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        if self.options.on_step:
            self.options.on_step(name, True)
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started
            if self.options.on_step:
                self.options.on_step(name, False)

    # ---------------------------------------------------------------- lake reads and writes

    def read_table(self, name: str, directory: Path | None = None) -> Any:
        """The lake's table `name`, or that table's rows written to `directory` (staged)."""
        table = TABLES[name]
        directory = directory or store.table_dir(self.lake, name)
        files = store.data_files(directory)
        schema = spark_schema(table.schema)
        if not files:
            return self.spark.createDataFrame([], schema)
        reader = self.spark.read.schema(schema)
        if table.partitioned:
            return reader.option("basePath", str(directory)).parquet(str(directory))
        return reader.parquet(*[str(p) for p in files])

    def stage(self, name: str, frame: Any, partition: str | None = "part") -> Any:
        """Writes `frame` under the job's staging folder and gives it back as read from there."""
        path = str(self.staging / name)
        writer = frame.write.mode("overwrite")
        if partition:
            writer = writer.partitionBy(partition)
        writer.parquet(path)
        return self.spark.read.schema(frame.schema).parquet(path)

    def append_new(self, name: str, frame: Any) -> None:
        """Adds the rows of `frame` whose key the lake's table lacks (each key once)."""
        table = TABLES[name]
        assert table.kind == CONTENT
        key = list(table.key)
        existing = self.read_table(name).select(*key)
        rows = frame.dropDuplicates(key).join(existing, key, "left_anti").select(*table.schema.names)
        if self.add_files(rows, store.table_dir(self.lake, name)):
            self.compact(name)

    def add_files(self, frame: Any, directory: Path) -> int:
        """Writes `frame` beside the table and moves its non-empty files into `directory`: readers
        see whole files only, and a job that adds no rows adds no files. Returns the rows added."""

        target = self.staging / f"add-{uuid.uuid4().hex}"
        frame.coalesce(self._files()).write.mode("overwrite").parquet(str(target))
        added = 0
        for path in store.data_files(target):
            rows = pq.read_metadata(path).num_rows
            if rows:
                directory.mkdir(parents=True, exist_ok=True)
                os.rename(path, directory / path.name)
                added += rows
        shutil.rmtree(target, ignore_errors=True)
        return added

    def _files(self) -> int:
        """Files per append: one per core the job has, up to 8 (compaction merges them later)."""
        return max(1, min(8, self.spark.sparkContext.defaultParallelism))

    def compact(self, name: str) -> None:
        """Rewrites an unpartitioned table into few files when appends left many."""
        directory = store.table_dir(self.lake, name)
        files = store.data_files(directory)
        if len(files) <= self.options.compact_files:
            return
        size = sum(p.stat().st_size for p in files)
        count = max(1, math.ceil(size / (256 << 20)))
        target = self.staging / f"compact-{name}"
        self.read_table(name).coalesce(count).write.mode("overwrite").parquet(str(target))
        store.swap_in(target, directory)

    def replace_runs(self, name: str, frame: Any, replaced: list[str]) -> None:
        """A RUN table keyed by run id: the rows of replaced runs dropped, `frame`'s rows added."""
        directory = store.table_dir(self.lake, name)
        columns = TABLES[name].schema.names
        if replaced and store.data_files(directory):
            keep = self.read_table(name).where(~self._col("run_id").isin(replaced))
            target = self.staging / f"replace-{name}"
            keep.unionByName(frame.select(*columns)).coalesce(self._files()).write.mode("overwrite").parquet(
                str(target)
            )
            store.swap_in(target, directory)
        elif self.add_files(frame.select(*columns), directory):
            self.compact(name)

    def write_partitions(self, name: str, frame: Any) -> None:
        """A partitioned table's rows of some runs: each run's partition replaced by its rows in
        `frame` (dynamic partition overwrite), other runs' partitions left as they are."""
        frame.select(*TABLES[name].schema.names).write.mode("overwrite").partitionBy(PARTITION).parquet(
            str(store.table_dir(self.lake, name))
        )

    def replace_run_rows(self, rows: pa.Table, replaced: list[str]) -> None:
        """`runs` (one small row per run) on the driver: replaced runs' rows dropped, `rows` added."""
        directory = store.table_dir(self.lake, "runs")
        files = store.data_files(directory)
        schema = TABLES["runs"].schema
        if replaced or len(files) >= self.options.compact_files:
            kept = [pq.read_table(p, schema=schema) for p in files]
            old = pa.concat_tables(kept) if kept else schema.empty_table()
            old = old.filter(pc.invert(pc.is_in(old["run_id"], value_set=pa.array(replaced, pa.string()))))
            target = self.staging / "runs-table"
            target.mkdir()
            pq.write_table(pa.concat_tables([old, rows]), target / "part-0.parquet", compression="zstd")
            store.swap_in(target, directory)
        elif rows.num_rows:
            directory.mkdir(parents=True, exist_ok=True)
            name = f"part-{int(time.time() * 1e6)}-{os.getpid()}.parquet"
            pq.write_table(rows, directory / f".{name}", compression="zstd")
            os.rename(directory / f".{name}", directory / name)

    @staticmethod
    def _col(name: str) -> Any:
        from pyspark.sql import functions as F

        return F.col(name)

    # ---------------------------------------------------------------- the steps

    def prepare(self, run_dirs: list[Path], known: dict[str, tuple[bool, str]]) -> Any:
        """Each run prepared, and the events of each run to load written into staging (`event_rows`
        and `event_counts` run partitions) by the same task."""
        recover = self.options.recover_manifests
        schema = PREPARED
        events_dir, counts_dir = self.staging / "event_rows", self.staging / "event_counts"

        def prepare_partition(batches):
            for batch in batches:
                for path in batch.column("path").to_pylist():
                    prepared = steps.prepare_run(path, known, recover_manifests=recover)
                    run = dict(prepared.run, stacks_used=0, null_stack=0, events_cpu=0.0)
                    if run["status"] in ("ingested", "updated") and run["event_files"]:
                        started = time.thread_time()
                        written = steps.write_run_events(run, prepared.stacks, prepared.names, events_dir, counts_dir)
                        run.update(stacks_used=written["stacks_used"], null_stack=written["null_stack"])
                        run["events_cpu"] = time.thread_time() - started
                    yield from tagged_batches(
                        schema, "run", pa.Table.from_pylist([run], pa.schema(list(schema.field("run").type)))
                    )
                    yield from tagged_batches(schema, "stack", prepared.stacks)
                    modules = prepared.modules
                    if modules.num_rows:
                        number = run["run_number"]
                        modules = modules.append_column(PARTITION, pa.array([number] * modules.num_rows, pa.int64()))
                    yield from tagged_batches(schema, "module", modules)
                    yield from tagged_batches(schema, "name", prepared.names)

        paths = self.spark.createDataFrame([(str(p),) for p in run_dirs], "path string")
        paths = paths.repartition(max(1, min(len(run_dirs), 4 * self.spark.sparkContext.defaultParallelism)), "path")
        return self.stage("prepared", paths.mapInArrow(prepare_partition, spark_schema(schema)))

    def lay_out(self, prepared: Any, ready: Any) -> tuple[Any, Any]:
        """(laid-out parts, the new stacks with the run that lays each out)."""
        from pyspark.sql import functions as F

        raw = prepared.where(F.col("part") == "stack").select("stack.*").join(ready, PARTITION, "left_semi")
        known_stacks = self.read_table("stacks").select("stack_id")
        new = raw.select(PARTITION, "stack_id").distinct().join(known_stacks, "stack_id", "left_anti")
        owners = new.groupBy("stack_id").agg(F.min_by(PARTITION, F.xxhash64("stack_id", PARTITION)).alias(PARTITION))
        work = owners.join(ready.select(PARTITION, "path"), PARTITION)
        recover = self.options.recover_manifests
        schema = LAID_OUT

        def lay_out_group(group: pa.Table) -> pa.Table:
            number = group[PARTITION][0].as_py()
            laid = steps.lay_out_run(group["path"][0].as_py(), group["stack_id"].to_numpy(), recover_manifests=recover)
            batches = [
                *tagged_batches(schema, "slot", laid.slots, run_number=number),
                *tagged_batches(schema, "stack", laid.stacks, run_number=number),
                *tagged_batches(schema, "source_file", laid.source_files, run_number=number),
            ]
            return pa.Table.from_batches(batches, schema=schema)

        laid = work.groupBy(PARTITION).applyInArrow(lay_out_group, spark_schema(schema))
        return self.stage("laid", laid), owners

    def symbolize(self, laid: Any) -> Any:
        """Symbols of the new slots' addresses that the lake lacks, sharded by module key."""
        from pyspark.sql import functions as F

        slots = laid.where(F.col("part") == "slot").select("slot.*")
        requests = (
            slots.where((F.col("kind") == "native") & F.col("module_key").isNotNull())
            .groupBy("module_key", "address", "exact")
            .agg(F.min("module").alias("path"))
        )
        known = self.read_table("symbols").where(F.col("depth") == 0).select("module_key", "address", "exact")
        fresh = requests.join(known, ["module_key", "address", "exact"], "left_anti")
        fresh = self.stage("requests", fresh, partition=None)
        counts = {row[0]: row[1] for row in fresh.groupBy("module_key").count().collect()}
        if not counts:
            return None
        limit = max(1, self.options.shard_addresses)
        buckets = {key: max(1, math.ceil(count / limit)) for key, count in counts.items()}
        shards = sum(buckets.values())
        bucket_table = self.spark.createDataFrame(list(buckets.items()), "module_key string, buckets int")
        sharded = (
            fresh.join(F.broadcast(bucket_table), "module_key")
            .withColumn("bucket", F.pmod(F.xxhash64("address", "exact"), F.col("buckets")))
            .repartition(max(1, min(shards, 4 * self.spark.sparkContext.defaultParallelism)), "module_key", "bucket")
            .sortWithinPartitions("module_key", "address", "exact")
            .select(*steps.SYMBOL_REQUEST.names)
        )
        cache_dir = self.symbol_store
        # Read by the executors: absolute, and a folder an executor lacks is looked in and found empty.
        debug_dirs = [str(Path(d).expanduser().absolute()) for d in self.options.debug_dirs]
        debuginfod = steps.shipped_debuginfod(self.options.debuginfod)
        schema = SYMBOLIZED

        def symbolize_partition(batches):
            tables = [pa.Table.from_batches([b]) for b in batches]
            requests = pa.concat_tables(tables) if tables else steps.SYMBOL_REQUEST.empty_table()
            if requests.num_rows == 0:
                return
            symbolizer = steps.new_symbolizer(cache_dir, debug_dirs, debuginfod)
            try:
                symbols, modules = steps.symbolize(requests.cast(steps.SYMBOL_REQUEST), symbolizer)
            finally:
                symbolizer.close()
            yield from tagged_batches(schema, "symbol", symbols)
            yield from tagged_batches(schema, "module", modules)

        return self.stage("symbolized", sharded.mapInArrow(symbolize_partition, spark_schema(schema)))

    def build(self, laid: Any, symbolized: Any) -> Any:
        from pyspark.sql import functions as F

        symbols = self.read_table("symbols")
        if symbolized is not None:
            symbols = symbols.unionByName(symbolized.where(F.col("part") == "symbol").select("symbol.*"))
        # Named apart: both sides of the cogroup come from the same rows.
        slots = laid.where(F.col("part") == "slot").select(F.col(PARTITION).alias("owner"), "slot.*")
        keys = slots.where(F.col("kind") == "native").select("owner", "module_key", "address", "exact").distinct()
        needed = keys.join(symbols, ["module_key", "address", "exact"]).select("owner", *TABLES["symbols"].schema.names)
        rules, generated = self.rules, self.generated
        schema = BUILT
        slot_names, stack_names = steps.SLOT.names, steps.NEW_STACK.names
        source_names = TABLES["source_files"].schema.names

        def build_group(parts: pa.Table, symbol_rows: pa.Table) -> pa.Table:
            def part(name: str, names: list[str]) -> pa.Table:
                rows = parts.filter(pc.equal(parts["part"], name))[name].combine_chunks()
                return pa.Table.from_arrays(rows.flatten(), names=names) if len(rows) else None

            slot_rows = part("slot", slot_names)
            if slot_rows is None:
                return schema.empty_table()
            stack_rows = part("stack", stack_names)
            sources = part("source_file", source_names)
            if sources is None:
                sources = TABLES["source_files"].schema.empty_table()
            sym = symbol_rows.select(TABLES["symbols"].schema.names).cast(TABLES["symbols"].schema)
            built = steps.build_frames(
                slot_rows.cast(steps.SLOT),
                stack_rows.cast(steps.NEW_STACK),
                sources.cast(TABLES["source_files"].schema),
                sym,
                rules,
                generated,
            )
            batches = []
            for name in ("stacks", "frames", "stack_frame_rows", "sites", "stack_sites"):
                batches += list(tagged_batches(schema, name, getattr(built, name)))
            return pa.Table.from_batches(batches, schema=schema)

        grouped = laid.groupBy(PARTITION).cogroup(needed.groupBy("owner"))
        return self.stage("built", grouped.applyInArrow(build_group, spark_schema(schema)))

    def publish_partitions(self, name: str, staged: Path, runs: list[dict[str, Any]]) -> None:
        """The staged partitions of table `name` of `runs` moved into the lake, each replacing the run's own."""
        for run in runs:
            source = staged / f"{PARTITION}={run['run_number']}"
            if source.is_dir():
                store.swap_in(source, store.partition_dir(self.lake, name, run["run_number"]))

    def load(self, prepared: Any, ready_runs: list[dict[str, Any]], summary: IngestSummary) -> dict[int, int]:
        """Everything after `prepare` for the runs to load; returns new stacks per run. Complete runs
        with events whose stack they do not hold are quarantined here (their dicts in `ready_runs`
        change)."""
        from pyspark.sql import functions as F

        spark = self.spark
        counts = None
        if store.data_files(self.staging / "event_counts"):
            counts = self.read_table("event_counts", self.staging / "event_counts")
        stacks_per_run = {r["run_number"]: r["stacks_used"] for r in ready_runs}
        null_stacks = {r["run_number"]: r["null_stack"] for r in ready_runs}
        for run in ready_runs:
            number = run["run_number"]
            dangling = steps.dangling_events(run, null_stacks.get(number, 0))
            if dangling:
                run["notes"] = [*(run["notes"] or []), dangling_events_note(dangling)]
                if run["complete"]:
                    run["status"] = "quarantined"
                    run["reason"] = f"{Path(run['path'])}: {'; '.join(run['notes'])}"
        ready_runs = [r for r in ready_runs if r["status"] != "quarantined"]
        if not ready_runs:
            return {}
        numbers = [r["run_number"] for r in ready_runs]
        ready = spark.createDataFrame(
            [(r["run_number"], r["path"]) for r in ready_runs], "run_number long, path string"
        )
        self.generated = self.generated_code(ready_runs)
        with self.step("lay out"):
            laid, owners = self.lay_out(prepared, ready)
            new_stacks = {row[0]: row[1] for row in owners.groupBy(PARTITION).count().collect()}
        symbolized = built = None
        if new_stacks:
            with self.step("symbolize"):
                symbolized = self.symbolize(laid)
            with self.step("frames and sites"):
                built = self.build(laid, symbolized)
        with self.step("write stacks, frames, symbols, sites"):
            if symbolized is not None:
                self.append_new("symbols", symbolized.where(F.col("part") == "symbol").select("symbol.*"))
            self.write_modules(prepared, ready, symbolized)
            if built is not None:
                for name in ("frames", "stack_frame_rows", "sites", "stack_sites", "stacks"):
                    self.append_new(name, built.where(F.col("part") == name).select(f"{name}.*"))
                sources = laid.where(F.col("part") == "source_file").select("source_file.*")
                sources = sources.groupBy("file").agg(
                    F.min("portable_file").alias("portable_file"), F.min_by("root", "portable_file").alias("root")
                )
                self.append_new("source_files", sources)
            self.write_user_code()
            self.append_new(
                "generated_code",
                spark.createDataFrame(self.generated, "prefix string, generator string, first_run_id string"),
            )
        if counts is not None:
            with self.step("publish events and counts"):
                names = prepared.where((F.col("part") == "name") & F.col(f"name.{PARTITION}").isin(numbers))
                self.append_new("event_names", names.select("name.name_id", "name.kind", "name.name"))
                self.publish_partitions("event_rows", self.staging / "event_rows", ready_runs)
            with self.step("count sites"):
                self.write_site_counts(counts.where(F.col(PARTITION).isin(numbers)))
            with self.step("publish events and counts"):  # after the site counts that read them
                self.publish_partitions("event_counts", self.staging / "event_counts", ready_runs)
        with self.step("write runs"):
            replaced = [r["run_id"] for r in ready_runs if r["status"] == "updated"]
            self.replace_runs("run_modules", _run_modules(prepared, ready), replaced)
            self.replace_run_rows(self.run_rows(ready_runs, stacks_per_run, new_stacks), replaced)
        if built is not None:
            _count_frames(built, summary)
        return new_stacks

    def write_site_counts(self, counts: Any) -> None:
        """`site_counts` of the loaded runs: their event counts summed per call site (the rule's
        Spark fast path, `site_counts.spark_site_counts`), each run's in one task (one file)."""
        per_site = spark_site_counts(counts, self.read_table("stack_sites"), clustered_by=PARTITION)
        self.write_partitions("site_counts", per_site)

    # ---------------------------------------------------------------- the runs rows

    def run_rows(self, ready: list[dict[str, Any]], counts: dict[int, int], new_stacks: dict[int, int]) -> pa.Table:

        now = int(time.time() * 1e6)
        rows = [
            run_row(
                json.loads(run["manifest"]),
                run_number=run["run_number"],
                events=run["events"],
                stacks=counts.get(run["run_number"], 0),
                new_stacks=new_stacks.get(run["run_number"], 0),
                notes=run["notes"],
                run_dir=Path(run["path"]),
                fingerprint=run["fingerprint"],
                ingested_at=now,
            )
            for run in ready
        ]
        return pa.Table.from_pylist(rows, schema=TABLES["runs"].schema)

    def write_modules(self, prepared: Any, ready: Any, symbolized: Any) -> None:
        """`modules`: rows of the modules just symbolized replace older ones; every module a run
        loaded has a row. Small (one row per module): rewritten as a whole."""
        from pyspark.sql import functions as F

        existing = self.read_table("modules")
        columns = TABLES["modules"].schema.names
        if symbolized is not None:
            fresh = symbolized.where(F.col("part") == "module").select("module.*").dropDuplicates(["module_key"])
            existing = existing.join(fresh.select("module_key"), "module_key", "left_anti").unionByName(
                fresh.select(*columns)
            )
        loaded = (
            prepared.where(F.col("part") == "module")
            .select("module.*")
            .join(ready, PARTITION, "left_semi")
            .groupBy("module_key")
            .agg(F.min("path").alias("path"))
        )
        build_id = F.when(
            ~F.col("module_key").startswith("path:") & ~F.col("module_key").startswith("invalid:"), F.col("module_key")
        )
        missing = loaded.join(existing.select("module_key"), "module_key", "left_anti").select(
            "module_key",
            "path",
            *[F.lit(None).cast("string").alias(c) for c in ("quality", "reason", "debug_file", "found_via")],
            F.lit(None).cast("timestamp").alias("checked_at"),
            build_id.alias("build_id"),
        )
        target = self.staging / "modules-table"
        existing.unionByName(missing).coalesce(1).write.mode("overwrite").parquet(str(target))
        store.swap_in(target, store.table_dir(self.lake, "modules"))

    def generated_code(self, ready_runs: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
        """The `generated_code` rows to site with: the lake's, and the folders the runs' manifests name
        first. A new folder that holds files or modules of stacks the lake has already sited would
        need every stored stack sited again (the DuckDB ingest does that), which the job does not
        do yet: it is refused."""

        known: dict[str, tuple[str, str | None]] = {}
        con = store.connect(self.lake)
        try:
            known = {p: (g, r) for p, g, r in con.execute("SELECT * FROM generated_code").fetchall()}
            # In the order the DuckDB ingest meets the runs (`find_run_dirs`'): the same first run per folder.
            in_order = sorted(ready_runs, key=lambda run: Path(run["path"]))
            named = generated_code_rows([json.loads(run["manifest"]) for run in in_order])
            new = [prefix for prefix in named if prefix not in known]
            if new:
                (stored,) = con.execute(
                    """
                    SELECT EXISTS (SELECT 1 FROM source_files s, unnest($1) AS t(p) WHERE starts_with(s.file, t.p))
                        OR EXISTS (SELECT 1 FROM modules m, unnest($1) AS t(p) WHERE starts_with(m.path, t.p))
                    """,
                    [new],
                ).fetchone()
                if stored:
                    raise LakeError(
                        f"{self.lake}: the runs name folders of generated code ({', '.join(new)}) that hold files of "
                        "stacks already sited in the lake; the lake cannot re-site its stored stacks yet (ingest "
                        "with the DuckDB engine and `tbpipe lake export` instead)"
                    )
        finally:
            con.close()
        rows = {**{p: named[p] for p in new}, **known}
        return sorted((prefix, generator, run_id) for prefix, (generator, run_id) in rows.items())

    def write_user_code(self) -> None:
        table = pa.table(
            {
                "prefix": pa.array([r[0] for r in self.rules], pa.string()),
                "is_user": pa.array([r[1] for r in self.rules], pa.bool_()),
                "origin": pa.array([r[2] for r in self.rules], pa.string()),
                "added_at": pa.array(
                    [int(time.time() * 1e6)] * len(self.rules), TABLES["user_code"].schema.field("added_at").type
                ),
            }
        )
        target = self.staging / "user-code-table"
        target.mkdir()
        pq.write_table(table, target / "part-0.parquet", compression="zstd")
        store.swap_in(target, store.table_dir(self.lake, "user_code"))


def lake_rules(lake: Path, user_code: Sequence[str]) -> list[tuple[str, bool, str]]:
    """The `user_code` rules to site with: the lake's, tbpipe's own folders, and `user_code` on top.

    Rules that change what is user code would need every stored stack sited again, which the
    lake's job does not do yet: such a change is refused.
    """

    rules: dict[str, tuple[bool, str]] = {}
    stored: dict[str, bool] = {}
    if store.data_files(store.table_dir(lake, "user_code")):
        con = store.connect(lake)
        try:
            for prefix, is_user, origin in con.execute("SELECT prefix, is_user, origin FROM user_code").fetchall():
                rules[prefix] = (is_user, origin)
                stored[prefix] = is_user
        finally:
            con.close()
    for prefix in tbpipe_source_dirs():
        rules.setdefault(prefix, (False, "tbpipe"))
    for prefix, is_user in parse_user_code(list(user_code)):
        rules[prefix] = (is_user, "user")
    wanted = {prefix: value[0] for prefix, value in rules.items()}
    if stored and wanted != stored and store.data_files(store.table_dir(lake, "stack_sites")):
        raise LakeError(
            f"{lake}: these --user-code rules change which files are user code for stacks already sited in the "
            "lake; the lake cannot re-site its stored stacks yet (export the DuckDB database again instead)"
        )
    return sorted((prefix, is_user, origin) for prefix, (is_user, origin) in rules.items())


def ingest_runs_spark(roots: Sequence[Path], options: SparkIngestOptions, *, spark: Any = None) -> SparkIngestSummary:
    """Ingests every run folder under `roots` into the lake with Spark; see the module docstring."""
    from pyspark.sql import functions as F

    started = time.monotonic()
    # Executors resolve paths in folders of their own: every path handed to them is absolute.
    lake = executors.local_path(options.lake)
    store.create_lake(lake)
    given = {executors.local_path(r): Path(r) for r in roots}
    run_dirs = find_run_dirs(list(given))
    summary = SparkIngestSummary(db_path=lake)
    rules = lake_rules(lake, options.user_code)
    summary.user_code = parse_user_code(list(options.user_code))
    known: dict[str, tuple[bool, str]] = {}
    if store.data_files(store.table_dir(lake, "runs")):
        con = store.connect(lake)
        try:
            known = {
                r[0]: (bool(r[1]), r[2]) for r in con.execute("SELECT run_id, complete, parts FROM runs").fetchall()
            }
        finally:
            con.close()
    if not run_dirs:
        summary.seconds = time.monotonic() - started
        return summary
    spark = spark or spark_session(options.master, options.conf)
    for key, value in JOB_CONF.items():
        if key not in options.conf:
            spark.conf.set(key, value)
    if SHUFFLE_CONF not in options.conf and not spark.sparkContext.getConf().contains(SHUFFLE_CONF):
        # The job's shuffles carry counts and stacks, not events: a few partitions per core (Spark's
        # default of 200 splits every map task's output 200 ways, whatever the cluster's size).
        spark.conf.set(SHUFFLE_CONF, str(max(4, 2 * spark.sparkContext.defaultParallelism)))
    settings = {key: options.conf.get(key) or spark.conf.get(key, None) for key in _JOB_SETTINGS}
    if settings[SHARD_CONF]:
        options.shard_addresses = int(settings[SHARD_CONF])
    job = _Job(spark, options, rules)
    job.symbol_store = executors.symbol_store({k: v for k, v in settings.items() if v}, options.cache_dir)
    try:
        with job.step("check executors"):
            reports = executors.check_executors(spark, lake, __version__)
            summary.executors = [executors.report_line(report) for report in reports]
        with job.step("prepare"):
            prepared = job.prepare(run_dirs, known)
            runs = [r.asDict(recursive=True) for r in prepared.where(F.col("part") == "run").select("run.*").collect()]
            summary.events_cpu = sum(run["events_cpu"] or 0.0 for run in runs)
        unreachable = executors.unreachable_runs(runs)
        if unreachable:
            executors.refuse_unreachable(unreachable)
        ready_runs = [r for r in runs if r["status"] in ("ingested", "updated")]
        new_stacks: dict[int, int] = {}
        if ready_runs:
            new_stacks = job.load(prepared, ready_runs, summary)
    finally:
        shutil.rmtree(job.staging, ignore_errors=True)
        _remove_empty(lake / store.STAGING)
    for run in runs:
        summary.outcomes.append(
            RunOutcome(
                _as_given(Path(run["path"]), given),
                run["status"],
                run_id=run["run_id"],
                complete=run["complete"],
                events=(run["events"] or 0) if run["status"] in ("ingested", "updated") else 0,
                new_stacks=new_stacks.get(run["run_number"], 0) if run["status"] in ("ingested", "updated") else 0,
                reason=run["reason"],
                notes=list(run["notes"] or []),
            )
        )
    summary.outcomes.sort(key=lambda o: str(o.path))
    summary.seconds = time.monotonic() - started
    return summary


_JOB_SETTINGS = (SHARD_CONF, executors.SYMBOL_STORE_CONF)


def _as_given(path: Path, given: dict[Path, Path]) -> Path:
    """A run folder as the user named it: under the root given (relative, if it was)."""
    for absolute, named in given.items():
        if path == absolute or absolute in path.parents:
            return named / path.relative_to(absolute)
    return path


def _run_modules(prepared: Any, ready: Any) -> Any:
    from pyspark.sql import functions as F

    modules = prepared.where(F.col("part") == "module").select("module.*").join(ready, PARTITION, "left_semi")
    return modules.select(*TABLES["run_modules"].schema.names)


def _count_frames(built: Any, summary: IngestSummary) -> None:
    """The summary's native frames of the new stacks, symbolized or not."""
    from pyspark.sql import functions as F

    rows = (
        built.where(F.col("part") == "stack_frame_rows").select("stack_frame_rows.*").where(F.col("chain_depth") == 0)
    )
    frames = built.where(F.col("part") == "frames").select("frames.*").dropDuplicates(["frame_id"])
    native = rows.join(frames.where(F.col("kind") == "native"), "frame_id")
    for symbolized, count in native.groupBy(F.col("function").isNotNull()).count().collect():
        if symbolized:
            summary.frames_symbolized += count
        else:
            summary.frames_unsymbolized += count


def _remove_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


__all__ = ["SparkIngestOptions", "ingest_runs_spark", "spark_session"]
