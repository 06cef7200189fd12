"""Checks shared by the tests that look at pages in headless Chromium, and a page to look with."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"  # screenshots, kept to be looked at


@contextlib.contextmanager
def chromium_page(width: int = 1300, height: int = 900) -> Iterator:
    """A page in Debian's headless Chromium (skips when the package is absent); an error the page's
    scripts raise fails the test when the block ends."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium package is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            errors: list[str] = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            yield page
            assert errors == []
        finally:
            browser.close()


def regressions_fit_the_page(page) -> bool:
    """The regressions table (its tracebacks as they are) ends where the page's content does: the
    verdict's box spans that width."""
    return page.evaluate(
        """() => document.querySelector('#regressions').getBoundingClientRect().right
                 <= document.querySelector('#verdict').getBoundingClientRect().right + 1"""
    )


def tracebacks_show_whole_lines(page) -> bool:
    """Every traceback shown on the page shows each frame's line whole: nothing hides past its box's
    right edge behind a scroll bar (a long path would hide the line number and function there)."""
    return page.evaluate(
        """() => [...document.querySelectorAll('.frames')]
                 .filter(box => box.offsetParent !== null)
                 .every(box => box.scrollWidth <= box.clientWidth + 1)"""
    )
