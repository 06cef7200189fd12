"""`tbpipe query` and `tbpipe runs` on a real database, the schema's documentation and versioning."""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import typer
from conftest import TBPIPE
from typer.testing import CliRunner

from tbpipe import capture
from tbpipe.pipeline.commands import compact as compact_command
from tbpipe.pipeline.commands import ingest as ingest_command
from tbpipe.pipeline.commands import query as query_command
from tbpipe.pipeline.commands import runs as runs_command
from tbpipe.pipeline.commands import show as show_command
from tbpipe.pipeline.db import DatabaseBusyError, DatabaseError, IngestOptions, ingest_runs, open_database, schema
from tbpipe.pipeline.db.compact import compact_database
from tbpipe.pipeline.db.connection import ingest_lock, query_rows
from tbpipe.pipeline.errors import TbpipeError


def cli(*args: str, env: dict | None = None):
    """Runs tbpipe subcommands in-process; TbpipeErrors come back as result.exception."""
    app = typer.Typer()
    for command in (ingest_command, query_command, runs_command, show_command, compact_command):
        command.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250", **(env or {})})


def emit(count: int) -> None:
    for _ in range(count):
        capture.record("kernel_launch", "gemm", grid=[4, 1, 1])


@pytest.fixture(scope="module")
def db(tmp_path_factory, symbol_cache) -> Path:
    root = tmp_path_factory.mktemp("query")
    for labels, count in (({"suite": "bert", "commit": "abc"}, 3), ({"suite": "gpt"}, 2)):
        with capture.session(root / "runs", labels=labels):
            emit(count)
    path = root / "tbpipe.duckdb"
    summary = ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False))
    assert summary.ingested == 2
    return path


SITES = "SELECT name, site_function, events FROM call_sites ORDER BY events DESC"


def test_query_csv(db) -> None:
    result = cli("query", "--db", str(db), "--format", "csv", SITES)
    assert result.exit_code == 0, result.output
    parsed = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["name"], r["site_function"], r["events"]) for r in parsed] == [
        ("gemm", "emit", "3"),
        ("gemm", "emit", "2"),
    ]


def test_query_json_keeps_nested_values(db) -> None:
    result = cli("query", "--db", str(db), "-f", "json", "SELECT labels, argv FROM runs ORDER BY run_id")
    assert result.exit_code == 0, result.output
    parsed = json.loads(result.stdout)
    assert {tuple(sorted(r["labels"].items())) if isinstance(r["labels"], dict) else None for r in parsed} == {
        (("commit", "abc"), ("suite", "bert")),
        (("suite", "gpt"),),
    }


def test_query_csv_turns_nested_values_into_json(db) -> None:
    result = cli("query", "--db", str(db), "-f", "csv", "SELECT labels FROM runs WHERE labels['suite'] = 'gpt'")
    assert result.exit_code == 0, result.output
    (row,) = list(csv.DictReader(io.StringIO(result.stdout)))
    assert "gpt" in row["labels"]


def test_query_parquet_to_file(db, tmp_path) -> None:
    out = tmp_path / "sites.parquet"
    result = cli("query", "--db", str(db), "-f", "parquet", "-o", str(out), SITES)
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).to_pylist() == [
        {"name": "gemm", "site_function": "emit", "events": 3},
        {"name": "gemm", "site_function": "emit", "events": 2},
    ]


def test_query_table_and_stdin(db) -> None:
    result = cli("query", "--db", str(db), "-")
    assert isinstance(result.exception, TbpipeError)  # no SQL on stdin
    app = typer.Typer()
    query_command.register(app)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["query", "--db", str(db), "-"], input=SITES, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "site_function" in result.stdout and "emit" in result.stdout


def test_query_is_read_only(db) -> None:
    result = cli("query", "--db", str(db), "DELETE FROM runs")
    assert isinstance(result.exception, query_command.QueryError)
    assert "read-only" in str(result.exception)
    assert query_rows(open_database(db, read_only=True), "SELECT count(*) FROM runs") == [(2,)]


def test_query_errors_are_one_clear_line(db, tmp_path) -> None:
    result = cli("query", "--db", str(db), "SELEC nonsense")
    assert isinstance(result.exception, query_command.QueryError)
    assert str(result.exception).startswith("query failed: Parser Error")
    result = cli("query", "--db", str(tmp_path / "none.duckdb"), "SELECT 1")
    assert isinstance(result.exception, DatabaseError) and "no database at" in str(result.exception)
    # The real command line: exit status 2 and one line on stderr, no traceback.
    process = subprocess.run(
        [*TBPIPE, "query", "--db", str(db), "SELECT * FROM nowhere"], capture_output=True, text=True, timeout=60
    )
    assert process.returncode == 2
    assert process.stderr.startswith("tbpipe: query failed: Catalog Error") and "Traceback" not in process.stderr


def test_default_database_from_environment(db) -> None:
    result = cli("query", "-f", "csv", "SELECT count(*) AS runs FROM runs", env={"TBPIPE_DB": str(db)})
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ['"runs"', "2"]


def test_runs_lists_labels_and_filters(db) -> None:
    result = cli("runs", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "2 runs" in result.stdout
    assert "commit=abc, suite=bert" in result.stdout and "suite=gpt" in result.stdout
    result = cli("runs", "--db", str(db), "--label", "suite=gpt")
    assert result.exit_code == 0, result.output
    assert "1 run" in result.stdout and "suite=bert" not in result.stdout


# ------------------------------------------------------------------------------ the schema itself


def test_every_table_view_and_macro_is_documented(db) -> None:
    con = open_database(db, read_only=True)
    undocumented = query_rows(
        con,
        """
        SELECT c.table_name || '.' || c.column_name FROM duckdb_columns() c
        WHERE NOT c.internal AND c.database_name = current_database() AND c.schema_name = 'main'
          AND (c.comment IS NULL OR c.comment = '')
        """,
    )
    assert undocumented == []
    tables = query_rows(
        con,
        """
        SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() AND (comment IS NULL OR comment = '')
        UNION ALL
        SELECT view_name FROM duckdb_views() WHERE NOT internal AND database_name = current_database() AND (comment IS NULL OR comment = '')
        """,
    )
    assert tables == []
    macros = {
        name
        for (name,) in query_rows(
            con,
            "SELECT function_name FROM duckdb_functions() WHERE function_type IN ('macro', 'table_macro') AND database_name = current_database() AND (comment IS NULL OR comment = '')",
        )
    }
    assert macros == set()
    public = {
        name
        for (name,) in query_rows(
            con, "SELECT view_name FROM duckdb_views() WHERE NOT internal AND database_name = current_database()"
        )
    }
    assert {
        "call_sites",
        "kernel_launch_sites",
        "python_files",
        "stack_tracebacks",
        "symbol_coverage",
        "unsymbolized_frames",
    } <= public


def test_sql_files_document_every_column_they_create() -> None:
    for module in [*schema.migrations(), *schema.modules()]:
        for statement in module.statements:
            created = statement.created
            if created is None:
                continue
            assert created.doc, f"{module.name}: {created.name} has no description"


def test_event_attributes_load_in_either_storage_format(tmp_path) -> None:
    new, old = tmp_path / "new.duckdb", tmp_path / "old.duckdb"
    # A file in DuckDB 1.0's storage format (what older tbpipe installs wrote) has no zstd for strings:
    # schema 8's migration leaves the column's compression to DuckDB there, and the file still opens
    # and takes every later migration.
    duckdb.connect(str(old), config={"storage_compatibility_version": "v1.0.0"}).close()
    for path in (new, old):
        con = open_database(path)
        try:
            con.execute(
                "INSERT INTO runs (run_number, run_id, complete, events, stacks, new_stacks, source_dir, parts, "
                "ingested_at, manifest) VALUES (1, 'r', true, 5000, 0, 0, '.', '', now(), '{}')"
            )
            con.execute("INSERT INTO event_names VALUES (1, 'kernel_launch', 'k')")
            con.execute(
                "INSERT INTO event_rows SELECT range, 1, now(), 0, 1, NULL, '{\"stream\": 7}', range + 1 FROM range(5000)"
            )
            con.execute("CHECKPOINT")
            assert con.execute("SELECT count(*) FROM event_rows WHERE attrs->>'stream' = '7'").fetchall() == [(5000,)]
            # The events view gives the attributes as recorded: the correlation id first.
            assert con.execute("SELECT attrs FROM events WHERE event_id = 41").fetchall() == [
                ('{"correlation_id":42,"stream": 7}',)
            ]
        finally:
            con.close()


def test_event_attrs_puts_the_correlation_id_back_into_any_object(tmp_path) -> None:
    con = open_database(tmp_path / "macro.duckdb")
    try:
        cases = [
            ('{"x": 1}', 5, {"correlation_id": 5, "x": 1}),
            ("{}", 6, {"correlation_id": 6}),
            (None, 7, {"correlation_id": 7}),
            ('{"y": 2}', None, {"y": 2}),
            (' { "z" : 3, "n": null }', 8, {"correlation_id": 8, "z": 3, "n": None}),  # spaced: minified
            (" { }", 9, {"correlation_id": 9}),
            ("[1, 2]", 10, [1, 2]),  # no object: as stored
        ]
        for attrs, correlation_id, expected in cases:
            ((text,),) = con.execute(
                "SELECT event_attrs(CAST(? AS JSON), CAST(? AS UINTEGER))", [attrs, correlation_id]
            ).fetchall()
            assert json.loads(text) == expected, (attrs, text)
            if correlation_id is not None and isinstance(expected, dict):
                assert text.startswith('{"correlation_id":'), text  # first, as the Spark ingest writes it
    finally:
        con.close()


def _everything(path: Path) -> dict:
    """What a database holds, as far as a user can see: every table's rows, the catalog, the views' answers."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall()]
        return {
            "rows": {t: con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall() for t in tables},
            "catalog": con.execute(
                "SELECT table_name, column_name, data_type, comment FROM duckdb_columns() ORDER BY ALL"
            ).fetchall(),
            "tables": con.execute("SELECT table_name, sql, comment FROM duckdb_tables() ORDER BY ALL").fetchall(),
            "views": con.execute(
                "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal ORDER BY ALL"
            ).fetchall(),
            "macros": con.execute(
                "SELECT function_name, comment FROM duckdb_functions() WHERE function_type IN ('macro', 'table_macro') "
                "AND NOT internal ORDER BY ALL"
            ).fetchall(),
            "indexes": con.execute("SELECT index_name, sql FROM duckdb_indexes() ORDER BY ALL").fetchall(),
            "sites": con.execute(SITES).fetchall(),
            "tracebacks": con.execute("SELECT * FROM stack_tracebacks ORDER BY ALL").fetchall(),
        }
    finally:
        con.close()


def _blocks(path: Path) -> tuple[int, int]:
    """(total, free) blocks of the file. Some DuckDB versions also punch free blocks out of the file, so
    its size on disk alone does not show them."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute("SELECT total_blocks, free_blocks FROM pragma_database_size()").fetchone()
    finally:
        con.close()


def test_compact_gives_back_free_blocks_and_keeps_everything(db, tmp_path) -> None:
    path = tmp_path / "copy.duckdb"
    shutil.copy(db, path)
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE scratch AS SELECT range AS n, md5(range::VARCHAR) AS text FROM range(300000)")
    con.execute("CHECKPOINT")
    con.execute("DROP TABLE scratch")  # its blocks are free now, and the file as large as before
    con.close()
    total, free = _blocks(path)
    assert free >= 10
    before, size = _everything(path), path.stat().st_size

    result = cli("compact", "--db", str(path))
    assert result.exit_code == 0, result.output
    assert f"compacted {path}" in result.stdout and "MB given back" in result.stdout
    total_after, free_after = _blocks(path)
    assert total_after <= total - free // 2 and free_after <= 2 and path.stat().st_size <= size
    assert _everything(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.duckdb", "copy.duckdb.lock"]  # nothing left over
    assert cli("query", "--db", str(path), SITES).exit_code == 0  # and it opens as a tbpipe database


def test_compact_keeps_the_file_s_permissions_and_replaces_what_a_link_names(db, tmp_path) -> None:
    real = tmp_path / "data" / "real.duckdb"
    real.parent.mkdir()
    shutil.copy(db, real)
    real.chmod(0o640)
    link = tmp_path / "tbpipe.duckdb"
    link.symlink_to(real)
    before = _everything(real)
    compact_database(link)
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link still names the database
    assert real.stat().st_mode & 0o777 == 0o640
    assert _everything(link) == before
    assert sorted(p.name for p in real.parent.iterdir()) == ["real.duckdb"]  # no copy left beside it


def test_compact_waits_for_the_ingest_lock_and_changes_nothing_without_it(db, tmp_path) -> None:
    path = tmp_path / "held.duckdb"
    shutil.copy(db, path)
    content = path.read_bytes()
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as an ingest or a service holds it
        with pytest.raises(DatabaseBusyError, match="another ingest"):
            compact_database(path, wait_s=0.2)
    assert path.read_bytes() == content
    with pytest.raises(DatabaseError, match="no database at"):
        compact_database(tmp_path / "missing.duckdb")


def test_migrations_are_recorded_and_versions_checked(tmp_path) -> None:
    path = tmp_path / "v.duckdb"
    open_database(path).close()
    con = duckdb.connect(str(path))
    assert [v for (v,) in con.execute("SELECT version FROM schema_versions ORDER BY version").fetchall()] == list(
        range(schema.latest_version() + 1)
    )
    con.execute("INSERT INTO schema_versions VALUES (999, 'future', '', now(), 'x')")
    con.close()
    with pytest.raises(DatabaseError, match="schema version 999, newer than this tbpipe"):
        open_database(path, read_only=True)
    con = duckdb.connect(str(path))
    con.execute("DELETE FROM schema_versions WHERE version >= 1")
    con.close()
    with pytest.raises(DatabaseError, match="older than this tbpipe's .* run `tbpipe ingest` on it once"):
        open_database(path, read_only=True)


def test_files_that_are_not_tbpipe_databases(tmp_path) -> None:
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).close()
    with pytest.raises(DatabaseError, match="is not a tbpipe database"):
        open_database(other, read_only=True)
    garbage = tmp_path / "garbage.duckdb"
    garbage.write_bytes(os.urandom(5000))
    with pytest.raises(DatabaseError, match="cannot open the database"):
        open_database(garbage, read_only=True)


def test_the_ingest_lock_names_its_holder_only_while_held(tmp_path) -> None:
    """The lock file says who holds it while they do, and is cleared as they let go: a waiter that
    reads it in the moment before the next holder writes sees no holder, not the last one. A holder
    in the waiter's own process is named as such."""
    path = tmp_path / "held.duckdb"
    lock_file = path.with_name(path.name + ".lock")
    waits: list[str] = []
    with ingest_lock(path, 0.0):
        assert lock_file.read_text().split("\n")[0] == str(os.getpid())
        with pytest.raises(DatabaseBusyError, match=rf"another ingest \(pid {os.getpid()}, this process\)"):
            with ingest_lock(path, 0.3, on_wait=waits.append):
                pass
    assert lock_file.read_text() == ""
    assert waits == [f"waiting for another ingest (pid {os.getpid()}, this process) to finish writing {path} ..."]
    with open(lock_file, "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # held by a holder that has not written its pid yet
        with pytest.raises(DatabaseBusyError, match=r"another ingest is writing it"):
            with ingest_lock(path, 0.0):
                pass
