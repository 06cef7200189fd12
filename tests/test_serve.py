"""`tbpipe serve`: a real uvicorn server (child process, loopback, free port) over real DuckDB files of
runs captured with `tbpipe run`; every request goes over HTTP. What the service keeps per database
state is also compared, in-process, with the same reads made afresh."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest
from support.serve import (
    TBPIPE,
    Server,
    environment,
    line_of,
    nights_database,
    program_v2,
    wait_until,
)

from tbpipe import capture
from tbpipe.pipeline.rawrun import find_run_dirs

TOKEN = "s3cret-token-for-the-tests-0123456789"


@pytest.fixture(scope="module")
def env(symbol_cache) -> dict[str, str]:
    return environment(symbol_cache)


@pytest.fixture(scope="module")
def nights_db(tmp_path_factory, env) -> Path:
    return nights_database(tmp_path_factory.getbasetemp(), env)


@pytest.fixture(scope="module")
def server(nights_db, env):
    """A read-only service (no token, no watch) over the nights' database, with a short query limit."""
    with Server(nights_db, "--query-timeout", "2", "--query-rows", "3", env=env) as running:
        yield running
    assert "Traceback" not in running.output()


def get(server: Server, path: str, **params) -> httpx.Response:
    return httpx.get(server.url + path, params=params, timeout=60)


def ok(server: Server, path: str, **params) -> dict:
    response = get(server, path, **params)
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------------------------------ reads


def test_runs_filter_and_page(server) -> None:
    body = ok(server, "/api/runs")
    assert body["total"] == 4
    commits = [r["labels"]["commit"] for r in body["runs"]]
    assert commits == ["c4", "c3", "c2", "c1"]  # newest first
    night4 = body["runs"][0]
    assert night4["status"] == "complete" and night4["complete"] is True
    # v2: 4 gemm + 1 gemm_splitk... counted by kind: kernel_launch 3+1+8+1 = 13, op 2, step 1
    assert night4["counts"] == {"kernel_launch": 13, "op": 2, "step": 1}
    assert night4["events"] == 16
    assert ok(server, "/api/runs", label="commit=c2")["total"] == 1
    assert ok(server, "/api/runs", label=["suite=app", "commit=c9"])["total"] == 0
    page = ok(server, "/api/runs", limit=2, offset=2, order="oldest")
    assert [r["labels"]["commit"] for r in page["runs"]] == ["c3", "c4"] and page["total"] == 4
    assert ok(server, "/api/runs", complete="false")["total"] == 0
    assert ok(server, "/api/labels") == {"commit": ["c1", "c2", "c3", "c4"], "suite": ["app"]}


def test_run_sites_site_and_history(server) -> None:
    run_id = ok(server, "/api/runs", label="commit=c4")["runs"][0]["run_id"]
    sites = ok(server, f"/api/runs/{run_id}/sites", kind="kernel_launch")["sites"]
    by_name = {(s["name"], s["site_line"]): s for s in sites}
    v2 = program_v2()
    softmax = by_name[("softmax", line_of(v2, "the softmax site"))]
    assert softmax["events"] == 8 and softmax["site_file"] == "app.py" and softmax["site_function"] == "softmaxes"
    assert ("layernorm", line_of(v2, "the layernorm site")) in by_name
    assert [s["name"] for s in ok(server, f"/api/runs/{run_id}/sites", name="SPLIT")["sites"]] == ["gemm_splitk"]
    paged = ok(server, f"/api/runs/{run_id}/sites", limit=1, offset=1)
    assert len(paged["sites"]) == 1 and paged["more"] is True

    site = ok(server, f"/api/sites/{softmax['site_key']}")
    assert site["events"] == 4 + 4 + 4 + 8
    assert site["portable_file"] == "app.py" and site["file"].endswith("/repo/app.py")
    frames = site["stacks"][0]["frames"]
    kinds = {f["kind"] for f in frames}
    assert {"python", "native"} <= kinds  # a combined traceback
    app_frames = [f for f in frames if f["kind"] == "python" and (f["file"] or "").endswith("app.py")]
    assert app_frames[0]["function"] == "softmaxes" and app_frames[0]["line"] == line_of(v2, "the softmax site")
    history = ok(server, f"/api/sites/{softmax['site_key']}/history")["runs"]
    assert [h["events"] for h in history] == [4, 4, 4, 8]  # oldest first
    assert [h["labels"]["commit"] for h in history] == ["c1", "c2", "c3", "c4"]
    assert site["runs"] == history

    stack_id = site["stacks"][0]["stack_id"]
    assert ok(server, f"/api/stacks/{stack_id}")["frames"] == frames


def test_kept_reads_equal_fresh_ones(nights_db, tmp_path, monkeypatch) -> None:
    """Pages of a run's sites cut from its kept lead, and sites read with kept lookups, are the same
    as read afresh; pages past a short lead are queried."""
    from tbpipe.pipeline.serve import queries
    from tbpipe.pipeline.serve.database import open_locked

    copy = tmp_path / "copy.duckdb"
    shutil.copy(nights_db, copy)  # the module's server may hold the file
    queried = []
    real_page = queries._sites_page
    monkeypatch.setattr(queries, "_sites_page", lambda *a: queried.append(a) or real_page(*a))
    con = open_locked(copy)
    try:
        run_ids = [row[0] for row in con.execute("SELECT run_id FROM runs").fetchall()]
        keys = [row[0] for row in con.execute("SELECT site_key FROM sites").fetchall()]
        for lead, state in ((3, ("short lead",)), (queries.LEAD_SITES, ("whole lead",))):
            monkeypatch.setattr(queries, "LEAD_SITES", lead)
            queries_of_kept = pages = 0
            for run_id in run_ids:
                for kind in (None, "kernel_launch", "op", "step"):
                    for offset, limit in ((0, 2), (0, 50), (1, 1), (2, 3), (4, 2)):
                        before = len(queried)
                        kept = queries.run_sites(con.cursor(), run_id, kind, None, limit, offset, state)
                        queries_of_kept += len(queried) - before
                        pages += 1
                        assert kept == queries.run_sites(con.cursor(), run_id, kind, None, limit, offset)
            if lead == 3:  # each run's lead, and the pages past it
                assert len(run_ids) < queries_of_kept < pages
            else:  # each run's lead, and nothing more
                assert queries_of_kept == len(run_ids)
        assert keys
        for key in keys:
            assert queries.site(con.cursor(), key, 5, ("state",)) == queries.site(con.cursor(), key, 5)
        for run_id in run_ids:  # a run's counts from every run's, kept for the state
            assert queries.run(con.cursor(), run_id, ("state",)) == queries.run(con.cursor(), run_id)
        # Read ahead for a state (warm.py does it after every ingest): the runs' pages need no query.
        assert queries.warm(con.cursor(), ("warmed",)) == len(run_ids)
        before = len(queried)
        for run_id in run_ids:
            for kind in (None, "kernel_launch"):
                queries.run_sites(con.cursor(), run_id, kind, None, 50, 0, ("warmed",))
        assert len(queried) == before
    finally:
        con.close()


def _nodes(tree: dict):
    yield tree
    for child in tree.get("children", []):
        yield from _nodes(child)


def test_run_icicle_and_kernel_callers(server) -> None:
    run_id = ok(server, "/api/runs", label="commit=c4")["runs"][0]["run_id"]
    tree = ok(server, f"/api/runs/{run_id}/icicle")["tree"]
    assert tree["value"] == 16 and tree["kind"] == "root"
    leaves: dict[str, float] = {}

    def walk(node):
        if node["kind"] == "event":
            leaves[node["name"]] = leaves.get(node["name"], 0) + node["value"]
        for child in node.get("children", []):
            assert child["value"] <= node["value"]
            walk(child)

    walk(tree)
    assert leaves == {"gemm": 3, "gemm_splitk": 1, "softmax": 8, "layernorm": 1, "aten::mm": 2, "train": 1}
    assert ok(server, f"/api/runs/{run_id}/icicle", kind="op")["tree"]["value"] == 2

    callers = ok(server, "/api/kernels/softmax/callers")
    assert callers["tree"]["name"] == "softmax" and callers["tree"]["value"] == 20
    assert callers["kinds"] == ["kernel_launch"]
    # One level below the event: the frames that launched it, innermost first; somewhere down
    # the tree, the Python function softmaxes in app.py.
    names = set()

    def collect(node):
        names.add((node["kind"], node["name"]))
        for child in node.get("children", []):
            collect(child)

    collect(callers["tree"])
    assert ("python", "softmaxes") in names and ("python", "main") in names
    # Four checkouts launched it from the same line of the same code: one path, not four.
    (launcher,) = callers["tree"]["children"]
    assert (launcher["name"], launcher["value"], launcher["file"]) == ("softmaxes", 20, "app.py")
    assert [s["name"] for s in callers["sites"]] == ["softmax"]
    assert get(server, "/api/kernels/nonexistent/callers").status_code == 404


def test_compare_is_the_report_json(server, nights_db) -> None:
    args = {"candidate": "commit=c4", "baseline": "commit=c3"}
    api = ok(server, "/api/compare", **args)
    # The service holds the database; a read-only `tbpipe report` may still open it alongside.
    result = subprocess.run(
        [*TBPIPE, "report", "--db", str(nights_db), "--candidate", "commit=c4", "--baseline", "commit=c3",
         "--format", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert api == json.loads(result.stdout)
    assert api["verdict"].startswith("3 regressions (2 new, 1 increased)")
    assert {s["name"] for s in api["regressions"]} == {"softmax", "layernorm", "gemm_splitk"}

    window = ok(
        server, "/api/compare", candidate="commit=c4", baseline_window=3, group_by="commit", kind="kernel_launch"
    )
    assert window["mode"] == "window" and len(window["baseline"]) == 3
    assert {s["kind"] for s in window["sites"]} == {"kernel_launch"}
    per = ok(server, "/api/compare", candidate="commit=c4", baseline="commit=c1", per="step:train", threshold_abs=2)
    assert per["per"] == {"kind": "step", "name": "train"} and per["thresholds"]["absolute"] == 2
    assert {s["name"] for s in per["regressions"]} == {"softmax"}  # +4 passes the threshold, +1 does not

    diff = ok(server, "/api/compare/icicle", **args)
    assert diff["tree"]["value"] == 16 and diff["tree"]["base"] == 10
    # The two nights ran from checkouts of their own: their Python frames are matched by portable
    # file, so softmaxes is one box that doubled, not one box gone and another one new.
    boxes = [n for n in _nodes(diff["tree"]) if n["kind"] == "python" and n["name"] == "softmaxes"]
    assert [(n["value"], n["base"], n["file"]) for n in boxes] == [(8, 4, "app.py")]


def test_openapi_describes_the_api(server) -> None:
    paths = ok(server, "/api/openapi.json")["paths"]
    for path in ("/api/runs", "/api/runs/{run_id}/sites", "/api/sites/{site_key}", "/api/sites/{site_key}/history",
                 "/api/kernels/{name}/callers", "/api/compare", "/api/query"):  # fmt: skip
        assert path in paths, path
    assert "post" in paths["/api/runs"]
    assert {p["name"] for p in paths["/api/compare"]["get"]["parameters"]} >= {
        "candidate", "baseline", "baseline_window", "label", "kind", "per", "group_by", "threshold_rel", "threshold_abs"
    }  # fmt: skip


@pytest.mark.parametrize(
    "path, params, status, message",
    [
        ("/api/runs", {"limit": 0}, 400, "limit"),
        ("/api/runs", {"label": "nolabel"}, 400, "expected KEY=VALUE"),
        ("/api/runs", {"order": "sideways"}, 400, "order"),
        ("/api/runs/no-such-run", {}, 404, "no run 'no-such-run'"),
        ("/api/runs/no-such-run/sites", {}, 404, "no run"),
        ("/api/sites/0000000000000000", {}, 404, "no call site"),
        ("/api/stacks/notanumber", {}, 400, "stack_id"),
        ("/api/stacks/999999", {}, 404, "no stack 999999"),
        ("/api/compare", {"candidate": "commit=c4"}, 400, "give a baseline"),
        ("/api/compare", {"candidate": "nope", "baseline": "latest"}, 400, "no such run"),
        ("/api/compare", {"candidate": "latest", "baseline": "commit=c1", "per": "train"}, 400, "KIND:NAME"),
        ("/api/compare", {"candidate": "latest", "baseline_window": 0}, 400, "baseline_window"),
        ("/api/ingest/jobs/42", {}, 404, "no ingest job"),
        ("/api/nothing-here", {}, 404, "nothing at /api/nothing-here"),
    ],
)
def test_bad_requests_get_a_clear_4xx(server, path, params, status, message) -> None:
    response = get(server, path, **params)
    assert response.status_code == status, response.text
    body = response.json()
    assert message in body["error"] and "Traceback" not in response.text


def test_writes_are_refused_without_a_token(server) -> None:
    response = httpx.post(server.url + "/api/runs", content=b"x" * 10, timeout=30)
    assert response.status_code == 403 and "--token-file" in response.json()["error"]
    assert httpx.delete(server.url + "/api/runs", timeout=30).status_code == 405


# ------------------------------------------------------------------------------------------ SQL sandbox


def query(server: Server, sql: str) -> httpx.Response:
    return get(server, "/api/query", sql=sql)


def test_query_reads_with_a_row_limit(server) -> None:
    body = query(server, "SELECT name, sum(events) AS n FROM call_sites GROUP BY name ORDER BY n DESC, name").json()
    assert body["columns"] == ["name", "n"] and body["rows"][0] == ["softmax", 20]
    assert body["row_count"] == 3 and body["truncated"] is True  # the server's --query-rows 3
    body = query(
        server, "SELECT labels, started_at, 1.5::DECIMAL(4,2) AS d FROM runs ORDER BY started_at LIMIT 1"
    ).json()
    assert body["rows"][0][0] == {"suite": "app", "commit": "c1"} and body["rows"][0][2] == 1.5


@pytest.mark.parametrize(
    "sql, status, message",
    [
        ("COPY runs TO '{out}/copy.csv'", 403, "COPY"),
        ("SELECT * FROM read_csv('/etc/passwd')", 403, "refused"),
        ("SELECT * FROM read_text('/etc/hostname')", 403, "refused"),
        ("SELECT * FROM '/etc/passwd'", 400, "does not exist"),  # no file names as tables either
        ("SELECT * FROM read_parquet('{db}')", 403, "read_parquet() is not available"),
        ("SELECT * FROM read_blob('{db}')", 403, "read_blob() is not available"),
        ("SELECT * FROM glob('/etc/*')", 403, "glob() is not available"),
        ("SELECT * FROM query('SELECT * FROM read_text(''/etc/passwd'')')", 403, "query() is not available"),
        ("SELECT (SELECT count(*) FROM read_csv('/etc/passwd')) AS n", 403, "read_csv() is not available"),
        ("ATTACH '{out}/other.duckdb' AS other", 403, "ATTACH"),
        ("INSTALL httpfs", 403, "LOAD"),
        ("LOAD httpfs", 403, "LOAD"),
        ("SET enable_external_access = true", 403, "SET"),
        ("RESET lock_configuration", 403, "SET"),
        ("CREATE TABLE x AS SELECT 1", 403, "CREATE"),
        ("CREATE TEMP TABLE x AS SELECT 1", 403, "CREATE"),
        ("DELETE FROM runs", 403, "DELETE"),
        ("PRAGMA version", 403, "PRAGMA"),
        ("CALL pragma_version()", 403, "CALL"),
        ("EXPORT DATABASE '{out}/export'", 403, "EXPORT"),
        ("SELECT 1; COPY runs TO '{out}/copy2.csv'", 400, "one statement at a time"),
        ("SELECT 1; SELECT 2", 400, "one statement at a time"),
        ("SELEC 1", 400, "does not parse"),
        ("", 400, "no SQL given"),
        ("SELECT count(*) FROM range(1000000000000) a, range(1000000000000) b", 408, "time limit"),
    ],
)
def test_query_cannot_write_reach_files_or_change_settings(server, tmp_path, sql, status, message) -> None:
    text = sql.format(out=tmp_path, db=server.db)
    response = query(server, text)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert "root:" not in response.text  # /etc/passwd stayed closed
    # The database and its settings are as they were.
    assert query(server, "SELECT count(*) FROM runs").json()["rows"] == [[4]]
    assert query(server, "SELECT current_setting('enable_external_access')").json()["rows"] == [[False]]


def test_the_locked_instance_refuses_files_on_its_own(nights_db, tmp_path) -> None:
    """The second fence, without the statement check: DuckDB itself refuses on the sandbox's instance."""
    import duckdb

    from tbpipe.pipeline.serve.database import open_locked

    copy = tmp_path / "copy.duckdb"
    shutil.copy(nights_db, copy)
    con = open_locked(copy)
    try:
        cursor = con.cursor()
        for statement in (
            f"COPY runs TO '{tmp_path}/x.csv'",
            "SELECT * FROM read_csv('/etc/passwd')",
            f"ATTACH '{tmp_path}/y.duckdb'",
            "INSTALL httpfs",
            "SET enable_external_access = true",
            "SET memory_limit = '1GB'",
            "CREATE TABLE z AS SELECT 1",
        ):
            with pytest.raises(duckdb.Error):
                cursor.execute(statement)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.duckdb"]
    finally:
        con.close()


# ------------------------------------------------------------------------------------------ static files, headers


@pytest.mark.parametrize(
    "raw_path",
    [
        "/static/../app.py",
        "/static/%2e%2e/app.py",
        "/static/..%2fapp.py",
        "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/static/../../../../etc/passwd",
        "/static//etc/passwd",
        "/static/serve.py",
        "/static/",
        "/../../../../etc/passwd",
    ],
)
def test_static_files_come_only_from_the_package(server, raw_path) -> None:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", raw_path)  # sent as written: no client-side normalisation
    response = connection.getresponse()
    body = response.read().decode(errors="replace")
    connection.close()
    assert response.status in (400, 404), (raw_path, response.status)
    assert "root:" not in body and "import" not in body


def test_static_assets_and_headers(server) -> None:
    response = get(server, "/static/icicle.js")
    assert response.status_code == 200 and "TbpipeIcicle" in response.text
    assert response.headers["content-type"].startswith("text/javascript")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"
    assert get(server, "/static/tbpipe.css").status_code == 200  # the reports' stylesheet, shared
    page = get(server, "/").text
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    rebinding = httpx.get(server.url + "/api/runs", headers={"host": "attacker.example:80"}, timeout=30)
    assert rebinding.status_code == 421


# ------------------------------------------------------------------------------------------ concurrency with tbpipe ingest


def test_tbpipe_ingest_against_a_served_database_gets_a_clear_message(tmp_path, nights_db, env) -> None:
    db = tmp_path / "served.duckdb"
    shutil.copy(nights_db, db)
    runs = nights_db.parent / "runs"
    with Server(db, env=env) as running:
        impatient = subprocess.run(
            [*TBPIPE, "ingest", str(runs), "--db", str(db), "--wait", "0"], capture_output=True, text=True, env=env,
            timeout=120,
        )  # fmt: skip
        assert impatient.returncode == 2, impatient.stderr
        assert f"tbpipe serve on {running.url}" in impatient.stderr
        assert f"(pid {running.process.pid}) holds it while it runs" in impatient.stderr
        assert "Traceback" not in impatient.stderr
        patient = subprocess.run(
            [*TBPIPE, "ingest", str(runs), "--db", str(db), "--wait", "1"], capture_output=True, text=True, env=env,
            timeout=120,
        )  # fmt: skip
        assert patient.returncode == 2
        assert f"waiting for tbpipe serve on {running.url}" in patient.stderr
        # Readers of other processes may open the database beside the service.
        reader = subprocess.run(
            [*TBPIPE, "query", "--db", str(db), "SELECT count(*) AS n FROM runs", "--format", "csv"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert reader.returncode == 0 and reader.stdout.replace('"', "").split() == ["n", "4"], reader.stderr
    assert running.process.returncode == 0
    after = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(db), "--wait", "0"], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert after.returncode == 0, after.stderr  # the service let go of the database when it stopped


def test_serve_refuses_a_database_an_ingest_holds(tmp_path, env) -> None:
    from tbpipe.pipeline.db import ingest_lock

    db = tmp_path / "held.duckdb"
    with ingest_lock(db, 0):
        result = subprocess.run(
            [*TBPIPE, "serve", "--db", str(db), "--port", "9"], capture_output=True, text=True, env=env, timeout=120
        )
    assert result.returncode == 2
    assert "another ingest" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------ uploads


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("upload-source") / "runs"
    with capture.session(out, labels={"suite": "upload"}):
        for _ in range(3):
            capture.record("kernel_launch", "uploaded_kernel")
    (run_dir,) = find_run_dirs([out])
    return run_dir


def tar_of(folder: Path, name: str | None = None, compression: str = "gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}") as tar:
        tar.add(folder, arcname=name or folder.name)
    return buffer.getvalue()


def zip_of(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for path in sorted(folder.rglob("*")):
            bundle.write(path, f"{folder.name}/{path.relative_to(folder)}")
    return buffer.getvalue()


def tar_with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return buffer.getvalue()


def renamed_copy(run_dir: Path, root: Path, suffix: str) -> Path:
    target = root / f"{run_dir.name}-{suffix}"
    shutil.copytree(run_dir, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["run_id"] = f"{manifest['run_id']}-{suffix}"
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


@pytest.fixture(scope="module")
def upload_server(tmp_path_factory, env):
    root = tmp_path_factory.mktemp("upload-service")
    (root / "token").write_text(TOKEN + "\n")
    with Server(
        root / "up.duckdb", "--token-file", str(root / "token"), "--max-upload-mb", "1",
        "--uploads-dir", str(root / "uploads"), env=env,
    ) as running:  # fmt: skip
        running.root = root
        yield running
    assert "Traceback" not in running.output()


def upload(server: Server, body: bytes, token: str | None = TOKEN, wait: float = 120) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(server.url + "/api/runs", params={"wait": wait}, content=body, headers=headers, timeout=180)


def run_ids(server: Server) -> set[str]:
    return {r["run_id"] for r in ok(server, "/api/runs", limit=1000)["runs"]}


def test_upload_needs_the_token(upload_server, good_run, tmp_path) -> None:
    body = tar_of(renamed_copy(good_run, tmp_path, "notoken"))
    for token, message in ((None, "Authorization: Bearer"), ("wrong-token-wrong-token", "wrong token")):
        response = upload(upload_server, body, token=token)
        assert response.status_code == 401 and message in response.json()["error"]
    assert not any(rid.endswith("-notoken") for rid in run_ids(upload_server))


@pytest.mark.parametrize("packing", ["tar.gz", "tar", "zip"])
def test_uploaded_run_is_ingested(upload_server, good_run, tmp_path, packing) -> None:
    folder = renamed_copy(good_run, tmp_path, packing.replace(".", ""))
    body = zip_of(folder) if packing == "zip" else tar_of(folder, compression="gz" if packing == "tar.gz" else "")
    response = upload(upload_server, body)
    assert response.status_code == 201, response.text
    answer = response.json()
    (run_id,) = answer["run_ids"]
    assert answer["job"]["status"] == "done" and answer["job"]["runs"][0]["status"] == "ingested"
    assert run_id in run_ids(upload_server)
    sites = ok(upload_server, f"/api/runs/{run_id}/sites")["sites"]
    assert [(s["name"], s["events"]) for s in sites] == [("uploaded_kernel", 3)]
    assert ok(upload_server, answer["job_url"])["status"] == "done"
    # The same run again: the ingest finds it present.
    again = upload(upload_server, body)
    assert again.status_code == 201 and again.json()["job"]["runs"][0]["status"] == "present"


def test_upload_answers_at_once_without_wait(upload_server, good_run, tmp_path) -> None:
    response = upload(upload_server, tar_of(renamed_copy(good_run, tmp_path, "nowait")), wait=0)
    assert response.status_code in (201, 202), response.text
    job_url = response.json()["job_url"]
    assert response.headers["location"] == job_url
    job = wait_until(lambda: (j := ok(upload_server, job_url))["status"] in ("done", "failed") and j, what="the job")
    assert job["status"] == "done" and job["runs"][0]["status"] == "ingested"


def test_damaged_uploads_are_quarantined_with_the_reason(upload_server, good_run, tmp_path) -> None:
    broken = renamed_copy(good_run, tmp_path, "notjson")
    (broken / "manifest.json").write_text("{not json")
    response = upload(upload_server, tar_of(broken))
    assert response.status_code == 422
    assert "manifest is not JSON" in response.json()["error"]
    quarantine = upload_server.root / "uploads" / "quarantine"
    reasons = [p.read_text() for p in quarantine.glob("*/reason.txt")]
    assert any("manifest is not JSON" in r for r in reasons)

    # A damage only the ingest finds (events of a complete run referring to a stack it lacks).
    import pyarrow.parquet as pq

    dangling = renamed_copy(good_run, tmp_path, "dangling")
    (stacks,) = dangling.glob("stacks-*.parquet")
    table = pq.read_table(stacks)
    pq.write_table(table.slice(0, 0).replace_schema_metadata(table.schema.metadata), stacks)
    response = upload(upload_server, tar_of(dangling))
    assert response.status_code == 422, response.text
    assert "events refer to stacks the run does not hold" in response.json()["error"]
    assert not any(rid.endswith(("-notjson", "-dangling")) for rid in run_ids(upload_server))

    missing = renamed_copy(good_run, tmp_path, "missing")
    next(missing.glob("events-*.parquet")).unlink()
    response = upload(upload_server, tar_of(missing))
    assert response.status_code == 422 and "files listed in the manifest are missing" in response.json()["error"]


def _member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, link
    return info


@pytest.mark.parametrize(
    "make, status, message",
    [
        (lambda t: tar_with(_member("../escaped.txt", size=3), b"bad"), 400, "reaches outside"),
        (lambda t: tar_with(_member("run/../../escaped.txt", size=3), b"bad"), 400, "reaches outside"),
        (lambda t: tar_with(_member(f"{t}/absolute.txt", size=3), b"bad"), 400, "absolute path"),
        (lambda t: tar_with(_member("run/link", tarfile.SYMTYPE, link="/etc/passwd")), 400, "symbolic link"),
        (lambda t: tar_with(_member("run/hard", tarfile.LNKTYPE, link="/etc/passwd")), 400, "hard link"),
        (lambda t: tar_with(_member("run/dev", tarfile.CHRTYPE)), 400, "a device"),
        (lambda t: tar_with(_member("run/fifo", tarfile.FIFOTYPE)), 400, "a FIFO"),
        (lambda t: tar_with(_member("run\\..\\escaped.txt", size=3), b"bad"), 400, "not a plain relative path"),
        (lambda t: _zip_entry("../escaped.txt"), 400, "reaches outside"),
        (lambda t: _zip_entry(f"{t}/absolute.txt"), 400, "absolute path"),
        (lambda t: _zip_entry("run/link", mode=0o120777), 400, "symbolic link"),
        (lambda t: b"this is not an archive at all" * 100, 415, "not a tar or zip"),
        (lambda t: b"x" * (2 << 20), 413, "bytes"),
        (lambda t: _zip_bomb(), 413, "unpacks to more than"),
        (lambda t: tar_with(_member("empty/readme.txt", size=2), b"hi"), 422, "no run folder"),
    ],
)
def test_archive_escapes_and_junk_are_refused(upload_server, tmp_path, make, status, message) -> None:
    target = tmp_path / "target"
    target.mkdir()
    response = upload(upload_server, make(target))
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert list(target.iterdir()) == []
    uploads = upload_server.root / "uploads"
    assert not (uploads.parent / "escaped.txt").exists() and not (uploads / "escaped.txt").exists()
    # Refused archives leave nothing behind (only accepted uploads and the quarantine stay).
    leftovers = [
        p for p in uploads.iterdir() if p.name not in ("incoming", "quarantine") and not list(p.rglob("manifest.json"))
    ]
    assert leftovers == []
    incoming = uploads / "incoming"  # made by the first upload the service reads in
    assert not incoming.exists() or list(incoming.iterdir()) == []


def _zip_entry(name: str, mode: int | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        info = zipfile.ZipInfo(name)
        if mode is not None:
            info.external_attr = mode << 16
        bundle.writestr(info, b"/etc/passwd" if mode else b"bad")
    return buffer.getvalue()


def _zip_bomb() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr("run/zeros.bin", b"\0" * (8 << 20))  # 8 MiB unpacked, a few KiB packed
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------ watch


LIVE_PROGRAM = """
import sys, time
from pathlib import Path
from tbpipe import capture

out, go = Path(sys.argv[1]), Path(sys.argv[2])
with capture.session(out, labels={"suite": "live"}, flush_interval_s=0.2) as session:
    for _ in range(5):
        capture.record("kernel_launch", "early")
    session.flush()
    while not go.exists():  # the run stays open, incomplete, until the test says go
        time.sleep(0.05)
    for _ in range(7):
        capture.record("kernel_launch", "late")
"""


def test_watch_ingests_new_and_still_running_runs(tmp_path, good_run, env) -> None:
    watched = tmp_path / "watched"
    watched.mkdir()
    early = renamed_copy(good_run, tmp_path, "early")
    shutil.copytree(early, watched / early.name)  # there before the service starts
    with Server(tmp_path / "w.duckdb", "--watch", str(watched), "--idle", "1", env=env) as running:
        first = json.loads((early / "manifest.json").read_text())["run_id"]
        wait_until(lambda: first in run_ids(running), what="the run present at start")

        later = renamed_copy(good_run, tmp_path, "later")
        shutil.copytree(later, watched / "nested" / later.name)  # written after the start, one level down
        second = json.loads((later / "manifest.json").read_text())["run_id"]
        wait_until(lambda: second in run_ids(running), what="the run written after start")

        go = tmp_path / "go"
        live = subprocess.Popen([*TBPIPE[:1], "-c", LIVE_PROGRAM, str(watched / "live"), str(go)], env=env)
        try:

            def live_run():
                runs = ok(running, "/api/runs", label="suite=live")["runs"]
                return runs[0] if runs else None

            # Ingested while idle (perhaps first with fewer events, if the session was caught
            # before its first flush), not complete yet.
            incomplete = wait_until(
                lambda: (r := live_run()) and r["counts"] == {"kernel_launch": 5} and r,
                what="the run still being written",
            )
            assert incomplete["complete"] is False and live.poll() is None
            go.write_text("")
            assert live.wait(60) == 0
            complete = wait_until(lambda: (r := live_run()) and r["complete"] and r, what="the completed run")
            assert complete["counts"] == {"kernel_launch": 12} and complete["run_id"] == incomplete["run_id"]
        finally:
            if live.poll() is None:
                live.kill()
        # A job's outcomes are listed when the job ends, a little after its run is readable.
        status = wait_until(
            lambda: (s := ok(running, "/api/ingest")) and all(j["status"] == "done" for j in s["jobs"]) and s,
            what="every ingest job done",
        )
        statuses = [r["status"] for job in status["jobs"] for r in job["runs"]]
        assert "updated" in statuses and statuses.count("quarantined") == 0
        assert status["watch"]["folders"] == [str(watched)]
        # Each state was handed over once: no job ingested a run it had already loaded.
        assert "present" not in statuses
    assert "Traceback" not in running.output()


def test_watch_quarantines_a_damaged_run_once(tmp_path, good_run, env) -> None:
    watched = tmp_path / "watched"
    broken = renamed_copy(good_run, watched, "broken")
    (broken / "manifest.json").write_text("{not json")
    with Server(tmp_path / "q.duckdb", "--watch", str(watched), "--idle", "0.5", env=env) as running:
        job = wait_until(
            lambda: (j := ok(running, "/api/ingest")["jobs"]) and j[0]["status"] == "done" and j[0], what="a job"
        )
        assert job["runs"][0]["status"] == "quarantined" and "manifest is not JSON" in job["runs"][0]["reason"]
        # Rescans leave it alone until it changes.
        scans = ok(running, "/api/ingest")["watch"]["scans"]
        wait_until(lambda: ok(running, "/api/ingest")["watch"]["scans"] >= scans + 3, what="more scans")
        assert len(ok(running, "/api/ingest")["jobs"]) == 1


def test_many_requests_at_once_for_an_answer_not_kept(upload_server) -> None:
    """Requests waiting on one computation whose answer is not kept (a 404) each get their own answer."""
    import asyncio

    import httpx

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=upload_server.url, timeout=60) as client:
            return await asyncio.gather(*(client.get("/api/runs/no-such-run/sites") for _ in range(40)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [404] * 40
    assert all("no run" in r.json()["error"] for r in responses)
    assert "Traceback" not in upload_server.output()


def test_answers_are_kept_until_the_data_changes(upload_server, good_run, tmp_path) -> None:
    """The read API's answers are kept per database state: the same request again is served from the
    cache, an ingest makes every kept answer stale, and users' SQL is never kept."""
    first = get(upload_server, "/api/runs", limit=1000, order="oldest")
    second = get(upload_server, "/api/runs", limit=1000, order="oldest")
    assert first.status_code == second.status_code == 200
    assert second.headers["x-tbpipe-cache"] == "hit" and second.content == first.content
    assert "content-security-policy" in second.headers  # the service's headers on kept answers too
    response = upload(upload_server, tar_of(renamed_copy(good_run, tmp_path, "cached")))
    assert response.status_code == 201, response.text
    (run_id,) = response.json()["run_ids"]
    after = get(upload_server, "/api/runs", limit=1000, order="oldest")
    assert after.headers["x-tbpipe-cache"] == "miss"
    assert run_id in {r["run_id"] for r in after.json()["runs"]}
    assert run_id not in {r["run_id"] for r in first.json()["runs"]}
    # Errors are not kept; neither is SQL from users (it may read the clock or draw random numbers).
    missing = [get(upload_server, "/api/runs/no-such-run") for _ in range(2)]
    assert [m.status_code for m in missing] == [404, 404] and missing[1].headers["x-tbpipe-cache"] == "miss"
    draws = {query(upload_server, "SELECT random() AS r").json()["rows"][0][0] for _ in range(3)}
    assert len(draws) == 3
    # Each new state is read ahead once (warm.py): at the start, and after this ingest among others.
    runs_now = len(after.json()["runs"])

    def read_ahead_for_this_state() -> bool:
        found = [int(n) for n in re.findall(r"read ahead for (\d+) run\(s\)", upload_server.output())]
        return len(found) >= 2 and found[-1] == runs_now

    assert wait_until(read_ahead_for_this_state, 30, what="the new state read ahead")
