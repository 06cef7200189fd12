"""`tbpipe ranks --format table`: the verdict, a table of the divergent sites with a column per rank
(outliers in red) and each one's traceback, for a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tbpipe.pipeline.reports.ranks.markdown import RANK_COLUMNS
from tbpipe.pipeline.reports.ranks.model import RanksReport
from tbpipe.pipeline.stacks import focus


def print_table(report: RanksReport, console: Console, mode: str = focus.DEFAULT_MODE) -> None:
    console.print(f"tbpipe ranks: {report.verdict}", highlight=False, markup=False)
    if not report.divergent:
        return
    wide = len(report.ranks) > RANK_COLUMNS
    table = Table(show_lines=False)
    for column in ["kind", "name", "site", "median"] + (["outliers"] if wide else [f"rank {r}" for r in report.ranks]):
        table.add_column(column, overflow="fold")
    for site in report.divergent:
        if wide:
            counts = [", ".join(f"{r}: {site.counts_by_rank[r]:,}" for r in site.outlier_ranks)]
        else:
            counts = [
                f"[bold red]{site.counts_by_rank[r]:,}[/]" if r in site.outlier_ranks else f"{site.counts_by_rank[r]:,}"
                for r in report.ranks
            ]
        table.add_row(site.kind, site.name, site.site.where(), f"{site.reference:g}", *counts)
    console.print(table)
    for site, entries in report.tracebacks_by_site():
        names = ", ".join(e.name for e in entries)
        outliers = ", ".join(map(str, sorted({r for e in entries for r in e.outlier_ranks})))
        console.print(f"\n# {site.site.where()}: {names}; outlier ranks {outliers}", highlight=False, markup=False)
        console.print(report.traceback_text(site, mode), highlight=False, markup=False, soft_wrap=True)
