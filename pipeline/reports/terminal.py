"""Tables printed for a person at a terminal or for a pipe: the one rule of how wide they get.

A table that fits the terminal prints as a table. One wider than the terminal prints each row as a
block of `column  value` lines instead: rich would otherwise fold every cell of a dozen columns into
slivers, or cut the values of columns that must not wrap. Into a pipe or a file the table prints at
its natural width, nothing folded or cut (a pipe has no width; rich assumes 80 columns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def natural_width(console: Console, table: Table) -> int:
    """The width the table takes unfolded (rich measures within the console's width otherwise)."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(1 << 16), table).maximum


def print_rows(
    console: Console, table: Table, records: Sequence[dict[str, Any]], cell: Callable[[Any], str] = str
) -> None:
    """`table` (made of `records`), laid out for `console` as above; `cell` writes a value of a block."""
    width = natural_width(console, table)
    if console.is_terminal and width > console.width:
        if table.title:
            console.print(table.title, highlight=False)
        print_blocks(console, records, cell)
        return
    if console.is_terminal or width <= console.width:
        console.print(table)
        return
    narrower = console.width
    console.width = width
    try:
        console.print(table)
    finally:
        console.width = narrower


def print_blocks(console: Console, records: Sequence[dict[str, Any]], cell: Callable[[Any], str] = str) -> None:
    """The narrow layout: one block per row, a line per column, long values wrapped under their name."""
    name_width = max((len(name) for row in records[:1] for name in row), default=0)
    for number, row in enumerate(records, 1):
        console.print(f"-- row {number} " + "-" * max(0, min(console.width, 60) - 10), style="dim", highlight=False)
        for name, value in row.items():
            console.print(f"{name:<{name_width}}  {cell(value)}", markup=False, highlight=False)
