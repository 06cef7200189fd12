"""The regression report as Markdown, for a CI comment or job summary.

The verdict comes first, on one line, then what differs in the environment, then the flagged
sites as a table with each one's combined traceback folded in a `<details>` block.
"""

from __future__ import annotations

from tbpipe.pipeline.reports.regression.model import NEW, GpuSiteChange, RegressionReport, SiteChange
from tbpipe.pipeline.reports.units import format_duration

FRAMES_SHOWN = 40


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.3g}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _change(site: SiteChange) -> str:
    if site.change == NEW:
        return "new at a known site" if site.site_known else "new site"
    if site.change == "moved":
        return f"moved from line {site.baseline_line}" if site.baseline_line is not None else "moved"
    relative = site.relative
    text = site.change + (f" ({relative:+.0%})" if relative is not None else "")
    if site.baseline_line is not None:
        text += f", moved from line {site.baseline_line}"
    return text


def gpu_change(site: GpuSiteChange) -> str:
    """What happened to a site's GPU time, with why it counts (more executions, or slower ones)."""
    if site.change == NEW:
        return "new"
    relative = site.relative
    text = site.change + (f" ({relative:+.0%})" if relative is not None else "")
    if site.change in ("increased", "decreased") and site.candidate_executions != site.baseline_executions:
        text += f", runs {_number(site.baseline_executions)} -> {_number(site.candidate_executions)}"
    elif site.z is not None and site.change != "unchanged":
        text += f", {site.z:+.1f} s.e. per run"
    return text


def per_execution(site: GpuSiteChange) -> str:
    before = format_duration(site.baseline_mean_ns) if site.baseline_mean_ns is not None else "-"
    after = format_duration(site.candidate_mean_ns) if site.candidate_mean_ns is not None else "-"
    return f"{before} -> {after}"


def _gpu_section(report: RegressionReport) -> list[str]:
    """GPU time per site: its own verdict, the slower sites and their tracebacks."""
    if not report.gpu_sites:
        return []
    unit = f" per {report.request.per[1]}" if report.request.per else ""
    thresholds = report.request.gpu_thresholds
    out = [
        f"**{report.gpu_verdict()}**",
        "",
        f"GPU time per call site: flagged past {thresholds.relative:.0%} and {format_duration(thresholds.absolute)}"
        + (
            ", outside the window's band"
            if report.windowed and len(report.baseline) > 1
            else ", with more executions or a per-execution time moved past its spread"
        )
        + ".",
        "",
    ]
    slower = report.gpu_regressions
    if slower:
        out += [
            f"| change | kind | name | site | baseline{unit} | candidate{unit} | per execution |",
            "|---|---|---|---|---|---|---|",
        ]
        for site in slower:
            where = f"`{site.where}` {site.site_function or ''}"
            out.append(
                f"| {_cell(gpu_change(site))} | {site.kind} | `{_cell(site.name)}` | {_cell(where)} | "
                f"{format_duration(site.baseline_ns)} | {format_duration(site.candidate_ns)} | {per_execution(site)} |"
            )
        out.append("")
        for site in slower:
            if not site.traceback:
                continue
            out += [
                "<details>",
                f"<summary>GPU time of {_cell(site.name)} at {site.where} (site {site.site_key})</summary>",
                "",
                "```",
                *traceback_lines(site),
                "```",
                "</details>",
                "",
            ]
    return out


def traceback_lines(site: SiteChange | GpuSiteChange) -> list[str]:
    """`file:line:function` per frame, innermost first; Python frames marked `py`, inlined and generated
    ones noted."""
    lines = []
    for frame in (site.traceback or [])[:FRAMES_SHOWN]:
        if frame.kind == "marker":
            lines.append(f"   {frame.function}")
            continue
        where = frame.file or (frame.module.rsplit("/", 1)[-1] if frame.module else "??")
        line = frame.line if frame.line is not None else "?"
        tag = "py" if frame.kind == "python" else "  "
        notes = (" [inlined]" if frame.inlined else "") + (" [generated]" if frame.generated else "")
        lines.append(f"{tag} {where}:{line}:{frame.function or '??'}{notes}")
    more = len(site.traceback or []) - FRAMES_SHOWN
    if more > 0:
        lines.append(f"   ... {more} more frames")
    return lines


def render_markdown(report: RegressionReport) -> str:
    icon = ":x:" if report.regressions else ":white_check_mark:"
    out = [f"{icon} **{report.verdict()}**", ""]
    unit = f" per {report.request.per[1]}" if report.request.per else ""
    baseline = ", ".join(s.name for s in report.baseline)
    out.append(f"Candidate `{report.candidate.name}` ({len(report.candidate.run_ids)} runs); baseline: {baseline}.")
    counts = ", ".join(f"{report.count(c)} {c}" for c in ("new", "increased", "decreased", "removed", "moved"))
    out.append(f"Sites compared: {len(report.sites)} ({counts}).")
    if report.request.site_of == "forward":
        out.append("Work in autograd's backward is counted at the site of the forward op that made its node.")
    out.append("")
    if report.environment:
        out += ["**Environment differences**", "", "| what | baseline | candidate |", "|---|---|---|"]
        out += [
            f"| {_cell(e.what)} | {_cell(e.baseline or '')} | {_cell(e.candidate or '')} |" for e in report.environment
        ]
        out.append("")
    if report.regressions:
        out += [
            "**Regressions**",
            "",
            f"| change | kind | name | site | baseline{unit} | candidate{unit} |",
            "|---|---|---|---|---|---|",
        ]
        for site in report.regressions:
            where = f"`{site.where}` {site.site_function or ''}"
            out.append(
                f"| {_change(site)} | {site.kind} | `{_cell(site.name)}` | {_cell(where)} | "
                f"{_number(site.baseline_events)} | {_number(site.candidate_events)} |"
            )
        out.append("")
        for site in report.regressions:
            if not site.traceback:
                continue
            out += [
                "<details>",
                f"<summary>{_cell(site.name)} at {site.where} (site {site.site_key})</summary>",
                "",
                "```",
                *traceback_lines(site),
                "```",
                "</details>",
                "",
            ]
    out += _gpu_section(report)
    accepted = report.accepted + [s for s in report.gpu_sites if s.accepted is not None]
    if accepted:
        out += ["**Accepted changes** (from --accept)", ""]
        out += [
            f"- `{_cell(s.name)}` at `{s.where}`{' (GPU time)' if isinstance(s, GpuSiteChange) else ''}: {s.accepted}"
            for s in accepted
        ]
        out.append("")
    if report.expired_accepts:
        out += ["**Accept entries past their date** (they no longer apply: remove or renew them)", ""]
        out += [f"- {e}" for e in report.expired_accepts]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
