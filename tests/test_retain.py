"""`tbpipe retain`: old runs rolled up (events gone, counts kept) read exactly as before.

Five nights of two ranks are captured for real (a main thread and a loader thread, forward and
backward ops linked by autograd sequence numbers, a night whose code changed) and ingested once;
copies of that database are rolled up by the CLI, by a retain killed at its last moment, and by the
service on its schedule, and every report, site history and count export of the rolled-up runs is
compared with the same read of the database before.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import duckdb
import pytest
from conftest import TBPIPE
from test_gpu_activity import double_library, workload  # noqa: F401 - fixtures: a run with GPU activity, ingested

from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.retain import FolderPolicy, RetainPolicy, age_out_folders, retain
from tbpipe.pipeline.export import ExportFilter, export
from tbpipe.pipeline.reports.regression import ReportRequest, compare
from tbpipe.pipeline.serve import queries

# Night N, rank R: `softmax` launches vary by night (a window's band), night 4 on adds a kernel at
# the gemm site, backward ops (and a launch inside each) are linked to their forward ops.
WORKLOAD = """
import sys, threading
from tbpipe import capture


def gemms(night):
    for name in ["gemm"] * 3 + (["gemm_splitk"] if night >= 4 else []):
        capture.record("kernel_launch", name)  # the gemm site


def softmaxes(n):
    for _ in range(n):
        capture.record("kernel_launch", "softmax")  # the softmax site


def forward(step):
    capture.record("op", "aten::mm", seq=step, seq_thread=1)  # the forward site


def backward(step):
    capture.record("op", "MmBackward0", bwd_seq=step, fwd_thread=1, bwd_node="MmBackward0")  # the backward site
    capture.record("kernel_launch", "gemm_bwd")


def loader(n):
    for _ in range(n):
        capture.record("kernel_launch", "copy")  # on a thread of its own


for night in range(1, 6):
    for rank in range(2):
        labels = {"suite": "app", "commit": f"c{night}", "rank": str(rank)}
        with capture.session(sys.argv[1], labels=labels):
            capture.record("step", "train")
            gemms(night)
            softmaxes(4 + 4 * (night % 2) + rank)
            for step in range(3):
                forward(step)
            for step in range(3):
                backward(step)
            thread = threading.Thread(target=loader, args=(2 + rank,), name="loader")
            thread.start()
            thread.join()
"""

POLICY = RetainPolicy(keep_runs=2, by=("rank",))  # nights 4 and 5 keep their events


def tbpipe(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full = dict(os.environ, COLUMNS="200", **(env or {}))
    return subprocess.run([*TBPIPE, *args], capture_output=True, text=True, timeout=timeout, env=full)


def rows(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return query_rows(con, sql, params)
    finally:
        con.close()


def snapshot(db: Path) -> dict[str, tuple]:
    """Every table's row count and an order-independent hash of its rows."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        tables = [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE NOT temporary").fetchall()]
        return {t: con.execute(f"SELECT count(*), coalesce(sum(hash(x)), 0) FROM {t} x").fetchone() for t in tables}
    finally:
        con.close()


@pytest.fixture(scope="module")
def full(tmp_path_factory, symbol_cache) -> Path:
    """The ten runs captured and ingested: the database before any retain."""
    root = tmp_path_factory.mktemp("retain")
    script = root / "workload.py"
    script.write_text(WORKLOAD)
    runs = root / "runs"
    result = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    db = root / "full.duckdb"
    summary = ingest_runs([runs], IngestOptions(db_path=db, cache_dir=symbol_cache, progress=False, wait_s=30))
    assert summary.ingested == 10, summary.outcomes
    return db


def copy(db: Path, to: Path) -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(db, to)
    return to


@pytest.fixture(scope="module")
def rolled(full, tmp_path_factory) -> tuple[Path, str]:
    """A copy of the database rolled up by the CLI (nights 1-3), and what it printed."""
    db = copy(full, tmp_path_factory.mktemp("rolled") / "rolled.duckdb")
    result = tbpipe("retain", "--db", str(db), "--keep-runs", "2", "--by", "rank")
    assert result.returncode == 0, result.stdout + result.stderr
    return db, result.stdout


def run_ids(db: Path, rolled_up: bool) -> list[str]:
    condition = "IS NOT NULL" if rolled_up else "IS NULL"
    return [r[0] for r in rows(db, f"SELECT run_id FROM runs WHERE rolled_up_at {condition} ORDER BY run_number")]


# ------------------------------------------------------------------------------------------ reads alike


REPORTS = [
    ReportRequest(candidate="latest", window=4, group_by="commit"),  # a window of mostly rolled-up nights
    ReportRequest(candidate="latest:rank=0", window=4),
    ReportRequest(candidate="commit=c5", baseline="commit=c1"),  # one rolled-up baseline, a group
    ReportRequest(candidate="commit=c3", baseline="commit=c2"),  # both sides rolled up
    ReportRequest(candidate="commit=c4", baseline="commit=c3", site_of="forward"),
    ReportRequest(candidate="commit=c5", baseline="commit=c1", per=("step", "train")),
    ReportRequest(candidate="latest", window=3, group_by="commit", site_of="forward"),
]


def reads(db: Path, rolled_up: list[str]) -> dict:
    """Everything that reads counts, for the runs `rolled_up` and the reports over them."""
    out: dict = {}
    con = open_database(db, read_only=True)
    try:
        out["reports"] = [compare(con, request).to_json() for request in REPORTS]
        keys = [k for (k,) in query_rows(con, "SELECT site_key FROM sites ORDER BY site_key")]
        out["histories"] = {k: queries.site_history(con, k, 500) for k in keys}
        out["sites"] = {k: queries.site(con, k, 5) for k in keys}
        numbers = [
            n for (n,) in query_rows(con, "SELECT run_number FROM runs WHERE list_contains(?, run_id)", [rolled_up])
        ]
        chosen = f"run_number IN ({', '.join(map(str, numbers))})"
        for view in ("run_stack_counts", "run_site_counts", "run_thread_counts", "event_counts_at_forward",
                     "site_counts_at_forward"):  # fmt: skip
            out[view] = sorted(query_rows(con, f"SELECT * FROM {view} WHERE {chosen}"), key=repr)
        out["call_sites"] = sorted(query_rows(con, "SELECT * FROM call_sites"), key=repr)
        out["gpu_time_sites"] = sorted(query_rows(con, "SELECT * FROM gpu_time_sites"), key=repr)
        out["run pages"] = {r: queries.run_sites(con, r, None, None, 50, 0) for r in rolled_up}
        out["run pages, lead"] = lead_pages(con, db, rolled_up)
        out["kinds"] = queries.counts_by_kind(con, rolled_up)
        for fmt in ("pprof", "collapsed"):
            for runs in [(r,) for r in rolled_up] + [tuple(rolled_up)]:
                path = db.with_name(f"export-{len(out)}.{fmt}")
                export(con, ExportFilter(runs), fmt, path)
                out[f"{fmt} {runs}"] = path.read_bytes()
                path.unlink()
    finally:
        con.close()
    return out


def lead_pages(con, db: Path, run_ids: list[str]) -> dict:
    """The runs' pages as the service cuts them from a run's leading sites (kept by the roll-up for a
    rolled-up run), every kind's first page and a page past the first."""
    state = ("lead pages", str(db), time.monotonic())  # the service's per-state facts, this read's own
    kinds = [None, *(k for (k,) in query_rows(con, "SELECT DISTINCT kind FROM event_names ORDER BY kind"))]
    return {
        r: [queries.run_sites(con, r, kind, None, 5, offset, state) for kind in kinds for offset in (0, 5)]
        for r in run_ids
    }


def test_counts_read_the_same_before_and_after_retain(full, rolled) -> None:
    db, printed = rolled
    gone = run_ids(db, rolled_up=True)
    assert len(gone) == 6 and len(run_ids(db, rolled_up=False)) == 4
    assert "rolled up 6 runs" in printed and "events" in printed
    assert rows(db, "SELECT count(*) FROM event_rows WHERE run_number IN (SELECT run_number FROM runs "
                    "WHERE rolled_up_at IS NOT NULL)") == [(0,)]  # fmt: skip
    before, after = reads(full, gone), reads(db, gone)
    assert before["reports"][3]["sites"] and before["run_thread_counts"]
    # The rolled-up runs' pages came from the leads their roll-up kept.
    kept = rows(db, "SELECT count(DISTINCT run_number), count(*) FROM rolled_up_leads")[0]
    assert kept[0] == len(gone) and kept[1] == len(after["run_site_counts"])  # every site of these small runs
    assert all(any(page for page in pages) for pages in after["run pages, lead"].values())
    # The backward work moved to the forward line, and the loader thread's own samples.
    assert before["event_counts_at_forward"] != before["run_stack_counts"]
    assert len({row[2] for row in before["run_thread_counts"]}) >= 4  # two threads in each of two processes
    for key in before:
        assert after[key] == before[key], key


def test_sites_made_again_make_the_kept_leads_again(full, rolled, tmp_path) -> None:
    """New `user_code` rules site every stack again: the leads the roll-up kept are made again with
    the site counts (here from a table emptied by hand), and a rolled-up run's pages still read as
    those of the run with its events."""
    gone = run_ids(rolled[0], rolled_up=True)

    def pages(db: Path) -> dict:
        con = open_database(db, read_only=True)
        try:
            return lead_pages(con, db, gone)
        finally:
            con.close()

    leads = "SELECT * FROM rolled_up_leads ORDER BY run_number, place"
    kept = rows(rolled[0], leads)
    assert kept
    resited = [copy(full, tmp_path / "full.duckdb"), copy(rolled[0], tmp_path / "rolled.duckdb")]
    con = duckdb.connect(str(resited[1]))
    con.execute("DELETE FROM rolled_up_leads")
    con.close()
    for db in resited:
        result = tbpipe("ingest", "--db", str(db), "--user-code", f"!{full.parent}/")  # the workload's file
        assert result.returncode == 0, result.stdout + result.stderr
    assert rows(resited[1], "SELECT value FROM settings WHERE key = 'sited_with_rules'") != rows(
        rolled[0], "SELECT value FROM settings WHERE key = 'sited_with_rules'"
    )  # sited again
    assert rows(resited[1], leads) == kept
    assert pages(resited[1]) == pages(resited[0])


def test_kept_runs_keep_their_events_untouched(full, rolled) -> None:
    db, _ = rolled
    kept = run_ids(db, rolled_up=False)
    for table, key in (("event_rows", "run_number"), ("event_counts", "run_number"), ("site_counts", "run_number")):
        sql = f"SELECT * FROM {table} WHERE {key} IN (SELECT run_number FROM runs WHERE list_contains(?, run_id))"
        assert sorted(rows(db, sql, [kept]), key=repr) == sorted(rows(full, sql, [kept]), key=repr), table
    assert rows(db, "SELECT count(*) FROM event_rows")[0][0] > 0
    assert rows(db, "SELECT count(*) FROM rolled_up_counts")[0][0] > 0  # read from the roll-up, not from leftovers


def test_retain_again_changes_nothing_and_dry_run_changes_nothing(full, rolled, tmp_path) -> None:
    db, _ = rolled
    before = snapshot(db)
    again = tbpipe("retain", "--db", str(db), "--keep-runs", "2", "--by", "rank")
    assert again.returncode == 0, again.stderr
    assert "nothing to roll up" in again.stdout and "6 rolled up before" in again.stdout
    assert snapshot(db) == before

    fresh = copy(full, tmp_path / "dry.duckdb")
    untouched = snapshot(fresh)
    dry = tbpipe("retain", "--db", str(fresh), "--keep-runs", "2", "--by", "rank", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would roll up 6 runs" in dry.stdout and "would be freed" in dry.stdout
    assert all(run_id in dry.stdout for run_id in run_ids(db, rolled_up=True))
    assert snapshot(fresh) == untouched


KILLED_RETAIN = """
import sys, time
from pathlib import Path
from tbpipe.pipeline.db.retain import RetainHooks, RetainPolicy, retain

db, marker, release = sys.argv[1:4]


def pause():
    Path(marker).write_text("inside the transaction")
    deadline = time.monotonic() + 300
    while not Path(release).exists():
        if time.monotonic() > deadline:
            sys.exit("never released")
        time.sleep(0.02)


retain(db, RetainPolicy(keep_runs=2, by=("rank",)), hooks=RetainHooks(before_commit=pause))
"""


def test_a_killed_retain_loses_nothing(full, rolled, tmp_path) -> None:
    db = copy(full, tmp_path / "killed.duckdb")
    before = snapshot(db)
    script, marker = tmp_path / "killed_retain.py", tmp_path / "marker"
    script.write_text(KILLED_RETAIN)
    child = subprocess.Popen([sys.executable, str(script), str(db), str(marker), str(tmp_path / "release")])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the retain ended before its commit"
            assert time.monotonic() < deadline, "the retain never reached its commit"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)  # every change made, none committed
    finally:
        child.wait(30)
    assert snapshot(db) == before
    # The lock died with it; the next retain does the whole job, as the uninterrupted one did.
    result = retain(db, POLICY, wait_s=30)
    assert len(result.runs) == 6
    done, expected = snapshot(db), snapshot(rolled[0])
    assert {t: v for t, v in done.items() if t != "runs"} == {t: v for t, v in expected.items() if t != "runs"}
    assert rows(db, "SELECT run_id, rolled_up_at IS NOT NULL FROM runs ORDER BY ALL") == rows(
        rolled[0], "SELECT run_id, rolled_up_at IS NOT NULL FROM runs ORDER BY ALL"
    )


def test_what_needs_events_says_the_run_is_rolled_up(rolled, tmp_path) -> None:
    db, _ = rolled
    (first, last) = rows(db, "SELECT first_event_id, last_event_id FROM rolled_up_runs ORDER BY run_number LIMIT 1")[0]
    run_id = run_ids(db, rolled_up=True)[0]
    shown = tbpipe("show", "--db", str(db), "--event", str((first + last) // 2))
    assert shown.returncode == 2
    assert run_id in shown.stderr and "rolled up" in shown.stderr and "counts" in shown.stderr
    trace = tmp_path / "trace.json"
    refused = tbpipe("export", "--db", str(db), "--run", run_id, "-f", "chrome-trace", "-o", str(trace))
    assert refused.returncode == 2 and "rolled up" in refused.stderr and not trace.exists()
    kept = run_ids(db, rolled_up=False)[0]
    assert tbpipe("export", "--db", str(db), "--run", kept, "-f", "chrome-trace", "-o", str(trace)).returncode == 0
    listed = tbpipe("runs", "--db", str(db))
    assert listed.returncode == 0
    lines = {line.split()[1]: line for line in listed.stdout.splitlines() if line.startswith("│ 2")}
    assert len(lines) == 10  # each run's line: the day it started, and the day it was rolled up
    dated = {run_id for run_id, line in lines.items() if len(re.findall(r"\d{4}-\d\d-\d\d", line)) == 2}
    assert dated == set(run_ids(db, rolled_up=True))


# ------------------------------------------------------------------------------------------ the service


@pytest.fixture(scope="module")
def served(full, tmp_path_factory, symbol_cache):
    """`tbpipe serve` over a copy of the database, rolling it up on its schedule (at its start)."""
    from support.serve import Server, environment, wait_until

    root = tmp_path_factory.mktemp("served")
    db = copy(full, root / "served.duckdb")
    token = root / "token.txt"
    token.write_text("retain-test-token\n")
    args = ("--retain-keep-runs", "2", "--retain-by", "rank", "--token-file", str(token), "--max-upload-mb", "8")
    with Server(db, *args, env=environment(symbol_cache)) as server:
        import httpx

        def retained():
            jobs = httpx.get(server.url + "/api/ingest", timeout=30).json()["jobs"]
            return next((j for j in jobs if j["source"] == "retain" and j["status"] in ("done", "failed")), None)

        job = wait_until(retained, timeout_s=120, what="the scheduled retain")
        assert job["status"] == "done", job
        server.retain_job = job
        yield server
    assert "Traceback" not in server.output()


def test_the_service_rolls_up_on_its_schedule_and_lists_rolled_up_runs(served, full, rolled) -> None:
    import httpx

    assert served.retain_job["summary"].startswith("rolled up 6 runs")
    listed = httpx.get(served.url + "/api/runs", params={"limit": 100}, timeout=30).json()["runs"]
    assert len(listed) == 10
    assert {r["run_id"] for r in listed if r["rolled_up"]} == set(run_ids(rolled[0], rolled_up=True))
    con = open_database(full, read_only=True)
    try:
        for run in listed:
            pages = httpx.get(served.url + f"/api/runs/{run['run_id']}/sites", timeout=30).json()["sites"]
            assert pages == queries.run_sites(con, run["run_id"], None, None, 50, 0), run["run_id"]
            assert run["counts"] == queries.counts_by_kind(con, [run["run_id"]])[run["run_id"]]
        for (key,) in query_rows(con, "SELECT site_key FROM sites"):
            history = httpx.get(served.url + f"/api/sites/{key}/history", timeout=30).json()
            assert history == json.loads(json.dumps(queries.site_history(con, key, 500))), key
    finally:
        con.close()
    one = httpx.get(served.url + f"/api/runs/{listed[-1]['run_id']}", timeout=30).json()
    assert one["rolled_up"] and one["rolled_up_at"] and one["counts"]


def test_a_retain_between_two_requests_shows_on_the_kept_pages(full, tmp_path, symbol_cache) -> None:
    """Pages are kept per database state (serve/cache.py): after an upload and the scheduled retain
    that follows it, a run's page and the runs page show the run rolled up, not the page kept before."""
    import httpx
    from support.serve import Server, environment, wait_until
    from test_serve_cache import run_archive

    db = copy(full, tmp_path / "served.duckdb")
    (tmp_path / "token").write_text("retain-page-token\n")
    every = "0.001"  # hours: a retain every 3.6 s, the first when the service starts
    args = (
        "--retain-keep-runs",
        "4",
        "--retain-by",
        "rank",
        "--retain-every",
        every,
        "--token-file",
        str(tmp_path / "token"),
    )
    with Server(db, *args, env=environment(symbol_cache)) as server:

        def get(path: str, **params) -> httpx.Response:
            response = httpx.get(server.url + path, params=params, timeout=60)
            assert response.status_code == 200, response.text
            return response

        def retains() -> list[dict]:
            jobs = get("/api/ingest").json()["jobs"]  # newest first
            return [j for j in jobs if j["source"] == "retain" and j["status"] == "done"]

        wait_until(retains, timeout_s=120, what="the first scheduled retain")
        night2 = get("/api/runs", label="rank=0", order="oldest").json()["runs"][1]["run_id"]
        before = [get(f"/runs/{night2}") for _ in range(2)]
        assert 'class="rolled-up"' not in before[0].text and "x-tbpipe-cache" in before[1].headers
        archive = run_archive(tmp_path, {"suite": "app", "commit": "c6", "rank": "0"}, "retained_kernel")
        uploaded = httpx.post(
            server.url + "/api/runs", params={"wait": 120}, content=archive,
            headers={"authorization": "Bearer retain-page-token"}, timeout=180,
        )  # fmt: skip
        assert uploaded.status_code == 201, uploaded.text
        (run_id,) = uploaded.json()["run_ids"]
        assert run_id in get("/").text
        # The next retain keeps night 2's rank 0 no longer (five newer runs of rank 0 now).
        wait_until(
            lambda: any(j["summary"].startswith("rolled up 1 run ") for j in retains()), timeout_s=120,
            what="a retain after the upload",
        )  # fmt: skip
        after = get(f"/runs/{night2}")
        assert 'class="rolled-up"' in after.text and after.content != before[0].content
        row = next(line for line in get("/").text.split('<tr class="run">') if night2 in line)
        assert "rolled up" in row
    assert "Traceback" not in server.output()


def _zeros_archive(megabytes: int) -> bytes:
    """A tar.gz of one run-like folder whose only part is `megabytes` MB of zeros: a few tens of kB."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        info = tarfile.TarInfo("run/events-000001.parquet")
        info.size = megabytes << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    return packed.getvalue()


def test_an_upload_past_the_expansion_cap_is_refused_and_leaves_nothing(served) -> None:
    import httpx

    archive = _zeros_archive(24)  # under the unpacked limit (32 MiB), far past 10 times its own size
    assert len(archive) < 1 << 20
    response = httpx.post(
        served.url + "/api/runs",
        content=archive,
        headers={"authorization": "Bearer retain-test-token"},
        timeout=60,
    )
    assert response.status_code == 413, response.text
    assert "10 times the archive" in response.json()["error"] and "nothing was kept" in response.json()["error"]
    uploads = served.db.with_name(served.db.name + ".uploads")
    assert [p for p in uploads.rglob("*") if p.is_file()] == []


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium package is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium)
        try:
            yield launched
        finally:
            launched.close()


ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.mark.default_interpreter_only
def test_rolled_up_runs_and_their_pages_in_the_browser(browser, served) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("response", lambda r: problems.append(f"{r.status}: {r.url}") if r.status >= 400 else None)
    try:
        page.goto(served.url + "/")
        rows_ = page.locator("#runs tr.run")
        assert rows_.count() == 10
        marked = [i for i in range(10) if "rolled up" in rows_.nth(i).inner_text()]
        assert marked == [4, 5, 6, 7, 8, 9]  # newest first: nights 3 to 1 are rolled up
        page.screenshot(path=str(ARTIFACTS / "retain-runs.png"), full_page=True)

        rows_.nth(9).locator("a.run-link").click()  # the oldest run
        page.wait_for_url("**/runs/**")
        assert "rolled up" in page.locator("dl.grid").inner_text()
        page.wait_for_selector("#run-icicle .icicle-node[data-name='softmaxes']")
        kernels = page.locator("#sites-kernel_launch tr.site")
        assert kernels.first.inner_text().startswith("softmax")  # 8 launches on night 1, rank 0: the heaviest
        page.screenshot(path=str(ARTIFACTS / "retain-run.png"), full_page=True)

        kernels.first.locator("a.site-link").click()
        page.wait_for_url("**/sites/**")
        assert page.locator("#history tr").count() == 1 + 10  # every night's runs, rolled up or not
        assert page.locator(".history svg rect").count() == 10
        assert page.locator("details.traceback").count() >= 1
        page.screenshot(path=str(ARTIFACTS / "retain-site.png"), full_page=True)
    finally:
        page.close()
    assert problems == []


# ------------------------------------------------------------------------------------------ folders


def test_old_quarantined_uploads_and_ingested_run_folders_are_aged_out(full, tmp_path) -> None:
    db = copy(full, tmp_path / "folders.duckdb")
    runs = sorted(Path(r[0]) for r in rows(db, "SELECT source_dir FROM runs"))
    watched = tmp_path / "watched"
    shutil.copytree(runs[0].parent, watched)  # the runs, as a watched folder holds them
    con = duckdb.connect(str(db))
    try:  # the runs as ingested from there, a week ago
        con.execute("UPDATE runs SET source_dir = replace(source_dir, ?, ?)", [str(runs[0].parent), str(watched)])
        con.execute("UPDATE runs SET ingested_at = now() - INTERVAL 7 DAYS")
    finally:
        con.close()
    moved = watched / runs[1].name
    (moved / "events-000009.parquet").write_bytes((moved / "manifest.json").read_bytes())  # written since: kept
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["files"].setdefault("events", []).append("events-000009.parquet")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    uploads = tmp_path / "folders.duckdb.uploads"
    old, recent = uploads / "quarantine" / "20260101T000000-aaaa", uploads / "quarantine" / "20261206T000000-bbbb"
    for folder in (old, recent):
        folder.mkdir(parents=True)
        (folder / "reason.txt").write_text("damaged\n")
    os.utime(old / "reason.txt", (time.time() - 10 * 86400,) * 2)

    policy = FolderPolicy(uploads, 5, (watched,), 3)
    con = open_database(db, read_only=True)
    try:
        dry = age_out_folders(con, policy, dry_run=True)
    finally:
        con.close()
    assert sorted(a.what for a in dry) == ["ingested run folder"] * 9 + ["quarantined upload"]
    assert old.exists() and len(list(watched.iterdir())) == 10
    done = tbpipe(
        "retain", "--db", str(db), "--keep-quarantined-days", "5", "--delete-ingested-runs-after-days", "3",
        "--runs-dir", str(watched),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("deleted ingested run folder") == 9 and "deleted quarantined upload" in done.stdout
    assert not old.exists() and recent.exists()
    assert sorted(p.name for p in watched.iterdir()) == [moved.name]
    assert all(r.exists() for r in runs)  # not under --runs-dir: never touched
    # Nothing is old enough under a longer limit; and the rule needs its folders.
    again = age_out_folders(None, FolderPolicy(uploads=uploads, keep_quarantined_days=30))
    assert again == []
    refused = tbpipe("retain", "--db", str(db), "--delete-ingested-runs-after-days", "3")
    assert refused.returncode == 2 and "--runs-dir" in refused.stderr


# ------------------------------------------------------------------------------------------ the lake


@pytest.fixture(scope="module")
def lakes(full, rolled, tmp_path_factory) -> tuple[Path, Path]:
    """(the full database exported and then rolled up as a lake, the rolled-up database exported)."""
    from tbpipe.pipeline.lake.export import export_database

    root = tmp_path_factory.mktemp("lakes")
    for db, lake in ((full, root / "retained"), (rolled[0], root / "exported")):
        export_database(db, lake)
    result = tbpipe("retain", "--lake", str(root / "retained"), "--keep-runs", "2", "--by", "rank")
    assert result.returncode == 0 and "rolled up 6 runs" in result.stdout, result.stdout + result.stderr
    return root / "retained", root / "exported"


LAKE_READS = {
    view: f"SELECT * FROM {view}"
    for view in ("run_stack_counts", "run_site_counts", "run_thread_counts", "call_sites", "event_counts_at_forward")
}
LAKE_READS["runs"] = "SELECT run_id, rolled_up_at IS NOT NULL FROM runs"


def test_the_lake_rolls_up_as_the_database_does(lakes, rolled) -> None:
    from tbpipe.pipeline.lake import store

    retained, exported = lakes
    for lake in lakes:
        assert len(list((lake / "event_rows").iterdir())) == 4 and len(list((lake / "rolled_up_counts").iterdir())) == 6
    cons = [store.connect(lake) for lake in lakes]
    try:
        for name, sql in LAKE_READS.items():
            answers = [sorted(con.execute(sql).fetchall(), key=repr) for con in cons]
            assert answers[0] == answers[1] and answers[0], name
        db_sites = sorted(r[1:] for r in rows(rolled[0], "SELECT run_id, kind, name, site_key, events FROM call_sites"))
        assert sorted(cons[0].execute("SELECT kind, name, site_key, events FROM call_sites").fetchall()) == db_sites
    finally:
        for con in cons:
            con.close()
    from tbpipe.pipeline.lake.retain import retain_lake

    before = sorted(str(p.relative_to(retained)) for p in retained.rglob("*.parquet"))
    assert (
        retain_lake(retained, POLICY).runs == []
        and sorted(str(p.relative_to(retained)) for p in retained.rglob("*.parquet")) == before
    )


def test_spark_reads_a_rolled_up_lake_as_duckdb_does(lakes, spark) -> None:
    from tbpipe.pipeline.lake import store
    from tbpipe.pipeline.lake.sparksql import register_lake

    retained = lakes[0]
    register_lake(spark, retained)
    con = store.connect(retained)
    try:
        for name in ("run_thread_counts", "call_sites"):  # call_sites reads run_site_counts
            in_duckdb = sorted(con.execute(LAKE_READS[name]).fetchall(), key=repr)
            in_spark = sorted((tuple(row) for row in spark.sql(LAKE_READS[name]).collect()), key=repr)
            assert in_spark == in_duckdb and in_duckdb, name
    finally:
        con.close()


# ------------------------------------------------------------------------------------------ GPU time


GPU_READS = {
    "gpu_time_sites": "SELECT * FROM gpu_time_sites",
    "memcpy_sites": "SELECT * FROM memcpy_sites",
    "stack_gpu_time": "SELECT * FROM stack_gpu_time",
    "call_sites": "SELECT * FROM call_sites",
}


def test_gpu_time_per_site_outlives_the_events(workload, tmp_path) -> None:  # noqa: F811
    _result, run, con = workload
    (source,) = [row[2] for row in con.execute("PRAGMA database_list").fetchall() if row[2]]
    db = copy(Path(source), tmp_path / "gpu.duckdb")
    before = {name: sorted(rows(db, sql), key=repr) for name, sql in GPU_READS.items()}
    assert before["gpu_time_sites"] and rows(db, "SELECT count(*) FROM gpu_activity")[0][0] > 0
    result = retain(db, RetainPolicy(keep_runs=0), wait_s=30)
    assert [r.run_id for r in result.runs] == [run.manifest["run_id"]] and result.runs[0].gpu_records > 0
    assert rows(db, "SELECT count(*) FROM gpu_activity") == [(0,)] and rows(
        db, "SELECT count(*) FROM event_gpu_time"
    ) == [(0,)]
    assert {name: sorted(rows(db, sql), key=repr) for name, sql in GPU_READS.items()} == before
