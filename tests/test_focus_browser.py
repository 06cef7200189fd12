"""Focus modes and search in headless Chromium (Debian's package, driven by Playwright): the run
page's icicle in each mode, its counts, the mode in the URL, search, and the site page's tracebacks.
Screenshots of the modes are kept in test-artifacts/."""

from __future__ import annotations

import pytest
import test_serve_browser as served

# The service on the four nights, Chromium, and a page that fails the test on a console error.
server, browser, page = served.server, served.browser, served.page
ARTIFACTS = served.ARTIFACTS

pytestmark = pytest.mark.default_interpreter_only

MODES = ("program", "python", "native", "all")


def newest_run_page(page, server, mode: str | None = None) -> None:
    page.goto(server.url + "/")
    href = page.locator("#runs tr.run a.run-link").first.get_attribute("href")
    page.goto(server.url + href + (f"?frames={mode}" if mode else ""))
    page.wait_for_selector("#run-icicle .icicle-node")


def boxes(page, depth: int) -> list[tuple[str, str, float]]:
    """(kind, name, events) of the icicle's boxes at `depth`."""
    return page.eval_on_selector_all(
        f"#run-icicle .icicle-node[data-depth='{depth}']",
        "nodes => nodes.map(n => [n.dataset.kind, n.dataset.name, Number(n.dataset.value)])",
    )


def events_by_leaf(page) -> dict[str, float]:
    leaves: dict[str, float] = {}
    for name, value in page.eval_on_selector_all(
        "#run-icicle .icicle-node.event", "nodes => nodes.map(n => [n.dataset.name, Number(n.dataset.value)])"
    ):
        leaves[name] = leaves.get(name, 0) + value
    return leaves


def switch(page, mode: str) -> None:
    icicle = page.locator("#run-icicle")
    icicle.locator(f".icicle-modes button[data-mode='{mode}']").click()
    page.wait_for_function(
        "mode => document.querySelector('#run-icicle').dataset.frames === mode"
        " && document.querySelector('#run-icicle .icicle-modes button.on')?.dataset.mode === mode",
        arg=mode,
    )


def test_program_mode_starts_at_the_program_and_modes_keep_counts(page, server) -> None:
    newest_run_page(page, server)
    icicle = page.locator("#run-icicle")
    assert icicle.get_attribute("data-frames") == "program"
    # Everything above the program folds into one row; the program's first frame is right below it.
    assert [(k, n) for k, n, _ in boxes(page, 1)] == [("folded", "[start-up]")]
    assert [(k, n) for k, n, _ in boxes(page, 2)] == [("python", "<module>")]
    assert icicle.locator(".icicle-node[data-depth='2']").get_attribute("title").split("\n")[1].startswith("app.py")
    total = float(icicle.get_attribute("data-total"))
    leaves = events_by_leaf(page)
    assert total == 16 and sum(leaves.values()) == total
    page.screenshot(path=str(ARTIFACTS / "focus-program.png"), full_page=True)

    for mode in ("all", "python", "native", "program"):
        switch(page, mode)
        assert page.url.endswith(f"?frames={mode}") or (mode == "program" and "frames=" not in page.url)
        assert float(icicle.get_attribute("data-total")) == total
        assert events_by_leaf(page) == leaves  # folding never changes a count
        if mode == "all":
            outermost = {n for _, n, _ in boxes(page, 1)}
            assert outermost == {"_start"} and "Py_BytesMain" in {n for _, n, _ in boxes(page, 4)}
        if mode == "python":
            assert [n for _, n, _ in boxes(page, 1)] == ["<module>"]
            assert page.locator("#run-icicle .icicle-node.native").count() == 0
        if mode == "native":
            assert page.locator("#run-icicle .icicle-node.python").count() == 0
        if mode != "program":
            page.screenshot(path=str(ARTIFACTS / f"focus-{mode}.png"), full_page=True)

    # The mode is in the URL: a page opened with it shows it.
    newest_run_page(page, server, "native")
    assert icicle.get_attribute("data-frames") == "native"
    assert icicle.locator(".icicle-modes button.on").get_attribute("data-mode") == "native"


def test_search_highlights_frames_and_their_share(page, server) -> None:
    newest_run_page(page, server)
    icicle = page.locator("#run-icicle")
    icicle.locator(".icicle-search").fill("softmax")
    matched = icicle.locator(".icicle-node.match")
    assert {matched.nth(i).get_attribute("data-name") for i in range(matched.count())} == {"softmaxes", "softmax"}
    # softmaxes runs 8 of the night's 16 events; the softmax leaves under it are not counted again.
    assert icicle.get_attribute("data-match-share") == "50.0"
    assert icicle.locator(".icicle-found").inner_text() == "2 boxes, 50.0% of events (8)"
    colour = matched.first.evaluate("n => getComputedStyle(n).backgroundColor")
    unmatched = icicle.locator(".icicle-node[data-name='gemms']").first.evaluate(
        "n => getComputedStyle(n).backgroundColor"
    )
    assert colour != unmatched
    page.screenshot(path=str(ARTIFACTS / "focus-search.png"), full_page=True)
    # The search survives a change of mode.
    switch(page, "all")
    assert icicle.locator(".icicle-search").input_value() == "softmax"
    assert icicle.get_attribute("data-match-share") == "50.0"
    icicle.locator(".icicle-search").fill("no such function")
    assert icicle.locator(".icicle-node.match").count() == 0
    assert icicle.locator(".icicle-found").inner_text() == "no match"


def test_site_tracebacks_follow_the_mode(page, server) -> None:
    newest_run_page(page, server)
    page.locator("#sites-kernel_launch a.site-link").first.click()
    page.wait_for_url("**/sites/**")
    traceback = page.locator("details.traceback").first
    assert traceback.locator(".frame.folded").count() == 1
    assert "frames of process and interpreter start-up" in traceback.locator(".frame.folded").inner_text()
    program_native = traceback.locator(".frame.native").count()
    page.screenshot(path=str(ARTIFACTS / "focus-site-program.png"), full_page=True)
    page.locator(".focus-modes a[data-mode='all']").click()
    page.wait_for_url("**?frames=all")
    traceback = page.locator("details.traceback").first
    assert traceback.locator(".frame.folded").count() == 0
    assert traceback.locator(".frame.native").count() > program_native
    assert page.locator(".focus-modes a.on").get_attribute("data-mode") == "all"
    page.locator(".focus-modes a[data-mode='python']").click()
    page.wait_for_url("**?frames=python")
    assert page.locator("details.traceback").first.locator(".frame.native").count() == 0
