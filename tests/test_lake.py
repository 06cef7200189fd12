"""The lake: really captured runs ingested by a real Spark (`tbpipe ingest --engine spark`) and by
DuckDB (`tbpipe ingest --db`), read back by DuckDB and by Spark SQL, compared row for row.

The nights' lake is built as a user builds it on a cluster: the CLI, from the nights' folder with
relative paths, on a Spark standalone cluster started for the session (a master and a worker on
loopback, support/spark_cluster.py) whose executors run another working folder, another
environment and the Python of the archive `tbpipe lake package` made. One local SparkSession
(local[2], no UI, loopback) reads the lakes back with Spark SQL and builds the smaller lakes of the
quicker tests.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import QUICK_JVM, TBPIPE, spark_unavailable
from test_generated_code import generated  # noqa: F401 - the fixture: a run with generated code and its database
from test_gpu_activity import double_library, workload  # noqa: F401 - fixtures: a run with GPU activity, ingested
from test_report import VERSION_1, capture_night, version_2

from tbpipe.capture import __version__
from tbpipe.pipeline.db.connection import open_database, query_rows
from tbpipe.pipeline.lake import ids, steps, store
from tbpipe.pipeline.lake.executors import SYMBOL_STORE_CONF
from tbpipe.pipeline.lake.spark_ingest import SHARD_CONF
from tbpipe.schemas.lake import TABLES

SHARD_ADDRESSES = 2  # small: the libpython module's addresses are split over several tasks


def tbpipe(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    full = dict(os.environ, COLUMNS="200", **(env or {}))
    return subprocess.run([*TBPIPE, *args], capture_output=True, text=True, timeout=timeout, env=full, cwd=cwd)


# ------------------------------------------------------------------------------------------ a standalone cluster


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """A Spark master and worker on loopback for the whole session (support/spark_cluster.py)."""
    reason = spark_unavailable()
    if reason:
        pytest.skip(reason)
    from support.spark_cluster import start_cluster

    cluster = start_cluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def executor_archive(tmp_path_factory) -> Path:
    """`tbpipe lake package` of a venv holding tbpipe as a wheel installs it; the same venv marked as
    an editable install (which points executors at this machine's checkout) is refused first."""
    from support.spark_cluster import venv_with_installed_tbpipe

    base = tmp_path_factory.mktemp("executor-env")
    venv = venv_with_installed_tbpipe(base / "venv")
    (marker,) = venv.glob("lib/python*/site-packages/tbpipe-*.dist-info")
    (marker / "direct_url.json").write_text(json.dumps({"url": "file:///checkout", "dir_info": {"editable": True}}))
    editable = tbpipe("lake", "package", "--venv", str(venv), "--out", str(base / "refused.tar.gz"))
    assert editable.returncode == 2 and "editable mode" in " ".join(editable.stderr.split()), editable.stderr
    assert not (base / "refused.tar.gz").exists()
    (marker / "direct_url.json").unlink()
    archive = base / "tbpipe-env.tar.gz"
    result = tbpipe("lake", "package", "--venv", str(venv), "--out", str(archive))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tbpipe {__version__}" in result.stdout and "spark.archives=" in result.stdout
    return archive


def on_cluster(cluster, *, archive: Path | None = None, **conf: str) -> list[str]:
    """`tbpipe ingest` options that run the job on `cluster` (its executors running the archive's Python)."""
    settings = {
        **cluster.driver_conf(),
        "spark.sql.shuffle.partitions": "4",
        SHARD_CONF: str(SHARD_ADDRESSES),
        **QUICK_JVM,
        **conf,
    }
    if archive is not None:
        settings.update({"spark.archives": f"{archive}#tbpipe-env", "spark.pyspark.python": "./tbpipe-env/bin/python"})
    return ["--master", cluster.url, *[f"--conf={key}={value}" for key, value in settings.items()]]


# The driver's own servers on loopback as well.
DRIVER_ENV = {"SPARK_LOCAL_IP": "127.0.0.1"}


@pytest.fixture(scope="module")
def nights(tmp_path_factory) -> Path:
    """Three nights, two ranks each, captured with `tbpipe run` in checkouts of their own, and one
    damaged copy of a run (its stacks part cut short) under a folder of its own."""
    root = tmp_path_factory.mktemp("lake-nights")
    capture_night(root, 1, VERSION_1, commit="c1")
    capture_night(root, 2, VERSION_1, commit="c2")
    capture_night(root, 3, version_2(), commit="c3")
    source = sorted((root / "runs").iterdir())[0]
    damaged = root / "runs" / "damaged" / (source.name + "-dmg")
    shutil.copytree(source, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["run_id"] = damaged.name
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    stacks = sorted(damaged.glob("stacks-*.parquet"))[0]
    stacks.write_bytes(stacks.read_bytes()[: stacks.stat().st_size // 2])
    # Another copy whose events carry attributes that are not JSON: readable, but refused by both.
    garbled = root / "runs" / "damaged" / (source.name + "-json")
    shutil.copytree(source, garbled)
    manifest["run_id"] = garbled.name
    (garbled / "manifest.json").write_text(json.dumps(manifest))
    part = sorted(garbled.glob("events-*.parquet"))[0]
    table = pq.read_table(part)
    attrs = table["attrs"].to_pylist()
    attrs[0] = "{not json"
    table = table.set_column(table.schema.get_field_index("attrs"), table.schema.field("attrs"), pa.array(attrs))
    pq.write_table(table, part, compression="zstd")
    return root


@pytest.fixture(scope="module")
def db(nights, symbol_cache) -> tuple[Path, str]:
    path = nights / "tbpipe.duckdb"
    result = tbpipe(
        "ingest", str(nights / "runs"), "--db", str(path), "--no-progress",
        env={"TBPIPE_CACHE_DIR": str(symbol_cache)},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # 1: a run was quarantined
    return path, result.stdout


@pytest.fixture(scope="module")
def spark_lake(nights, symbol_cache, spark_cluster, executor_archive) -> tuple[Path, str]:
    """The lake built by `tbpipe ingest runs --engine spark --lake lake` run in the nights' folder,
    on the standalone cluster, the executors running the packaged archive's Python and sharing the
    session's symbol store (`spark.tbpipe.symbolStore`); and what the command printed."""
    result = tbpipe(
        "ingest", "runs", "--engine", "spark", "--lake", "lake",
        *on_cluster(spark_cluster, archive=executor_archive, **{SYMBOL_STORE_CONF: str(symbol_cache)}),
        cwd=nights, env=DRIVER_ENV,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # 1: two runs are quarantined
    return nights / "lake", result.stdout


def duckdb_rows(path: Path, sql: str) -> list[tuple]:
    con = open_database(path, read_only=True)
    try:
        return query_rows(con, sql)
    finally:
        con.close()


def lake_rows(lake: Path, sql: str) -> list[tuple]:
    con = store.connect(lake)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _plain(value):
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    return value


def spark_rows(session, sql: str) -> list[tuple]:
    return sorted((tuple(_plain(v) for v in row) for row in session.sql(sql).collect()), key=repr)


def sorted_rows(rows: list[tuple]) -> list[tuple]:
    return sorted((tuple(_plain(v) for v in row) for row in rows), key=repr)


CALL_SITES = "SELECT * FROM call_sites"


def for_duckdb(sql: str) -> str:
    # Times as integers: fetching a TIMESTAMPTZ into Python needs pytz, which not every venv has.
    return sql.format(micros="epoch_us", text="VARCHAR")


def for_spark(sql: str) -> str:
    return sql.format(micros="unix_micros", text="STRING")


# Views compared across engines, without the columns that hold ids (the DuckDB file numbers them).
VIEWS = {
    "call_sites": CALL_SITES,
    "kernel_launch_sites": "SELECT * FROM kernel_launch_sites",
    "stack_tracebacks": "SELECT stack_key, frames, traceback FROM stack_tracebacks",
    "events": "SELECT run_id, {micros}(ts), thread_id, kind, name, CAST(attrs AS {text}), correlation_id FROM events",
    "stack_frames": "SELECT depth, slot, chain_depth, kind, function, file, line, module, module_key, address, exact, "
    "inlined, reason, first_line FROM stack_frames",
    "python_files": "SELECT * FROM python_files",
}


# ------------------------------------------------------------------------------------------ the acceptance checks


def test_spark_call_sites_equal_duckdb_ingest(db, spark_lake, spark) -> None:
    from tbpipe.pipeline.lake.sparksql import register_lake

    expected = sorted_rows(duckdb_rows(db[0], CALL_SITES))
    assert len(expected) > 20 and len({r[0] for r in expected}) == 6  # six runs landed
    assert sorted_rows(lake_rows(spark_lake[0], CALL_SITES)) == expected  # DuckDB over the lake
    register_lake(spark, spark_lake[0])
    assert spark_rows(spark, CALL_SITES) == expected  # Spark SQL over the lake


@pytest.mark.default_interpreter_only
def test_views_equal_on_both_engines(db, spark_lake, spark) -> None:
    from tbpipe.pipeline.lake.sparksql import register_lake

    register_lake(spark, spark_lake[0])
    for name, sql in VIEWS.items():
        in_file = sorted_rows(duckdb_rows(db[0], for_duckdb(sql)))
        assert in_file, name
        assert sorted_rows(lake_rows(spark_lake[0], for_duckdb(sql))) == in_file, name
        assert spark_rows(spark, for_spark(sql)) == in_file, name


def test_lake_ids_are_content_ids(spark_lake) -> None:
    lake = spark_lake[0]
    runs = lake_rows(lake, "SELECT run_id, run_number FROM runs")
    assert all(number == ids.run_number(run_id) for run_id, number in runs)
    stacks = lake_rows(lake, "SELECT stack_id, stack_hash FROM stacks")
    assert all(int(ids.signed([h])[0]) == s for s, h in stacks)
    sites = lake_rows(lake, "SELECT site_id, site_key FROM sites")
    assert all(int(ids.site_ids([k])[0].as_py()) == i for i, k in sites)
    # Events are numbered from 1 within their run, without gaps.
    numbered = lake_rows(lake, "SELECT run_number, min(event_id), max(event_id), count(*) FROM event_rows GROUP BY ALL")
    assert numbered and all(lo == 1 and hi == count for _run, lo, hi, count in numbered)


def test_sharded_symbolization_equals_serial(db, spark_lake) -> None:
    columns = "module_key, address, exact, depth, function, file, line, inlined, reason"
    serial = sorted_rows(duckdb_rows(db[0], f"SELECT {columns} FROM symbols"))
    sharded = sorted_rows(lake_rows(spark_lake[0], f"SELECT {columns} FROM symbols"))
    assert sharded == serial
    # The shard size really split a module: some module has more addresses than one shard takes.
    per_module = lake_rows(spark_lake[0], "SELECT count(*) FROM symbols WHERE depth = 0 GROUP BY module_key")
    assert max(n for (n,) in per_module) > 2 * SHARD_ADDRESSES
    modules = "module_key, build_id, path, quality, reason, debug_file, found_via"
    assert sorted_rows(lake_rows(spark_lake[0], f"SELECT {modules} FROM modules")) == sorted_rows(
        duckdb_rows(db[0], f"SELECT {modules} FROM modules")
    )


@pytest.fixture(scope="module")
def mixed(nights, generated, workload, symbol_cache, spark, tmp_path_factory) -> dict:  # noqa: F811
    """Three runs that each take a path of their own through the ingest, in one folder: a run whose
    manifest names a folder of generated code (with code_origins), a run with GPU activity, and a
    night's run whose capture was killed (incomplete). Ingested once by Spark (this process's
    session) into a lake and once by DuckDB into a database, to compare."""
    from tbpipe.pipeline.db.ingest import IngestOptions, ingest_runs
    from tbpipe.pipeline.lake.spark_ingest import SparkIngestOptions, ingest_runs_spark

    base = tmp_path_factory.mktemp("lake-mixed")
    runs = base / "runs"
    (generated_run,) = [p for p in (generated["base"] / "runs").iterdir() if p.is_dir()]
    gpu_run = Path(workload[1].path)
    night_run = sorted(p for p in (nights / "runs").iterdir() if p.name != "damaged")[0]
    for source in (generated_run, gpu_run, night_run):
        shutil.copytree(source, runs / source.name)
    killed = runs / night_run.name
    manifest = json.loads((killed / "manifest.json").read_text())
    manifest["complete"], manifest["ended_at"] = False, None
    (killed / "manifest.json").write_text(json.dumps(manifest))
    db = base / "mixed.duckdb"
    duckdb_summary = ingest_runs([runs], IngestOptions(db_path=db, cache_dir=symbol_cache, progress=False))
    assert duckdb_summary.ok, [o.reason for o in duckdb_summary.outcomes]
    lake = base / "lake"
    options = SparkIngestOptions(lake=lake, cache_dir=symbol_cache)
    summary = ingest_runs_spark([runs], options, spark=spark)
    assert summary.ingested == 3 and summary.incomplete == 1, [o.reason for o in summary.outcomes]
    return {
        "runs": runs,
        "db": db,
        "lake": lake,
        "summary": summary,
        "killed": manifest["run_id"],
        "gpu": workload[1].manifest["run_id"],
    }


@pytest.mark.default_interpreter_only
def test_mixed_runs_read_alike_on_both_engines(mixed, spark) -> None:
    from tbpipe.pipeline.lake.sparksql import register_lake

    register_lake(spark, mixed["lake"])
    for name in ("call_sites", "stack_tracebacks", "python_files", "events"):
        expected = sorted_rows(duckdb_rows(mixed["db"], for_duckdb(VIEWS[name])))
        assert expected, name
        assert sorted_rows(lake_rows(mixed["lake"], for_duckdb(VIEWS[name]))) == expected, name
        assert spark_rows(spark, for_spark(VIEWS[name])) == expected, name


@pytest.mark.default_interpreter_only
def test_generated_code_sited_alike_on_both_engines(mixed, generated) -> None:  # noqa: F811
    """The run whose manifest names a folder of generated code and whose code_origins map its lines to
    a user line: the lake keeps the folder, places the origins and sites nothing in generated code,
    as the DuckDB ingest does (the views compared in `test_mixed_runs_read_alike_on_both_engines`)."""
    lake = mixed["lake"]
    folder = str(generated["cache"]) + "/"
    folders = "SELECT prefix, generator FROM generated_code"
    # (Other runs of the lake may name inductor's default folder: the mixed runs' own.)
    assert (folder, "inductor") in lake_rows(lake, folders)
    assert sorted(lake_rows(lake, folders)) == sorted(duckdb_rows(mixed["db"], folders))
    sited_files = {row[0] for row in lake_rows(lake, "SELECT site_file FROM call_sites WHERE site_file IS NOT NULL")}
    assert sited_files and not any(f.startswith(folder) for f in sited_files)
    tracebacks = "\n".join(row[0] for row in lake_rows(lake, "SELECT traceback FROM stack_tracebacks"))
    assert "[generated]" in tracebacks


GPU_VIEWS = {
    "event_gpu_time": "SELECT run_id, kind, name, activities, gpu_time_ns, {micros}(gpu_start), {micros}(gpu_end) "
    "FROM event_gpu_time",
    # Without the files and lines of sites (the database's arg_max picks one among equal times).
    "gpu_time_sites": "SELECT run_id, kind, name, launch_kind, site_function, site_key, site_portable_file, "
    "site_is_user, capture_site_key, capture_site_function, executions, timed, gpu_time_ns, avg_ns, min_ns, max_ns, "
    "bytes FROM gpu_time_sites",
    "memcpy_sites": "SELECT * FROM memcpy_sites",
    "memset_sites": "SELECT * FROM memset_sites",
}


@pytest.mark.default_interpreter_only
def test_gpu_time_carried_by_export_and_noted_by_the_spark_ingest(workload, mixed, spark, tmp_path) -> None:  # noqa: F811
    """GPU activity: `tbpipe lake export` carries it (the GPU-time views answer over the lake as over
    the database, from DuckDB and from Spark SQL); the Spark ingest loads the run without it and says so."""
    from tbpipe.pipeline.lake.export import export_database
    from tbpipe.pipeline.lake.sparksql import register_lake

    _result, run, con = workload
    db = Path(run.path).parent.parent / "gpu.duckdb"
    lake = tmp_path / "exported"
    export_database(db, lake)
    register_lake(spark, lake)
    for name, sql in GPU_VIEWS.items():
        expected = sorted_rows(con.execute(for_duckdb(sql)).fetchall())
        assert expected, name
        assert sorted_rows(lake_rows(lake, for_duckdb(sql))) == expected, name
        assert spark_rows(spark, for_spark(sql)) == expected, name

    (outcome,) = [o for o in mixed["summary"].outcomes if o.run_id == mixed["gpu"]]
    assert outcome.status == "ingested" and any("GPU activity" in note for note in outcome.notes), outcome
    gpu_sites = f"SELECT * FROM call_sites WHERE run_id = '{mixed['gpu']}'"
    assert sorted_rows(lake_rows(mixed["lake"], gpu_sites)) == sorted_rows(con.execute(gpu_sites).fetchall())
    assert lake_rows(mixed["lake"], "SELECT count(*) FROM gpu_time_sites") == [(0,)]


def test_run_events_written_as_the_database_holds_them(db, nights, tmp_path) -> None:
    """The job's per-run events step alone (`steps.write_run_events`, no Spark) on a run whose events
    part is split in two: the DuckDB ingest's events of that run, numbered on across the parts, and
    its counts per name and stack, in the lake's types."""
    source = sorted(p for p in (nights / "runs").iterdir() if p.name != "damaged")[0]
    run_dir = tmp_path / "runs" / source.name
    shutil.copytree(source, run_dir)
    part = sorted(run_dir.glob("events-*.parquet"))[0]
    table = pq.read_table(part)
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), part, compression="zstd")
    pq.write_table(table.slice(half), part.with_name(part.stem + "b.parquet"), compression="zstd")
    prepared = steps.prepare_run(run_dir, {})
    run = prepared.run
    assert run["status"] == "ingested" and half in run["event_rows"], run
    written = steps.write_run_events(run, prepared.stacks, prepared.names, tmp_path / "rows", tmp_path / "counts")

    names = {i: (k, n) for i, k, n in zip(*(prepared.names[c].to_pylist() for c in ("name_id", "kind", "name")))}
    partition = f"{store.PARTITION}={run['run_number']}"
    (rows_file,) = store.data_files(tmp_path / "rows" / partition)
    (counts_file,) = store.data_files(tmp_path / "counts" / partition)
    assert pq.read_schema(rows_file).names == TABLES["event_rows"].file_schema.names
    rows = pq.read_table(rows_file).to_pylist()
    got = sorted(
        (r["event_id"], int(r["ts"].timestamp() * 1e6), r["thread_id"], *names[r["name_id"]],
         _unsigned(r["stack_id"]), r["attrs"])
        for r in rows
    )  # fmt: skip
    expected = duckdb_rows(
        db[0],
        f"""
        SELECT e.event_id - min(e.event_id) OVER () + 1, epoch_us(e.ts), e.thread_id, e.kind, e.name, s.stack_hash,
               CAST(e.attrs AS VARCHAR)
        FROM events e LEFT JOIN stacks s USING (stack_id)
        WHERE e.run_id = '{run["run_id"]}'
        ORDER BY 1
        """,
    )
    assert len(expected) == table.num_rows and got == expected
    counts = sorted(
        ((*names[r["name_id"]], _unsigned(r["stack_id"]), r["events"]) for r in pq.read_table(counts_file).to_pylist()),
        key=repr,
    )
    assert counts == sorted(
        duckdb_rows(
            db[0],
            f"""
            SELECT e.kind, e.name, s.stack_hash, count(*)
            FROM events e LEFT JOIN stacks s USING (stack_id)
            WHERE e.run_id = '{run["run_id"]}'
            GROUP BY ALL
            """,
        ),
        key=repr,
    )
    stacked = [c for c in counts if c[2] is not None]
    assert written == {
        "run_number": run["run_number"],
        "events": table.num_rows,
        "stacks_used": len({c[2] for c in stacked}),
        "null_stack": sum(c[3] for c in counts if c[2] is None),
    }


def _unsigned(value: int | None) -> int | None:
    return None if value is None else value & 0xFFFF_FFFF_FFFF_FFFF


def test_attributes_not_json_counted_per_event(tmp_path) -> None:
    """Prepare's check: each part's distinct texts are checked once, its events counted by the texts
    they use (what DuckDB's JSON type would refuse: not objects alone); a part without attributes has none."""
    texts = ['{"grid": [1, 1, 1]}', "{not json", None, "{not json", "[1, 2]", '"text"', '{"b": [1,}', ""]
    first, second, bare = tmp_path / "events-1.parquet", tmp_path / "events-2.parquet", tmp_path / "events-3.parquet"
    pq.write_table(pa.table({"attrs": pa.array(texts * 3, pa.string())}), first)
    pq.write_table(pa.table({"attrs": pa.array(texts[:2], pa.string())}), second, use_dictionary=False)
    pq.write_table(pa.table({"ts": pa.array([1, 2], pa.int64())}), bare)
    assert steps.attributes_not_json([first]) == 3 * 4
    assert steps.attributes_not_json([first, second, bare]) == 3 * 4 + 1


def _quarantined(output: str) -> list[str]:
    return sorted(line for line in output.splitlines() if line.startswith("quarantined "))


def test_damaged_run_quarantined_others_land(db, spark_lake, nights) -> None:
    duckdb_out, spark_out = db[1], spark_lake[1]
    quarantined, by_spark = _quarantined(duckdb_out), _quarantined(spark_out)
    assert len(quarantined) == 2 == len(by_spark)
    # A damaged part: the same reason, word for word.
    assert "-dmg" in quarantined[0] and "unreadable Parquet" in quarantined[0]
    assert by_spark[0] == quarantined[0]
    # Attributes that are not JSON: the same reason up to the engine's own detail in brackets.
    reason = "-json: events have attributes that are not JSON ("
    assert reason in quarantined[1] and reason in by_spark[1]
    assert quarantined[1].split(" (")[0] == by_spark[1].split(" (")[0]
    assert re.search(r"runs ingested\s*│\s*6\s*│", spark_out), spark_out
    landed = {r[0] for r in lake_rows(spark_lake[0], "SELECT run_id FROM runs")}
    assert landed == {r[0] for r in duckdb_rows(db[0], "SELECT run_id FROM runs")} and len(landed) == 6


def _files(lake: Path) -> dict[str, int]:
    return {
        str(p.relative_to(lake)): p.stat().st_size
        for p in lake.rglob("*")
        if p.is_file() and not p.name.endswith(".crc") and p.name != "_SUCCESS"
    }


def test_cli_rerun_adds_nothing(spark_lake, nights, symbol_cache, spark_cluster) -> None:
    """`tbpipe ingest --engine spark` on the cluster again, over runs the lake already holds (relative
    paths, the executors in the driver's environment this time): every run present, the damaged
    ones quarantined again, not a file of the lake touched."""
    lake = spark_lake[0]
    before = _files(lake)
    counts = {t: lake_rows(lake, f"SELECT count(*) FROM {t}")[0][0] for t in ("runs", "event_rows", "frames", "stacks")}
    result = tbpipe(
        "ingest", "runs", "--engine", "spark", "--lake", "lake", "--cache-dir", str(symbol_cache),
        *on_cluster(spark_cluster), cwd=nights, env=DRIVER_ENV,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # 1: runs were quarantined
    assert re.search(r"already present\s*│\s*6\s*│", result.stdout), result.stdout
    assert re.search(r"runs ingested\s*│\s*0\s*│", result.stdout), result.stdout
    assert _quarantined(result.stdout) == _quarantined(spark_lake[1])
    assert _files(lake) == before
    assert {t: lake_rows(lake, f"SELECT count(*) FROM {t}")[0][0] for t in counts} == counts


def _executor_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("executors ")]


def test_cluster_executors_ran_the_packaged_environment(spark_lake, spark_cluster, symbol_cache) -> None:
    """The nights' lake came from executors that unpacked the archive in their own folder and ran its
    Python and its tbpipe, symbolizing into the store the setting named, not their default one."""
    (line,) = _executor_lines(spark_lake[1])
    assert f"tbpipe {__version__}" in line and str(spark_cluster.work_dir) in line and "tbpipe-env" in line, line
    assert not (spark_cluster.worker_cwd / ".cache" / "tbpipe").exists()
    assert any(symbol_cache.rglob("*")), "the executors' symbol store is empty"


def test_cluster_refuses_runs_its_executors_cannot_read(spark_cluster, nights, tmp_path) -> None:
    """Runs on the driver's own disk (a folder the worker sees empty): the job stops before writing
    anything, naming the run folder and the executor's host; nothing is quarantined."""
    if spark_cluster.hidden is None:
        pytest.fail(f"the cluster's worker has no folder of its own to test with: {spark_cluster.hidden_missing}")
    source = sorted(p for p in (nights / "runs").iterdir() if p.name != "damaged")[0]
    hidden = spark_cluster.hidden / tmp_path.name / source.name
    shutil.copytree(source, hidden)
    lake = tmp_path / "lake"
    result = tbpipe("ingest", str(hidden.parent), "--engine", "spark", "--lake", str(lake),
                    *on_cluster(spark_cluster), env=DRIVER_ENV)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert f"{hidden} (on " in message and "cannot be read by the executors" in message, message
    assert "quarantined" not in result.stdout
    assert not store.data_files(store.table_dir(lake, "runs"))


def test_cluster_refuses_executors_with_another_tbpipe(spark_cluster, executor_archive, nights, tmp_path) -> None:
    """Executors whose Python finds another tbpipe first (a package of another version ahead of the
    archive's on their PYTHONPATH): the job stops at its start with both versions and where the
    executors' came from."""
    other = tmp_path / "other"
    (other / "tbpipe" / "capture").mkdir(parents=True)
    (other / "tbpipe" / "__init__.py").write_text("")
    (other / "tbpipe" / "capture" / "__init__.py").write_text('__version__ = "0.0.1+elsewhere"\n')
    lake = tmp_path / "lake"
    result = tbpipe(
        "ingest", str(nights / "runs"), "--engine", "spark", "--lake", str(lake),
        *on_cluster(spark_cluster, archive=executor_archive, **{"spark.executorEnv.PYTHONPATH": str(other)}),
        env=DRIVER_ENV,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "imports tbpipe 0.0.1+elsewhere from" in message and str(other) in message, message
    assert f"this driver runs tbpipe {__version__}" in message and "tbpipe lake package" in message
    assert not store.data_files(store.table_dir(lake, "runs"))


@pytest.fixture(scope="module")
def exported(db, nights) -> Path:
    lake = nights / "exported"
    result = tbpipe("lake", "export", "--db", str(db[0]), "--lake", str(lake))
    assert result.returncode == 0, result.stderr
    assert "6 runs" in result.stdout
    return lake


def test_export_equals_duckdb(db, exported) -> None:
    for name, sql in VIEWS.items():
        sql = for_duckdb(sql)
        assert sorted_rows(lake_rows(exported, sql)) == sorted_rows(duckdb_rows(db[0], sql)), name


def test_export_equals_spark_lake(db, exported, spark_lake, spark) -> None:
    from tbpipe.pipeline.lake.sparksql import register_lake

    # Content ids: the exported lake names everything as the Spark-built one does.
    for table, key in (
        ("stacks", "stack_id"),
        ("frames", "frame_id"),
        ("sites", "site_id"),
        ("event_names", "name_id"),
    ):
        query = f"SELECT {key} FROM {table}"
        assert sorted_rows(lake_rows(exported, query)) == sorted_rows(lake_rows(spark_lake[0], query)), table
    register_lake(spark, exported)
    assert spark_rows(spark, CALL_SITES) == sorted_rows(duckdb_rows(db[0], CALL_SITES))


@pytest.mark.default_interpreter_only
def test_query_and_report_read_the_lake(db, spark_lake) -> None:
    sql = "SELECT kind, name, site_key, sum(events) AS n FROM call_sites GROUP BY ALL ORDER BY ALL"
    from_db = tbpipe("query", "--db", str(db[0]), "--format", "json", sql)
    from_lake = tbpipe("query", "--lake", str(spark_lake[0]), "--format", "json", sql)
    assert from_db.returncode == 0 and from_lake.returncode == 0, from_lake.stderr
    assert json.loads(from_lake.stdout) == json.loads(from_db.stdout) and json.loads(from_db.stdout)
    args = ["report", "--format", "json", "--candidate", "commit=c3", "--baseline", "commit=c2"]
    report_db = tbpipe(*args, "--db", str(db[0]))
    report_lake = tbpipe(*args, "--lake", str(spark_lake[0]))
    assert report_db.returncode == 0 and report_lake.returncode == 0, report_lake.stderr
    db_json, lake_json = json.loads(report_db.stdout), json.loads(report_lake.stdout)
    assert lake_json["sites"] == db_json["sites"] and any(s["change"] == "new" for s in db_json["sites"])
    missing = tbpipe("query", "--lake", str(spark_lake[0].parent / "no-lake"), "SELECT 1")
    assert missing.returncode == 2 and "not a tbpipe lake" in missing.stderr


def test_spark_sql_translation_is_spark_sql() -> None:
    """Every packaged view translates, and no DuckDB-only spelling is left in the Spark text."""
    from tbpipe.pipeline.lake.sparksql import duckdb_only_views, spark_views

    views = dict(spark_views())
    assert {"call_sites", "kernel_launch_sites", "stack_tracebacks", "events", "stack_frames"} <= set(views)
    text = "\n".join(views.values())
    for duckdb_only in ("ARG_MAX", "STRING_AGG", "REGEXP_MATCHES", "STARTS_WITH(", "frame_text(", "::"):
        assert duckdb_only not in text, duckdb_only
    assert "REGEXP_EXTRACT((module), '[^/]*$', 0)" in views["stack_tracebacks"]
    # The backward-op views need an ASOF join, which Spark SQL lacks: left out with why, with the views
    # that read them; DuckDB over the lake has them all.
    skipped = duckdb_only_views()
    assert skipped["backward_events"].startswith("an ASOF join")
    assert {"backward_call_sites", "site_counts_at_forward"} <= set(skipped) and not set(skipped) & set(views)


@pytest.mark.default_interpreter_only
def test_compaction_keeps_the_rows(spark_lake, spark, tmp_path) -> None:
    from tbpipe.pipeline.lake.spark_ingest import SparkIngestOptions, _Job

    lake = tmp_path / "lake"
    shutil.copytree(spark_lake[0], lake)
    rows = {t: sorted_rows(lake_rows(lake, f"SELECT * FROM {t}")) for t in ("frames", "stack_frame_rows")}
    for table in rows:
        # Each table as three files, as three appends leave it.
        files = store.data_files(store.table_dir(lake, table))
        whole = pa.concat_tables([pq.read_table(p) for p in files])
        for path in files:
            path.unlink()
        third = -(-whole.num_rows // 3)
        for i in range(3):
            pq.write_table(whole.slice(i * third, third), store.table_dir(lake, table) / f"part-test-{i}.parquet")
        assert len(store.data_files(store.table_dir(lake, table))) == 3
    job = _Job(spark, SparkIngestOptions(lake=lake, compact_files=1), rules=[])
    try:
        for table in rows:
            job.compact(table)
    finally:
        shutil.rmtree(job.staging, ignore_errors=True)
    for table, expected in rows.items():
        assert len(store.data_files(store.table_dir(lake, table))) == 1, table
        assert sorted_rows(lake_rows(lake, f"SELECT * FROM {table}")) == expected, table


@pytest.mark.default_interpreter_only
def test_grown_incomplete_run_replaces_its_partition(mixed, symbol_cache, spark, tmp_path) -> None:
    """An incomplete run whose files grew is loaded again: its partition replaced, never added to,
    and the other runs of the lake left as they were."""
    from tbpipe.pipeline.lake.spark_ingest import SparkIngestOptions, ingest_runs_spark

    killed = mixed["killed"]
    (first,) = [o for o in mixed["summary"].outcomes if o.run_id == killed]
    assert first.status == "ingested" and not first.complete
    runs, lake = tmp_path / "runs", tmp_path / "lake"
    shutil.copytree(mixed["runs"], runs)
    shutil.copytree(mixed["lake"], lake)
    run = runs / first.path.name
    of_run = f"WHERE run_id = '{killed}'"
    events = lake_rows(lake, f"SELECT count(*) FROM events {of_run}")[0][0]
    assert events > 0
    others = lake_rows(
        lake, f"SELECT run_id, count(*) FROM events WHERE run_id <> '{killed}' GROUP BY ALL ORDER BY ALL"
    )

    # The process flushed once more before it died: a second events part, equal to the first.
    part = sorted(run.glob("events-*.parquet"))[0]
    shutil.copy(part, run / "events-999999.parquet")
    again = ingest_runs_spark([runs], SparkIngestOptions(lake=lake, cache_dir=symbol_cache), spark=spark)
    assert sorted((o.run_id == killed, o.status) for o in again.outcomes) == [
        (False, "present"),
        (False, "present"),
        (True, "updated"),
    ]
    number = ids.run_number(killed)
    assert lake_rows(
        lake, f"SELECT count(*), count(DISTINCT event_id), max(event_id) FROM event_rows WHERE run_number = {number}"
    )[0] == (2 * events, 2 * events, 2 * events)
    assert lake_rows(lake, f"SELECT count(*), sum(events) FROM runs {of_run}")[0] == (1, 2 * events)
    assert lake_rows(lake, f"SELECT sum(events) FROM call_sites {of_run}")[0][0] == 2 * events
    assert (
        lake_rows(lake, f"SELECT run_id, count(*) FROM events WHERE run_id <> '{killed}' GROUP BY ALL ORDER BY ALL")
        == others
    )
    # Replaced, not added to: the partition's files all come from this load's write (one job id in
    # their names), at most one per events part of the run.
    files = store.data_files(store.partition_dir(lake, "event_rows", number))
    assert 1 <= len(files) <= 2 and len({path.name.split("-", 2)[2] for path in files}) == 1, files
