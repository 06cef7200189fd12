"""Checks shared by the tests that look at pages in headless Chromium."""

from __future__ import annotations


def regressions_fit_the_page(page) -> bool:
    """The regressions table (its tracebacks as they are) ends where the page's content does: the
    verdict's box spans that width."""
    return page.evaluate(
        """() => document.querySelector('#regressions').getBoundingClientRect().right
                 <= document.querySelector('#verdict').getBoundingClientRect().right + 1"""
    )
