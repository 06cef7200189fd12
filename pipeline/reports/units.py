"""Quantities as people read them in reports and tracebacks."""

from __future__ import annotations


def format_duration(ns: float) -> str:
    """A GPU time: ns, µs, ms or s with three significant digits."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.0f} ns"
