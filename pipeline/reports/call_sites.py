"""Call-site tables: the top sites of a kind of event, as `tbpipe demo` prints them."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tbpipe.pipeline.reports.terminal import print_rows


def render_top_sites(sites: list[dict[str, Any]], title: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=escape(title), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("events", justify="right")
    table.add_column("name")
    table.add_column("call site")
    table.add_column("file:line", overflow="fold")
    table.add_column("site key", style="dim")
    records = []
    for rank, site in enumerate(sites, 1):
        where = f"{site['site_file'] or '??'}:{site['site_line'] if site['site_line'] is not None else '?'}"
        record = {
            "#": str(rank),
            "events": f"{site['events']:,}",
            "name": site["name"],
            "call site": site["site_function"] or "<no stack>",
            "file:line": where if site["site_function"] else "",
            "site key": site["site_key"] or "",
        }
        records.append(record)
        table.add_row(*(escape(value) for value in record.values()))
    print_rows(console, table, records)  # a site key cut short could not be given to `tbpipe show`
