"""tbpipe serve's pages in headless Chromium (Debian's package, driven by Playwright with its
executable): a real server, real runs; no console errors; screenshots kept in test-artifacts/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.browser import regressions_fit_the_page, tracebacks_show_whole_lines
from support.serve import Server, environment, line_of, nights_database, program_v2

# Chromium renders the pages: what these check does not depend on the Python version.
pytestmark = pytest.mark.default_interpreter_only

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(scope="module")
def server(tmp_path_factory, symbol_cache):
    env = environment(symbol_cache)
    db = nights_database(tmp_path_factory.getbasetemp(), env)
    with Server(db, env=env) as running:
        yield running
    assert "Traceback" not in running.output()


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


@pytest.fixture
def page(browser, server):
    """A page that records console errors, uncaught exceptions and failed requests."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
    page.on("response", lambda r: problems.append(f"{r.status}: {r.url}") if r.status >= 400 else None)
    page.problems = problems
    yield page
    page.close()
    assert problems == []


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_drill_from_runs_into_a_site_and_its_traceback(page, server) -> None:
    page.goto(server.url + "/")
    rows = page.locator("#runs tr.run")
    assert rows.count() == 4
    assert "commit=c4" in rows.first.inner_text()  # newest first
    shot(page, "serve-runs.png")
    page.locator("#runs a", has_text="commit=c2").first.click()
    page.wait_for_url("**/?label=commit%3Dc2")
    assert page.locator("#runs tr.run").count() == 1
    page.goto(server.url + "/")

    rows.first.locator("a.run-link").click()
    page.wait_for_url("**/runs/**")
    page.wait_for_selector("#run-icicle .icicle-node")
    kernels = page.locator("#sites-kernel_launch tr.site")
    assert kernels.first.inner_text().startswith("softmax")  # 8 launches: the heaviest
    shot(page, "serve-run.png")

    kernels.first.locator("a.site-link").click()
    page.wait_for_url("**/sites/**")
    heading = page.locator("h1").inner_text()
    # Named as in every checkout (relative to the import root), at its line in the newest run.
    assert heading == f"Call site app.py:{line_of(program_v2(), 'the softmax site')}"
    newest = page.locator("dt:text-is('newest run') + dd").inner_text()
    assert newest.endswith(f"build-4/repo/app.py:{line_of(program_v2(), 'the softmax site')}")
    assert page.locator("#history tr").count() == 1 + 4
    first = page.locator("details.traceback").first
    assert first.locator(".frame.python").first.is_visible()  # the heaviest stack is open
    assert first.locator(".frame.folded").count() == 1  # the native start-up, folded (program mode)
    assert "softmaxes" in first.locator(".frame.python").all_inner_texts()[0] or any(
        "softmaxes" in t for t in first.locator(".frame.python").all_inner_texts()
    )
    assert page.locator(".history svg rect").count() == 4
    assert tracebacks_show_whole_lines(page)
    shot(page, "serve-site.png")

    page.locator("a", has_text="kernel_launch:softmax").click()
    page.wait_for_url("**/kernels/softmax")
    page.wait_for_selector("#callers-icicle .icicle-node")
    assert page.locator("#callers-icicle .icicle-node[data-depth='0']").get_attribute("data-name") == "softmax"
    assert page.locator("#callers-icicle .icicle-node[data-name='softmaxes']").count() >= 1
    shot(page, "serve-kernel.png")


def test_icicle_zooms_on_click(page, server) -> None:
    page.goto(server.url + "/")
    page.locator("#runs tr.run a.run-link").first.click()
    page.wait_for_selector("#run-icicle .icicle-node")
    icicle = page.locator("#run-icicle")
    assert icicle.get_attribute("data-focus") == "all events"
    target = icicle.locator(".icicle-node[data-name='softmaxes']").first
    narrow = target.bounding_box()["width"]
    target.click()
    assert icicle.get_attribute("data-focus") == "softmaxes"
    zoomed = target.bounding_box()["width"]
    canvas = icicle.locator(".icicle-canvas").bounding_box()["width"]
    assert zoomed > narrow and abs(zoomed - canvas) < 2  # the clicked box fills the width
    # Boxes outside the zoomed function are hidden; its callers stay as a full-width chain.
    assert icicle.locator(".icicle-node[data-name='gemms']").first.is_hidden()
    assert icicle.locator(".icicle-node[data-name='main']").first.is_visible()
    assert "softmaxes" in icicle.locator(".icicle-crumb").inner_text()
    shot(page, "serve-run-zoomed.png")
    icicle.locator(".icicle-reset").click()
    assert icicle.get_attribute("data-focus") == "all events"
    assert icicle.locator(".icicle-node[data-name='gemms']").first.is_visible()


def test_comparison_page_shows_the_flagged_sites(page, server) -> None:
    page.goto(server.url + "/compare")
    page.fill("#candidate", "commit=c4")
    page.fill("#baseline", "commit=c3")
    page.locator("#compare-form button").click()
    page.wait_for_selector("#verdict")
    assert page.inner_text("#verdict").startswith("3 regressions (2 new, 1 increased)")
    flagged = page.locator("#regressions tr.regression")
    assert flagged.count() == 3
    names = {flagged.nth(i).locator("td").nth(2).inner_text() for i in range(3)}
    assert names == {"softmax", "layernorm", "gemm_splitk"}
    flagged.first.locator("summary").click()
    assert flagged.first.locator(".frame.python").first.is_visible()
    assert regressions_fit_the_page(page) and tracebacks_show_whole_lines(page)
    page.wait_for_selector("#diff-icicle .icicle-node")
    icicle = page.locator("#diff-icicle")
    layernorm = icicle.locator(".icicle-node[data-name='layernorm']").first
    assert "baseline: 0" in layernorm.get_attribute("title")  # a new path, coloured as more
    assert page.locator("svg.chart rect").count() >= 3
    shot(page, "serve-compare.png")
    layernorm.click()
    assert icicle.get_attribute("data-focus") == "layernorm"


def test_sql_page_runs_canned_queries_and_shows_refusals(page, server) -> None:
    page.goto(server.url + "/sql")
    page.locator("button[data-canned]", has_text="Top kernel-launch sites").click()
    page.wait_for_selector("#sql-result")
    header = page.locator("#sql-result tr").first.inner_text()
    assert "launches" in header
    # The four nights ran from checkouts of their own: their softmax launches are one site, 20 launches.
    assert page.locator("#sql-result tr").nth(1).inner_text().split() == [
        "softmax",
        "softmaxes",
        "app.py",
        "13",
        "4",
        "20",
    ]
    shot(page, "serve-sql.png")
    page.fill("#sql", "COPY runs TO '/tmp/tbpipe-serve-copy.csv'")
    page.locator("#sql-form button[type=submit]").click()
    page.wait_for_selector("#sql-error")
    assert "only SELECT queries run here" in page.inner_text("#sql-error")
    assert not Path("/tmp/tbpipe-serve-copy.csv").exists()
    # The refused query is a 403 by design, which the browser also logs: not a page problem.
    page.problems[:] = [p for p in page.problems if "/api/query" not in p and "status of 403" not in p]


def test_api_page_and_error_pages(page, server) -> None:
    page.goto(server.url + "/api")
    assert page.locator("#endpoints tr").count() > 10
    response = page.goto(server.url + "/sites/0000000000000000")
    assert response.status == 404
    assert "no call site" in page.inner_text("#error")
    page.problems[:] = [p for p in page.problems if "/sites/0000000000000000" not in p and "status of 404" not in p]
