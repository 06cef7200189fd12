"""The service's pages kept per database state (`serve/cache.py`): a real `tbpipe serve` (uvicorn in a
child process) over the nights' database, every request over HTTP; the `x-tbpipe-cache` header says
whether an answer was computed for a request ("miss") or replayed ("hit"). The bounds on what is kept
are checked on the middleware itself, over a small ASGI app of its own."""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
from pathlib import Path

import httpx
import pytest
from support.serve import Server, environment, nights_database

from tbpipe import capture
from tbpipe.pipeline.rawrun import find_run_dirs
from tbpipe.pipeline.serve.cache import CACHE_HEADER, ResponseCache

# The pages are what these check; the interpreter's version changes nothing of them.
pytestmark = pytest.mark.default_interpreter_only

TOKEN = "page-cache-token-0123456789"
HEADER = CACHE_HEADER.decode()


@pytest.fixture(scope="module")
def env(symbol_cache) -> dict[str, str]:
    return environment(symbol_cache)


@pytest.fixture(scope="module")
def server(tmp_path_factory, env):
    """A service over a copy of the nights' database that takes uploads (an ingest between requests)."""
    root = tmp_path_factory.mktemp("page-cache")
    db = root / "served.duckdb"
    shutil.copy(nights_database(tmp_path_factory.getbasetemp(), env), db)
    (root / "token").write_text(TOKEN + "\n")
    with Server(db, "--token-file", str(root / "token"), env=env) as running:
        yield running
    assert "Traceback" not in running.output()


def get(server: Server, path: str) -> httpx.Response:
    return httpx.get(server.url + path, timeout=60)


def a_site(server: Server) -> str:
    """The heaviest site of the fourth night (whichever runs the tests uploaded besides)."""
    (night4,) = get(server, "/api/runs?label=commit%3Dc4").json()["runs"]
    return get(server, f"/api/runs/{night4['run_id']}/sites?limit=1").json()["sites"][0]["site_key"]


def burst(server: Server, path: str, count: int) -> list[httpx.Response]:
    async def all_at_once() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client.get(path) for _ in range(count)))

    return asyncio.run(all_at_once())


def test_a_page_asked_for_at_once_is_rendered_once(server) -> None:
    """Forty requests at once for a page nobody asked for yet: one rendering, the others wait for it."""
    path = f"/sites/{a_site(server)}?frames=all"
    responses = burst(server, path, 40)
    assert [r.status_code for r in responses] == [200] * 40
    assert sorted(r.headers[HEADER] for r in responses) == ["hit"] * 39 + ["miss"]
    assert len({r.content for r in responses}) == 1
    assert "text/html" in responses[0].headers["content-type"]
    again = get(server, path)
    assert again.headers[HEADER] == "hit" and again.content == responses[0].content
    assert "content-security-policy" in again.headers  # the service's headers on kept pages too


def test_the_key_separates_paths_queries_and_focus_modes(server) -> None:
    site = a_site(server)
    pages = {}
    for path in (f"/sites/{site}", f"/sites/{site}?frames=native", "/?label=commit%3Dc1", "/?label=commit%3Dc2"):
        first, second = get(server, path), get(server, path)
        assert first.status_code == second.status_code == 200, first.text
        assert second.headers[HEADER] == "hit" and second.content == first.content
        pages[path] = first.text
    assert len(set(pages.values())) == len(pages)  # each its own page
    assert 'data-mode="native" class="on"' in pages[f"/sites/{site}?frames=native"]
    assert 'data-mode="native" class="on"' not in pages[f"/sites/{site}"]
    assert "commit=c1" in pages["/?label=commit%3Dc1"] and "1 run with" in pages["/?label=commit%3Dc1"]


@pytest.mark.parametrize(
    "path",
    ["/sql", "/sql?sql=SELECT%201", "/api", "/static/tbpipe.css", "/api/ingest", "/api/query?sql=SELECT%201"],
)
def test_forms_documents_and_files_are_not_kept(server, path) -> None:
    """What is not a function of the data passes by the cache: no x-tbpipe-cache header at all."""
    for _ in range(2):
        response = get(server, path)
        assert response.status_code == 200, response.text
        assert HEADER not in response.headers


def test_errors_and_writes_are_not_kept(server) -> None:
    missing = [get(server, "/runs/no-such-run") for _ in range(2)]
    assert [m.status_code for m in missing] == [404, 404]
    assert [m.headers[HEADER] for m in missing] == ["miss", "miss"]
    refused = httpx.post(server.url + "/api/runs", content=b"not an archive", timeout=60)
    assert refused.status_code == 401 and HEADER not in refused.headers
    wrong_mode = [get(server, "/?frames=sideways"), get(server, f"/sites/{a_site(server)}?frames=sideways")]
    assert wrong_mode[1].status_code == 400 and wrong_mode[1].headers[HEADER] == "miss"


def run_archive(root: Path, labels: dict[str, str], kernel: str) -> bytes:
    """A run of five launches of `kernel`, captured for real and packed for an upload (tar.gz)."""
    out = root / "runs"
    with capture.session(out, labels=labels):
        for _ in range(5):
            capture.record("kernel_launch", kernel)
    (run_dir,) = find_run_dirs([out])
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        tar.add(run_dir, arcname=run_dir.name)
    return packed.getvalue()


def test_an_ingest_between_two_requests_shows_the_new_run(server, tmp_path) -> None:
    before = [get(server, "/"), get(server, "/")]
    assert before[1].headers[HEADER] == "hit"
    archive = run_archive(tmp_path, {"suite": "app", "commit": "c5"}, "kept_page_kernel")
    response = httpx.post(
        server.url + "/api/runs",
        params={"wait": 120},
        content=archive,
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=180,
    )
    assert response.status_code == 201, response.text
    (run_id,) = response.json()["run_ids"]
    assert run_id not in before[1].text
    after = get(server, "/")
    assert after.headers[HEADER] == "miss" and run_id in after.text
    page = get(server, f"/runs/{run_id}")
    assert page.status_code == 200 and "kept_page_kernel" in page.text
    assert get(server, "/").headers[HEADER] == "hit"  # kept again, for the new state


# ------------------------------------------------------------------------------------------ bounds


def _pages(sizes: dict[str, int], no_store: tuple[str, ...] = ()):
    """An ASGI app answering `/NAME` with as many bytes as `sizes` says (saying `Cache-Control:
    no-store` for the names in `no_store`); counts what it rendered."""
    rendered: list[str] = []

    async def app(scope, receive, send) -> None:
        name = scope["path"].lstrip("/")
        rendered.append(name)
        headers = [(b"content-type", b"text/html")]
        if name in no_store:
            headers.append((b"Cache-Control", b"private, no-store"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"x" * sizes[name]})

    return app, rendered


def _ask(cache: ResponseCache, path: str) -> str | None:
    """One GET through the middleware; what it said of the cache."""
    said: list[str] = []

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            said.extend(v.decode() for k, v in message["headers"] if k == CACHE_HEADER)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": []}
    asyncio.run(cache(scope, receive, send))
    return said[0] if said else None


def test_what_is_kept_is_bounded_in_answers_and_bytes() -> None:
    app, rendered = _pages({"runs/a": 10, "runs/b": 10, "runs/c": 10, "runs/big": 700, "sites/s": 300})
    state = ("db", 1)
    cache = ResponseCache(app, lambda: state, max_bytes=1000, max_entries=3)
    assert [_ask(cache, p) for p in ("/runs/a", "/runs/b", "/runs/c", "/runs/a")] == ["miss"] * 3 + ["hit"]
    assert _ask(cache, "/sites/s") == "miss"  # a fourth answer: the least recently used (b) goes
    assert [_ask(cache, p) for p in ("/runs/a", "/runs/c", "/sites/s")] == ["hit"] * 3
    assert _ask(cache, "/runs/b") == "miss"  # and a goes
    assert _ask(cache, "/runs/big") == "miss"  # c goes (four answers), then s (1,010 bytes)
    assert [_ask(cache, p) for p in ("/runs/big", "/runs/b")] == ["hit", "hit"]
    assert [_ask(cache, p) for p in ("/sites/s", "/runs/a")] == ["miss", "miss"]
    assert rendered.count("sites/s") == 2 and rendered.count("runs/big") == 1 and rendered.count("runs/c") == 1
    state = ("db", 2)  # new data: nothing kept answers for it
    assert _ask(cache, "/runs/a") == "miss"
    pages_off = ResponseCache(app, lambda: state, pages=False)
    assert [_ask(pages_off, "/runs/a") for _ in range(2)] == [None, None]  # passed by, not kept


def test_an_answer_that_says_no_store_is_not_kept() -> None:
    """The runs page says `no-store` while an ingest runs (it says so on the page): never kept."""
    app, rendered = _pages({"": 10, "runs/a": 10}, no_store=("",))
    cache = ResponseCache(app, lambda: ("db", 1))
    assert [_ask(cache, "/") for _ in range(3)] == ["miss"] * 3
    assert [_ask(cache, "/runs/a") for _ in range(2)] == ["miss", "hit"]
    assert rendered == ["", "", "", "runs/a"]
