"""The service's guards, stated exactly at their edges: the token's header and scheme, the Host check,
the SQL sandbox's statement rules and row limit, and an upload's entry, byte and expansion caps and
where its entries may land (never in a sibling folder whose name starts with the upload's)."""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
import io
import json
import math
import os
import re
import shutil
import stat
import tarfile
import threading
import time
import uuid
import zipfile
from pathlib import Path, PurePosixPath

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tbpipe import capture
from tbpipe.pipeline.db.connection import open_database
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.serve import sandbox, security, upload
from tbpipe.pipeline.serve.database import open_locked
from tbpipe.pipeline.serve.sandbox import QueryRefused
from tbpipe.pipeline.serve.upload import UploadRefused

TOKEN = "s3cret-token-0123456789"
NEEDS_THE_TOKEN = "this needs the service's token: send the header 'Authorization: Bearer TOKEN'"

# ------------------------------------------------------------------------------------------ the token


@pytest.mark.parametrize(
    "header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer {TOKEN} ", f"Bearer  {TOKEN}"]
)
def test_the_bearer_scheme_with_the_token_passes(header: str) -> None:
    security.check_token(TOKEN, header)


@pytest.mark.parametrize(
    "header, message",
    [
        (None, "Authorization: Bearer TOKEN"),
        ("", "Authorization: Bearer TOKEN"),
        (TOKEN, "Authorization: Bearer TOKEN"),  # no scheme
        (f"Basic {TOKEN}", "Authorization: Bearer TOKEN"),
        (f"Token {TOKEN}", "Authorization: Bearer TOKEN"),
        (f"Bearerx {TOKEN}", "Authorization: Bearer TOKEN"),
        (f"Bear {TOKEN}", "Authorization: Bearer TOKEN"),
        ("Bearer", "Authorization: Bearer TOKEN"),
        ("Bearer ", "Authorization: Bearer TOKEN"),
        ("Bearer wrong-token-0123456789", "wrong token"),
        (f"Bearer {TOKEN[:-1]}", "wrong token"),
        (f"Bearer {TOKEN}x", "wrong token"),
        (f"Bearer {TOKEN.upper()}", "wrong token"),
    ],
)
def test_other_schemes_and_tokens_are_401(header: str | None, message: str) -> None:
    with pytest.raises(security.TokenError) as caught:
        security.check_token(TOKEN, header)
    assert caught.value.status == 401
    assert str(caught.value) == ("wrong token" if message == "wrong token" else NEEDS_THE_TOKEN)


def test_without_a_configured_token_writes_are_403() -> None:
    with pytest.raises(security.TokenError) as caught:
        security.check_token(None, f"Bearer {TOKEN}")
    assert caught.value.status == 403
    assert str(caught.value) == "writes are disabled: start tbpipe serve with --token-file to accept uploads"


def test_a_token_file_needs_16_characters(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(" " + "x" * 16 + "\n")
    assert security.read_token(path) == "x" * 16
    path.write_text("x" * 15 + "\n")
    with pytest.raises(UsageError) as caught:
        security.read_token(path)
    assert str(caught.value) == f"--token-file {path}: the token must be at least 16 characters long"
    with pytest.raises(UsageError) as caught:
        security.read_token(tmp_path / "missing")
    assert str(caught.value) == f"--token-file {tmp_path / 'missing'}: cannot read it (No such file or directory)"
    path.write_bytes(b"\xff" * 20)
    with pytest.raises(UsageError) as caught:
        security.read_token(path)
    assert str(caught.value).startswith(f"--token-file {path}: cannot read it ('utf-8' codec can't decode byte 0xff")


# ------------------------------------------------------------------------------------------ Host and headers


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("localhost.example.com", False),
        ("evil.example", False),
        ("X::1", False),  # only brackets are taken off
    ],
)
def test_loopback_names(host: str, loopback: bool) -> None:
    assert security.is_loopback(host) is loopback


def get_with_host(host: str, loopback_only: bool) -> httpx.Response:
    """GET / with this Host header from a Starlette app behind the middleware, in process."""
    app = security.SecurityHeaders(
        Starlette(routes=[Route("/", lambda request: PlainTextResponse("hello"))]), loopback_only=loopback_only
    )

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.get("/", headers={"host": host})

    return asyncio.run(get())


@pytest.mark.parametrize(
    "host, status",
    [
        ("127.0.0.1:8000", 200),
        ("localhost:8000", 200),
        ("localhost", 200),
        ("[::1]:8000", 200),
        ("[::1]", 200),
        ("evil.example:8000", 421),
        ("evil.example", 421),
        ("127.0.0.1.evil.example", 421),
    ],
)
def test_a_loopback_service_answers_loopback_hosts_only(host: str, status: int) -> None:
    response = get_with_host(host, loopback_only=True)
    assert response.status_code == status
    if status == 421:
        assert (
            response.text == f"Host {host!r} refused: this service answers loopback names only (127.0.0.1, localhost)\n"
        )
        assert response.headers["content-type"] == "text/plain; charset=utf-8"
    else:
        assert response.text == "hello"
        assert response.headers["content-security-policy"] == security.CSP
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"


def test_a_service_bound_elsewhere_takes_any_host_and_still_sends_the_headers() -> None:
    response = get_with_host("evil.example:8000", loopback_only=False)
    assert response.status_code == 200 and response.headers["content-security-policy"] == security.CSP


async def echo_body(scope, receive, send) -> None:
    """A bare ASGI app: answers the request's body with a start message that has no headers (the
    ASGI spec allows that), and tells what scope it was called with."""
    received = await receive()
    body = received["body"] if scope["type"] == "http" else b""
    await send({"type": "http.response.start", "status": 200})
    await send({"type": "http.response.body", "body": body or scope["type"].encode()})


def call_asgi(app, scope: dict, body: bytes = b"") -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_the_middleware_on_bare_asgi_messages() -> None:
    app = security.SecurityHeaders(echo_body, loopback_only=True)
    http = {"type": "http", "method": "POST", "path": "/", "headers": []}  # no Host header at all
    start, answer = call_asgi(app, http, b"payload")
    assert start["status"] == 200 and start["headers"] == security.HEADERS and answer["body"] == b"payload"
    # Other scopes (lifespan, websocket) pass through as they are.
    (start, answer) = call_asgi(app, {"type": "lifespan"})
    assert "headers" not in start and answer["body"] == b"lifespan"


def test_static_files_are_the_table_only() -> None:
    files = security.StaticFiles()
    name = next(n for n in files.files if n.endswith(".css"))
    response = files.response(name)
    assert response.media_type.startswith("text/css") and response.headers["cache-control"] == "no-cache"
    assert response.body == files.files[name][0]
    assert files.response("../" + name) is None and files.response("app.py") is None


# ------------------------------------------------------------------------------------------ the SQL sandbox


@pytest.fixture(scope="module")
def cursor(tmp_path_factory):
    path = tmp_path_factory.mktemp("sandbox") / "db.duckdb"
    with open_database(path) as con:  # a fresh tbpipe database, and a table of our own in it
        con.execute("CREATE TABLE t AS SELECT range AS i, 'row ' || range AS s FROM range(10)")
    con = open_locked(path)
    yield con.cursor()
    con.close()


def refusal(cursor, sql: str) -> QueryRefused:
    with pytest.raises(QueryRefused) as caught:
        sandbox.check_statement(cursor, sql)
    return caught.value


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1",
        "  select 1;  ",
        "(SELECT 1)",
        "-- a comment\nSELECT 1",
        "/* PRAGMA */ SELECT 1",
        "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
        "FROM t",
        "VALUES (1)",
        "SELECT * FROM range(3)",
        "SELECT * FROM generate_series(1, 3)",
        "SELECT * FROM unnest([1, 2])",
        "SELECT * FROM repeat(1, 3)",
        "SELECT * FROM json_each('[1]')",
        "SELECT * FROM duckdb_tables()",
        "SELECT * FROM pragma_table_info('t')",
        "DESCRIBE t",
        "SUMMARIZE t",
        "SHOW TABLES",
        "TABLE t",
        "/* two\nlines */ SELECT 1",
        "UNPIVOT t ON i INTO NAME column_name VALUE v",  # a SELECT in DuckDB's parse, however it starts
    ],
)
def test_one_select_over_the_catalog_passes(cursor, sql: str) -> None:
    assert sandbox.check_statement(cursor, sql) == sql.strip().rstrip(";").strip()


def test_the_statement_run_is_the_one_given_without_its_semicolon(cursor) -> None:
    assert sandbox.check_statement(cursor, "SELECT 1 AS X;") == "SELECT 1 AS X"
    unpivoted = sandbox.run_query(
        cursor, "UNPIVOT (FROM t WHERE i < 2) ON i INTO NAME c VALUE v", max_rows=5, timeout_s=30
    )
    assert unpivoted.rows == [["row 0", "i", 0], ["row 1", "i", 1]]


@pytest.mark.parametrize(
    "sql, message",
    [
        ("", "no SQL given: pass a SELECT statement as ?sql=..."),
        ("SELECT $x", "the query has parameters ($name or ?); write the values into the SQL"),
        ("SELECT 1; SELECT 2", "one statement at a time: this SQL holds 2"),
        ("DELETE FROM t", "only SELECT queries run here (the database is read-only); this is a DELETE statement"),
        # DuckDB's kind of statement, not its first word, names a statement that is not a query.
        ("INSTALL httpfs", "only SELECT queries run here (the database is read-only); this is a LOAD statement"),
        ("RESET threads", "only SELECT queries run here (the database is read-only); this is a SET statement"),
        (
            "SELECT * FROM glob('*')",
            "refused: table function glob() is not available here (this SQL can read the database's tables and "
            "views only; range, generate_series, unnest, json_each and the duckdb_*/pragma_* catalog functions "
            "are allowed)",
        ),
    ],
)
def test_refusals_say_exactly_why(cursor, sql: str, message: str) -> None:
    assert str(refusal(cursor, sql)) == message


def test_a_parse_error_names_duckdb_s_first_line(cursor) -> None:
    refused = refusal(cursor, "SELEC 1\nFROM t")
    assert str(refused).startswith("the SQL does not parse: Parser Error: syntax error at or near ")
    assert "\n" not in str(refused) and refused.status == 400


@pytest.mark.parametrize(
    "sql, status, message",
    [
        ("   ", 400, "no SQL given"),
        ("SELECT 1; SELECT 2", 400, "this SQL holds 2"),
        ("PRAGMA version", 403, "this is a PRAGMA statement"),
        ("/* SELECT */ PRAGMA version", 403, "this is a PRAGMA statement"),
        ("SET threads = 1", 403, "SET"),
        ("EXPLAIN SELECT 1", 403, "this is a EXPLAIN statement"),
        ("SELECT ?", 400, "parameters"),
        ("SELECT $x", 400, "parameters"),
        ("SELECT * FROM read_csv('x.csv')", 403, "read_csv() is not available"),
        ("SELECT * FROM Read_Text('x')", 403, "read_text() is not available"),
        ("SELECT * FROM range(2), read_blob('x')", 403, "read_blob() is not available"),
        ("SELECT * FROM (SELECT * FROM (SELECT * FROM glob('*')))", 403, "glob() is not available"),
        ("SELECT * FROM range_x(3)", 403, "range_x() is not available"),
    ],
)
def test_everything_else_is_refused(cursor, sql: str, status: int, message: str) -> None:
    refused = refusal(cursor, sql)
    assert message in str(refused) and refused.status == status


def test_the_statement_length_limit_is_inclusive(cursor) -> None:
    longest = "SELECT 1" + " " * (sandbox.MAX_SQL_CHARS - len("SELECT 1 --")) + " --"
    assert len(longest) == sandbox.MAX_SQL_CHARS
    sandbox.check_statement(cursor, longest)
    refused = refusal(cursor, longest + "-")
    assert refused.status == 400 and f"{sandbox.MAX_SQL_CHARS + 1:,} characters" in str(refused)


@pytest.mark.parametrize("rows, truncated", [(4, False), (5, False), (6, True), (10, True)])
def test_truncated_means_more_rows_than_the_limit(cursor, rows: int, truncated: bool) -> None:
    result = sandbox.run_query(cursor, f"SELECT i FROM t WHERE i < {rows} ORDER BY i", max_rows=5, timeout_s=30)
    body = result.to_json()
    assert body["truncated"] is truncated and body["limit"] == 5
    assert body["rows"] == [[i] for i in range(min(rows, 5))] and body["row_count"] == min(rows, 5)
    assert body["columns"] == ["i"] and body["types"] == ["BIGINT"]


def test_a_query_interrupted_otherwise_is_503(cursor) -> None:
    interrupt = threading.Timer(0.3, cursor.interrupt)
    interrupt.start()
    try:
        with pytest.raises(QueryRefused) as caught:
            sandbox.run_query(
                cursor, "SELECT count(*) FROM range(10000000000) a, range(1000) b", max_rows=1, timeout_s=60
            )
    finally:
        interrupt.cancel()
    assert (str(caught.value), caught.value.status) == ("the query was interrupted", 503)


def test_the_answer_says_how_long_it_took(cursor) -> None:
    result = sandbox.QueryResult(["a"], ["INTEGER"], [[1]], False, 5, 1.234567)
    assert result.to_json()["seconds"] == 1.2346
    assert 0 <= sandbox.run_query(cursor, "SELECT 1", max_rows=1, timeout_s=30).seconds < 30


def test_first_lines_of_errors() -> None:
    assert sandbox._first_line(ValueError("one\ntwo")) == "one"
    assert sandbox._first_line(ValueError("  \n")) == "ValueError"
    assert sandbox._first_line(ValueError("x" * 600)) == "x" * 500


def test_a_query_past_its_time_is_stopped(cursor) -> None:
    with pytest.raises(QueryRefused, match="time limit of 0.2 s") as caught:
        sandbox.run_query(cursor, "SELECT count(*) FROM range(10000000000) a, range(1000) b", max_rows=1, timeout_s=0.2)
    assert caught.value.status == 408
    assert sandbox.run_query(cursor, "SELECT 2", max_rows=1, timeout_s=30).rows == [[2]]  # the cursor still works


def test_the_locked_instance_refuses_a_file_and_errors_are_one_line(cursor) -> None:
    with pytest.raises(
        QueryRefused, match="^refused: Permission Error: .*this SQL can read the database only"
    ) as caught:
        sandbox.run_query(cursor, "SELECT * FROM 'x.csv'", max_rows=1, timeout_s=30)
    assert caught.value.status == 403 and "\n" not in str(caught.value)
    with pytest.raises(QueryRefused) as caught:
        sandbox.run_query(cursor, "SELECT 1 / 'a'", max_rows=1, timeout_s=30)
    assert caught.value.status == 400 and str(caught.value).startswith("Conversion Error: Could not convert")


def test_values_as_json_carries_them() -> None:
    moment = dt.datetime(2026, 12, 6, 5, 4, 3)
    key = uuid.UUID(int=1)
    assert sandbox.jsonable(None) is None and sandbox.jsonable(True) is True and sandbox.jsonable(7) == 7
    assert sandbox.jsonable(1.5) == 1.5 and sandbox.jsonable(math.nan) is None and sandbox.jsonable(-math.inf) is None
    assert sandbox.jsonable(decimal.Decimal("1.25")) == 1.25
    assert sandbox.jsonable(moment) == "2026-12-06T05:04:03" and sandbox.jsonable(moment.date()) == "2026-12-06"
    assert sandbox.jsonable(dt.time(1, 2)) == "01:02:00" and sandbox.jsonable(dt.timedelta(minutes=2)) == 120.0
    assert sandbox.jsonable(b"\x00\xff") == "AP8=" and sandbox.jsonable(memoryview(b"ab")) == "YWI="
    assert sandbox.jsonable(key) == str(key)
    assert sandbox.jsonable({1: [math.nan, (b"a", 2)]}) == {"1": [None, ["YQ==", 2]]}
    assert sandbox.jsonable(frozenset()) == "frozenset()"


# ------------------------------------------------------------------------------------------ uploads


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "not a plain relative path"),
        ("run/a\x00b", "not a plain relative path"),
        ("run\\a", "not a plain relative path"),
        ("/etc/passwd", "absolute path"),
        ("//etc/passwd", "absolute path"),
        ("..", "reaches outside"),
        ("run/../../x", "reaches outside"),
        ("run/..", "reaches outside"),
        (".", "empty path"),
        ("./", "empty path"),
        ("././", "empty path"),
    ],
)
def test_entry_names_that_could_land_outside_are_refused(name: str, message: str) -> None:
    with pytest.raises(UploadRefused) as caught:
        upload._entry_path(name)
    assert caught.value.status == 400
    separator = " " if message in ("absolute path", "reaches outside") else ": "
    detail = {"absolute path": "has an absolute path", "reaches outside": "reaches outside the archive ('..')"}
    assert str(caught.value) == f"archive entry {name!r}{separator}{detail.get(message, message)}"


def test_long_entry_names_are_cut_to_200_characters(tmp_path: Path) -> None:
    name = "/" + "a" * 300
    with pytest.raises(UploadRefused) as caught:
        upload._entry_path(name)
    assert str(caught.value) == f"archive entry {name[:200]!r} has an absolute path"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("r/" + "b" * 250)
        info.type, info.linkname = tarfile.SYMTYPE, "x"
        tar.addfile(info)
    archive = tmp_path / "a.tar"
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(UploadRefused) as caught:
        upload.unpack(archive, tmp_path / "into", max_unpacked=1 << 20)
    expected = f"archive entry {info.name[:200]!r} is a symbolic link; only files and folders are taken"
    assert str(caught.value) == expected


@pytest.mark.parametrize(
    "name, says",
    [
        ("a" * 250 + "\x00", ": not a plain relative path"),
        ("../" + "a" * 300, " reaches outside the archive ('..')"),
        ("./" * 150, ": empty path"),
    ],
)
def test_every_entry_name_refusal_cuts_the_name_to_200_characters(name: str, says: str) -> None:
    with pytest.raises(UploadRefused) as caught:
        upload._entry_path(name)
    assert str(caught.value) == f"archive entry {name[:200]!r}{says}"


def test_entry_names_are_made_plain() -> None:
    assert upload._entry_path("./run/./a.parquet") == PurePosixPath("run/a.parquet")
    assert upload._entry_path("run//a") == PurePosixPath("run/a")
    assert upload._entry_path("run..x/..a") == PurePosixPath("run..x/..a")  # dots inside a name are a name


def test_the_entry_cap_is_inclusive(tmp_path: Path, monkeypatch) -> None:
    assert upload.MAX_ENTRIES == 10_000
    # A smaller cap, so that every mutant's run stays short; the rule is the same at any cap.
    monkeypatch.setattr(upload, "MAX_ENTRIES", 1_200)
    writer = upload._Writer(tmp_path, max_unpacked=10)
    for _ in range(1_200):
        writer.folder(PurePosixPath("run"))
    with pytest.raises(UploadRefused) as caught:
        writer.file(PurePosixPath("a"), io.BytesIO(b""))
    assert str(caught.value) == "the archive holds more than 1,200 entries" and caught.value.status == 400
    assert not (tmp_path / "a").exists()


def test_the_byte_cap_is_inclusive(tmp_path: Path) -> None:
    writer = upload._Writer(tmp_path, max_unpacked=10, limit="ten bytes")
    writer.file(PurePosixPath("a"), io.BytesIO(b"x" * 6))
    writer.file(PurePosixPath("b"), io.BytesIO(b"x" * 4))
    assert writer.written == 10 and (tmp_path / "b").read_bytes() == b"xxxx"
    with pytest.raises(UploadRefused, match=r"more than 10 bytes \(ten bytes\)") as caught:
        writer.file(PurePosixPath("c"), io.BytesIO(b"x"))
    assert caught.value.status == 413
    with pytest.raises(UploadRefused, match="appears twice"):
        upload._Writer(tmp_path, max_unpacked=10).file(PurePosixPath("a"), io.BytesIO(b""))
    with pytest.raises(UploadRefused) as caught:  # no limit named: the service's own
        upload._Writer(tmp_path, max_unpacked=3).file(PurePosixPath("d"), io.BytesIO(b"xxxx"))
    assert str(caught.value) == "the archive unpacks to more than 3 bytes (the limit); nothing was kept"


def test_a_folder_entry_makes_its_parents(tmp_path: Path) -> None:
    writer = upload._Writer(tmp_path, max_unpacked=10)
    writer.folder(PurePosixPath("run/parts/events"))  # tar and zip need not list the parents first
    writer.folder(PurePosixPath("run/parts"))  # listed after: no clash
    assert (tmp_path / "run" / "parts" / "events").is_dir() and writer.entries == 2


def test_files_land_in_new_folders_and_a_second_copy_is_refused(tmp_path: Path) -> None:
    writer = upload._Writer(tmp_path, max_unpacked=1 << 21)
    deep = PurePosixPath("a" * 120, "b" * 120, "file")
    writer.file(deep, io.BytesIO(b"x" * (upload._CHUNK + 5)))  # more than one chunk
    assert (tmp_path / deep).stat().st_size == upload._CHUNK + 5 and writer.written == upload._CHUNK + 5
    with pytest.raises(UploadRefused) as caught:
        writer.file(deep, io.BytesIO(b""))
    assert str(caught.value) == f"archive entry {str(deep)[:200]!r} appears twice"


def test_an_upload_id_is_the_utc_time_and_random_hex(monkeypatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")  # nine hours from UTC: a local time would show
    time.tzset()
    try:
        before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0, tzinfo=None)
        stamp, _, random = upload.new_upload_id().partition("-")
        after = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert before <= dt.datetime.strptime(stamp, "%Y%m%dT%H%M%S") <= after
    assert re.fullmatch(r"[0-9a-f]{8}", random)


def test_an_entry_cannot_land_in_a_sibling_folder_sharing_its_prefix(tmp_path: Path) -> None:
    root, sibling = tmp_path / "upload", tmp_path / "upload-other"
    root.mkdir()
    sibling.mkdir()
    (root / "inside").symlink_to(root)
    (root / "sibling").symlink_to(sibling)
    writer = upload._Writer(root, max_unpacked=100)
    writer.file(PurePosixPath("inside/a"), io.BytesIO(b"ok"))
    assert (root / "a").read_bytes() == b"ok"
    with pytest.raises(UploadRefused, match="reaches outside"):
        writer.file(PurePosixPath("sibling/b"), io.BytesIO(b"bad"))
    with pytest.raises(UploadRefused, match="reaches outside"):
        writer.folder(PurePosixPath("sibling/c"))
    long = PurePosixPath("sibling", "d" * 250)
    with pytest.raises(UploadRefused) as caught:
        writer.folder(long)
    assert str(caught.value) == f"archive entry {str(long)[:200]!r} reaches outside the archive"
    assert list(sibling.iterdir()) == []


def test_the_expansion_limit_applies_only_below_the_unpacked_limit() -> None:
    assert upload.unpack_limit(100, 1000, 10.0) == (1000, "the limit")
    assert upload.unpack_limit(100, 1001, 10.0) == (
        1000,
        "10 times the archive's 100 bytes, the most an archive may expand",
    )
    assert upload.unpack_limit(100, 999, 10.0) == (999, "the limit")
    assert upload.unpack_limit(100, 5000, 2.5) == (
        250,
        "2.5 times the archive's 100 bytes, the most an archive may expand",
    )
    assert upload.unpack_limit(100, 1001, None) == (1001, "the limit")


def test_archive_kinds_by_their_first_bytes() -> None:
    ustar = bytes(257) + b"ustar" + bytes(250)
    assert [upload.archive_kind(h) for h in (b"PK\x03\x04rest", b"PK\x05\x06", b"\x1f\x8b\x08", b"BZh9")] == [
        "zip",
        "zip",
        "tar",
        "tar",
    ]
    assert upload.archive_kind(b"\xfd7zXZ\x00\x00") == "tar" and upload.archive_kind(ustar) == "tar"
    assert upload.archive_kind(ustar[:261]) is None and upload.archive_kind(b"PK\x01\x02") is None
    assert upload.archive_kind(ustar[:262]) == "tar"  # just long enough to hold the magic
    assert upload.archive_kind(bytes(257) + b"ustaR" + bytes(250)) is None


def folders_tar(entries: int) -> bytes:
    """An uncompressed tar of `entries` entries of the same folder (one header, repeated, then the end)."""
    info = tarfile.TarInfo("run")
    info.type = tarfile.DIRTYPE
    return info.tobuf(tarfile.GNU_FORMAT) * entries + bytes(2 * tarfile.BLOCKSIZE)


def test_an_archive_past_the_entry_cap_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(upload, "MAX_ENTRIES", 50)  # as in test_the_entry_cap_is_inclusive
    archive = tmp_path / "a.tar"
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    archive.write_bytes(folders_tar(50))
    upload.unpack(archive, uploads / "at_the_cap", max_unpacked=1 << 20)
    archive.write_bytes(folders_tar(51))
    with pytest.raises(UploadRefused, match="more than 50 entries") as caught:
        upload.receive(archive, uploads, max_unpacked=1 << 20)
    assert caught.value.status == 400 and os.listdir(uploads) == ["at_the_cap"]


def zeros_tar_gz(archive: Path) -> Path:
    """A tar.gz of one 1 MiB file of zeros (a few KiB packed: past any expansion ratio), at `archive`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("run/zeros")
        info.size = 1 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    archive.write_bytes(buffer.getvalue())
    return archive


def test_an_archive_past_its_expansion_is_refused(tmp_path: Path) -> None:
    archive = zeros_tar_gz(tmp_path / "a.tar.gz")
    into = tmp_path / "into"
    with pytest.raises(UploadRefused, match="times the archive's") as caught:
        upload.unpack(archive, into, max_unpacked=1 << 30)
    assert caught.value.status == 413
    upload.unpack(archive, tmp_path / "unlimited", max_unpacked=1 << 30, max_expansion=None)
    assert (tmp_path / "unlimited" / "run" / "zeros").stat().st_size == 1 << 20


# ------------------------------------------------------------------------------------------ whole uploads


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One run folder captured here."""
    out = tmp_path_factory.mktemp("upload_run")
    with capture.session(out / "runs", labels={"suite": "guards"}):
        capture.record("kernel_launch", "gemm")
    (found,) = (out / "runs").iterdir()
    return found


def tar_of(folder: Path, arcname: str, mode: str = "w:gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        tar.add(folder, arcname=arcname)
    return buffer.getvalue()


def zip_of(folder: Path, arcname: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr(zipfile.ZipInfo(arcname + "/"), b"")  # a folder entry, as zip tools write them
        for path in sorted(folder.rglob("*")):
            bundle.write(path, f"{arcname}/{path.relative_to(folder)}")
    return buffer.getvalue()


@pytest.mark.parametrize("pack", [lambda d: tar_of(d, "r"), lambda d: tar_of(d, "r", "w"), lambda d: zip_of(d, "r")])
def test_a_good_run_is_received(run_dir: Path, tmp_path: Path, pack) -> None:
    archive = tmp_path / "upload.bin"
    archive.write_bytes(pack(run_dir))
    received = upload.receive(archive, tmp_path / "uploads", max_unpacked=1 << 30)
    assert received.run_ids == [json.loads((run_dir / "manifest.json").read_text())["run_id"]]
    assert received.folder == tmp_path / "uploads" / received.upload_id and received.run_dirs == [received.folder / "r"]
    assert sorted(p.name for p in (received.folder / "r").iterdir()) == sorted(p.name for p in run_dir.iterdir())
    assert re.fullmatch(r"\d{8}T\d{6}-[0-9a-f]{8}", received.upload_id)


def test_a_damaged_run_is_quarantined_with_its_reason(run_dir: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    part = next(p for p in sorted(damaged.rglob("*.parquet")))
    part.write_bytes(part.read_bytes()[:-8])  # no footer
    archive = tmp_path / "upload.tar.gz"
    archive.write_bytes(tar_of(damaged, "r"))
    uploads = tmp_path / "uploads"
    with pytest.raises(UploadRefused, match="^quarantined: ") as caught:
        upload.receive(archive, uploads, max_unpacked=1 << 30)
    assert caught.value.status == 422 and str(uploads) not in str(caught.value)
    (kept,) = (uploads / "quarantine").iterdir()
    reason = (kept / "reason.txt").read_text()
    assert f"<upload {kept.name}>" in reason  # the folder, named as the service names it
    assert reason.endswith("\n") and str(caught.value) == f"quarantined: {reason.strip()}"
    assert (kept / "r" / "manifest.json").is_file() and sorted(os.listdir(uploads)) == ["quarantine"]


def test_quarantined_uploads_are_kept_side_by_side(run_dir: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    (damaged / "manifest.json").write_text("{")
    archive = tmp_path / "upload.tar"
    archive.write_bytes(tar_of(damaged, "r", "w"))
    uploads = tmp_path / "uploads"
    for _ in range(2):
        with pytest.raises(UploadRefused, match="^quarantined: "):
            upload.receive(archive, uploads, max_unpacked=1 << 30)
    kept = sorted((uploads / "quarantine").iterdir())
    assert len(kept) == 2 and all((folder / "reason.txt").is_file() for folder in kept)


def member_tar(kind: bytes, name: str = "r/x") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, "/etc/passwd"
        tar.addfile(info)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "kind, what",
    [
        (tarfile.SYMTYPE, "a symbolic link"),
        (tarfile.LNKTYPE, "a hard link"),
        (tarfile.CHRTYPE, "a device"),
        (tarfile.BLKTYPE, "a device"),
        (tarfile.FIFOTYPE, "a FIFO"),
    ],
)
def test_tar_entries_other_than_files_and_folders_are_refused(tmp_path: Path, kind: bytes, what: str) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(member_tar(kind))
    with pytest.raises(UploadRefused, match=f"'r/x' is {what}; only files and folders are taken"):
        upload.unpack(archive, tmp_path / "into", max_unpacked=1 << 20)


def test_zip_links_and_junk_are_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        info = zipfile.ZipInfo("r/link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        bundle.writestr(info, b"/etc/passwd")
    archive = tmp_path / "a.zip"
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(UploadRefused, match="'r/link' is a symbolic link"):
        upload.unpack(archive, tmp_path / "into", max_unpacked=1 << 20)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        info = zipfile.ZipInfo("r/" + "l" * 250)
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        bundle.writestr(info, b"/etc/passwd")
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(UploadRefused) as caught:
        upload.unpack(archive, tmp_path / "into_long", max_unpacked=1 << 20)
    expected = f"archive entry {info.filename[:200]!r} is a symbolic link; only files and folders are taken"
    assert str(caught.value) == expected
    archive.write_bytes(b"PK\x03\x04" + bytes(600))
    with pytest.raises(UploadRefused, match="the zip archive cannot be read"):
        upload.unpack(archive, tmp_path / "into2", max_unpacked=1 << 20)
    archive.write_bytes(b"\x1f\x8b" + bytes(600))
    with pytest.raises(UploadRefused, match="the tar archive cannot be read"):
        upload.unpack(archive, tmp_path / "into3", max_unpacked=1 << 20)
    archive.write_bytes(b"not an archive" * 50)
    with pytest.raises(UploadRefused, match="not a tar or zip archive") as caught:
        upload.unpack(archive, tmp_path / "into4", max_unpacked=1 << 20)
    assert caught.value.status == 415 and not (tmp_path / "into4").exists()


def test_an_archive_that_may_not_fit_on_the_disk_is_refused_first(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(member_tar(tarfile.DIRTYPE, "r"))
    with pytest.raises(UploadRefused) as caught:
        upload.unpack(archive, tmp_path / "into", max_unpacked=1 << 62, max_expansion=None)
    assert caught.value.status == 507 and not (tmp_path / "into").exists()
    assert re.fullmatch(
        rf"the disk holding the uploads has [0-9,]+ bytes free, less than the {1 << 62:,} this archive may unpack "
        r"to \(the limit\): free some space \(tbpipe retain --keep-quarantined-days, "
        r"--delete-ingested-runs-after-days\)",
        str(caught.value),
    )


def test_an_archive_without_a_run_leaves_nothing(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(member_tar(tarfile.DIRTYPE, "r"))
    with pytest.raises(UploadRefused, match="holds no run folder") as caught:
        upload.receive(archive, tmp_path / "uploads", max_unpacked=1 << 20)
    assert caught.value.status == 422 and os.listdir(tmp_path / "uploads") == []


def test_receive_keeps_the_expansion_limit_and_says_why_it_refuses(tmp_path: Path) -> None:
    archive = zeros_tar_gz(tmp_path / "a.tar.gz")
    with pytest.raises(UploadRefused, match="times the archive's"):
        upload.receive(archive, tmp_path / "uploads", max_unpacked=1 << 30)
    with pytest.raises(UploadRefused) as caught:
        upload.receive(archive, tmp_path / "uploads", max_unpacked=1 << 30, max_expansion=None)
    assert str(caught.value) == "the archive holds no run folder (a folder with manifest.json and its Parquet parts)"
    archive.write_bytes(b"not an archive" * 50)
    with pytest.raises(UploadRefused) as caught:  # refused before its folder exists: still this refusal
        upload.receive(archive, tmp_path / "uploads", max_unpacked=1 << 30)
    assert str(caught.value) == "the upload is not a tar or zip archive (send a run folder as .tar, .tar.gz or .zip)"
    assert caught.value.status == 415 and os.listdir(tmp_path / "uploads") == []


def test_entries_of_other_kinds_and_clashes_are_named(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(member_tar(b"Z"))  # a type tar does not know
    with pytest.raises(UploadRefused) as caught:
        upload.unpack(archive, tmp_path / "into", max_unpacked=1 << 20)
    assert str(caught.value) == "archive entry 'r/x' is not a regular file; only files and folders are taken"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        info = zipfile.ZipInfo("r/fifo")
        info.external_attr = (stat.S_IFIFO | 0o644) << 16
        bundle.writestr(info, b"")
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(UploadRefused) as caught:
        upload.unpack(archive, tmp_path / "into2", max_unpacked=1 << 20)
    assert str(caught.value) == "archive entry 'r/fifo' is not a regular file; only files and folders are taken"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("r", "r/x"):  # a file, then an entry inside it as if it were a folder
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(UploadRefused) as caught:
        upload.unpack(archive, tmp_path / "into3", max_unpacked=1 << 20)
    # The error's words, not its number or the server's path.
    assert caught.value.status == 400 and str(caught.value) == "the archive cannot be unpacked: File exists"
