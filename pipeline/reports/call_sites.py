"""Call-site tables: the top sites of a kind of event, as `tbpipe demo` prints them."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def render_top_sites(sites: list[dict[str, Any]], title: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=escape(title), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("events", justify="right")
    table.add_column("name")
    table.add_column("call site")
    table.add_column("file:line", overflow="fold")
    table.add_column("site key", style="dim")
    for rank, site in enumerate(sites, 1):
        where = f"{site['site_file'] or '??'}:{site['site_line'] if site['site_line'] is not None else '?'}"
        table.add_row(
            str(rank),
            f"{site['events']:,}",
            escape(site["name"]),
            escape(site["site_function"] or "<no stack>"),
            escape(where) if site["site_function"] else "",
            site["site_key"] or "",
        )
    console.print(table)
