"""`tbpipe ranks --format md`: the verdict on the first line, then a table of the divergent sites
(a column per rank, outliers in bold) and each one's traceback, folded (for a CI comment)."""

from __future__ import annotations

from tbpipe.pipeline.reports.ranks.model import RankSite, RanksReport
from tbpipe.pipeline.stacks import focus

RANK_COLUMNS = 16  # past it, one column lists the outliers' counts


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _counts(site: RankSite, ranks: list[int]) -> list[str]:
    return [
        f"**{site.counts_by_rank[r]:,}**" if r in site.outlier_ranks else f"{site.counts_by_rank[r]:,}" for r in ranks
    ]


def render_markdown(report: RanksReport, mode: str = focus.DEFAULT_MODE) -> str:
    lines = [f"**tbpipe ranks**: {report.verdict}", ""]
    runs = ", ".join(f"rank {r.rank}: `{r.run_id}`" if r.rank is not None else f"{r.role or 'other'}: `{r.run_id}`"
                     for r in report.runs)  # fmt: skip
    lines += [f"Runs: {runs}", ""]
    if not report.divergent:
        return "\n".join(lines)
    wide = len(report.ranks) > RANK_COLUMNS
    head = ["kind", "name", "site", "median"] + (["outliers"] if wide else [f"rank {r}" for r in report.ranks])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for site in report.divergent:
        counts = (
            [", ".join(f"rank {r}: {site.counts_by_rank[r]:,}" for r in site.outlier_ranks)]
            if wide
            else _counts(site, report.ranks)
        )
        cells = [site.kind, f"`{_cell(site.name)}`", _cell(site.site.where()), f"{site.reference:g}", *counts]
        lines.append("| " + " | ".join(cells) + " |")
    for site, entries in report.tracebacks_by_site():
        names = ", ".join(f"<code>{_cell(e.name)}</code>" for e in entries)
        outliers = sorted({r for e in entries for r in e.outlier_ranks})
        lines += [
            "",
            f"<details><summary>{_cell(site.site.where())}: {names}; outlier rank"
            f"{'s' if len(outliers) != 1 else ''} {', '.join(map(str, outliers))}</summary>",
            "",
            "```",
            report.traceback_text(site, mode),
            "```",
            "</details>",
        ]
    return "\n".join(lines) + "\n"
