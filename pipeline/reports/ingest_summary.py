"""The table `tbpipe ingest` prints at the end: what went in, what was skipped, what was quarantined."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tbpipe.pipeline.db.ingest.outcomes import IngestSummary, UnsymbolizedGroup
from tbpipe.pipeline.symbols.model import short_build_id
from tbpipe.schemas.modulekey import ModuleKey

_SHOWN_MODULES = 3


def _modules_text(group: UnsymbolizedGroup) -> str:
    names = []
    for key, path in sorted(group.modules.items(), key=lambda item: item[1]):
        build_id = ModuleKey.parse(key).build_id
        names.append(f"{os.path.basename(path)} {short_build_id(build_id)}" if build_id else os.path.basename(path))
    more = len(names) - _SHOWN_MODULES
    return ", ".join(names[:_SHOWN_MODULES]) + (f" and {more} more" if more > 0 else "")


def unsymbolized_lines(summary: IngestSummary) -> list[str]:
    """'N frames in M modules: reason (modules)', most frames first."""
    lines = []
    for group in sorted(summary.unsymbolized.values(), key=lambda g: (-g.frames, g.reason)):
        count = len(group.modules)
        lines.append(
            f"{group.frames:,} frame{'s' if group.frames != 1 else ''} in {count} module{'s' if count != 1 else ''}: "
            f"{group.reason} ({_modules_text(group)})"
        )
    return lines


def render_ingest_summary(summary: IngestSummary, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=escape(f"ingest into {summary.db_path}"), show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("count", justify="right")
    table.add_column("detail", overflow="fold")
    updated = sum(1 for o in summary.outcomes if o.status == "updated")
    table.add_row(
        "runs ingested",
        f"{summary.ingested:,}",
        f"{updated} incomplete runs loaded again (their files grew)" if updated else "",
    )
    table.add_row("already present", f"{summary.present:,}", "")
    table.add_row(
        "incomplete",
        f"{summary.incomplete:,}",
        "capture was killed before a clean close: what it flushed is in" if summary.incomplete else "",
    )
    quarantined = summary.quarantined
    table.add_row(
        "quarantined", f"[red]{len(quarantined):,}[/]" if quarantined else "0", "see below" if quarantined else ""
    )
    table.add_row("events", f"{summary.events:,}", "")
    table.add_row("new stacks", f"{summary.new_stacks:,}", "")
    table.add_row("frames symbolized", f"{summary.frames_symbolized:,}", "native frames of the new stacks")
    table.add_row(
        "frames unsymbolized", f"{summary.frames_unsymbolized:,}", escape("\n".join(unsymbolized_lines(summary)))
    )
    if summary.refreshed_modules:
        table.add_row(
            "re-symbolized modules",
            f"{len(summary.refreshed_modules):,}",
            "better debug info found: their old frames were redone",
        )
    for line in summary.debuginfod:
        table.add_row("debuginfod", "", escape(line))
    for prefix, is_user in summary.user_code:
        table.add_row("user code" if is_user else "not user code", "", escape(prefix))
    table.add_row("time", f"{summary.seconds:.1f} s", "")
    console.print(table)
    for outcome in quarantined:
        console.print(f"[red]quarantined[/] {escape(outcome.reason or '')}", highlight=False, soft_wrap=True)
    for outcome in summary.outcomes:
        for note in outcome.notes:
            console.print(f"[yellow]note[/] {escape(f'{outcome.run_id}: {note}')}", highlight=False, soft_wrap=True)
