"""The regression report as Markdown, for a CI comment or job summary.

The verdict comes first, on one line, then what differs in the environment, then the flagged
sites as a table with each one's combined traceback folded in a `<details>` block. With suspects,
each flagged site's line names its top suspect (the commit that most likely did it), the traceback
marks the frames the suspects changed, and the suspects with their hunks are folded below.
"""

from __future__ import annotations

from tbpipe.pipeline.reports.regression.model import NEW, GpuSiteChange, RegressionReport, SiteChange
from tbpipe.pipeline.reports.regression.suspects import Suspect, SuspectHistory, TouchedFrame, touched_frames
from tbpipe.pipeline.reports.units import format_duration
from tbpipe.pipeline.stacks import focus

FRAMES_SHOWN = 40
SUSPECTS_SHOWN = 5


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


def _gpu_section(report: RegressionReport, frames: str) -> list[str]:
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
    suspects = report.history is not None and report.history.looked
    if slower:
        out += [
            f"| change | kind | name | site | baseline{unit} | candidate{unit} | per execution |"
            + (" top suspect |" if suspects else ""),
            "|---|---|---|---|---|---|---|" + ("---|" if suspects else ""),
        ]
        for site in slower:
            where = f"`{site.where}` {site.site_function or ''}"
            out.append(
                f"| {_cell(gpu_change(site))} | {site.kind} | `{_cell(site.name)}` | {_cell(where)} | "
                f"{format_duration(site.baseline_ns)} | {format_duration(site.candidate_ns)} | {per_execution(site)} |"
                + (f" {top_suspect(site)} |" if suspects else "")
            )
        out.append("")
        for site in slower:
            if site.traceback:
                out += [
                    "<details>",
                    f"<summary>GPU time of {_cell(site.name)} at {site.where} (site {site.site_key})</summary>",
                    "",
                    "```",
                    *traceback_lines(site, frames, report.focus_rules),
                    "```",
                    "</details>",
                    "",
                ]
            out += _suspects_block(site, f"the GPU time of {_cell(site.name)} at {site.where}")
    return out


def traceback_lines(
    site: SiteChange | GpuSiteChange, mode: str = focus.DEFAULT_MODE, rules: focus.FrameRules = focus.DEFAULT_RULES
) -> list[str]:
    """`file:line:function` per frame, innermost first, focused by `mode` (stacks/focus.py: by default
    start-up folded into one row, tbpipe's own frames hidden); Python frames marked `py`, inlined and
    generated ones noted, frames a suspect changed marked with its hash."""
    lines = []
    marks = touched_frames(site.suspects)
    focused = focus.focus_frames(site.traceback or [], mode, rules)
    for frame in focused[:FRAMES_SHOWN]:
        if isinstance(frame, focus.StartUp) or frame.kind == "marker":
            lines.append(f"   {frame.text if isinstance(frame, focus.StartUp) else frame.function}")
            continue
        where = frame.file or (frame.module.rsplit("/", 1)[-1] if frame.module else "??")
        line = frame.line if frame.line is not None else "?"
        tag = "py" if frame.kind == "python" else "  "
        notes = (" [inlined]" if frame.inlined else "") + (" [generated]" if frame.generated else "")
        changed = marks.get((frame.file, frame.line, frame.function))
        notes += f"  <- changed by {', '.join(changed)}" if changed else ""
        lines.append(f"{tag} {where}:{line}:{frame.function or '??'}{notes}")
    more = len(focused) - FRAMES_SHOWN
    if more > 0:
        lines.append(f"   ... {more} more frames")
    return lines


def frame_role(frame: TouchedFrame) -> str:
    """Which frame of the stack a suspect changed, and what of it: 'site line', 'caller 2 function'..."""
    steps = abs(frame.from_site)
    who = "site" if steps == 0 else ("caller" if frame.from_site > 0 else "callee") + (f" {steps}" if steps > 1 else "")
    return f"{who} {frame.what}"


def history_line(history: SuspectHistory) -> str:
    """One line on where the suspects came from, or why there are none."""
    if history.note:
        return f"Suspects: none looked for: {history.note}."
    if not history.commits:
        return f"Suspects: none, the two sides ran the same commit ({(history.candidate or '')[:10]})."
    return (
        f"Suspects: {history.commits} commit{'s' if history.commits != 1 else ''} from "
        f"{(history.baseline or '')[:10]} to {(history.candidate or '')[:10]} in {history.repository}."
    )


def top_suspect(site: SiteChange | GpuSiteChange) -> str:
    if not site.suspects:
        return "-" if site.suspects is None else "none on its stacks"
    top = site.suspects[0]
    return f"`{top.short}` {_cell(top.subject)} ({frame_role(top.frames[0])} `{_cell(top.frames[0].where)}`)"


def _fence(text: str) -> str:
    return "````" if "```" in text else "```"


def suspect_lines(suspect: Suspect) -> list[str]:
    """A suspect: hash, subject, author and date, the frames it changed, its hunks."""
    touched = ", ".join(f"`{f.where}` ({frame_role(f)})" for f in suspect.frames[:4])
    more = f" and {len(suspect.frames) - 4} more frames" if len(suspect.frames) > 4 else ""
    out = [
        f"`{suspect.short}` {_cell(suspect.subject)}{' (merge)' if suspect.merge else ''}, "
        f"{_cell(suspect.author)}, {suspect.author_date[:10]}: {touched}{more}",
        "",
    ]
    for hunk in suspect.hunks:
        fence = _fence(hunk.text)
        out += [f"{fence}diff", f"# {hunk.path}", hunk.text, fence, ""]
    return out


def _suspects_block(site: SiteChange | GpuSiteChange, what: str) -> list[str]:
    if not site.suspects:
        return []
    count = len(site.suspects)
    out = ["<details>", f"<summary>{count} suspect{'s' if count != 1 else ''} of {what}</summary>", ""]
    for rank, suspect in enumerate(site.suspects[:SUSPECTS_SHOWN], 1):
        out += [f"**{rank}.** " + suspect_lines(suspect)[0], *suspect_lines(suspect)[1:]]
    if count > SUSPECTS_SHOWN:
        out += [f"... {count - SUSPECTS_SHOWN} more in the JSON report", ""]
    return [*out, "</details>", ""]


def _fewer_events_lines(report: RegressionReport) -> list[str]:
    """Removed and decreased sites with suspects (from the baseline's stacks)."""
    explained = [s for s in report.sites if s.change in ("removed", "decreased") and s.suspects]
    if not explained:
        return []
    out = ["**Suspects of sites with fewer events**", ""]
    out += [f"- {s.change} `{_cell(s.name)}` at `{s.where}`: {top_suspect(s)}" for s in explained]
    return [*out, ""]


def render_markdown(report: RegressionReport, frames: str = focus.DEFAULT_MODE) -> str:
    """The report; its tracebacks show the frames of focus mode `frames`."""
    icon = ":x:" if report.regressions else ":white_check_mark:"
    out = [f"{icon} **{report.verdict()}**", ""]
    unit = f" per {report.request.per[1]}" if report.request.per else ""
    baseline = ", ".join(s.name for s in report.baseline)
    runs = len(report.candidate.run_ids)
    out.append(f"Candidate `{report.candidate.name}` ({runs} run{'s' if runs != 1 else ''}); baseline: {baseline}.")
    counts = ", ".join(f"{report.count(c)} {c}" for c in ("new", "increased", "decreased", "removed", "moved"))
    out.append(f"Sites compared: {len(report.sites)} ({counts}).")
    if report.request.site_of == "forward":
        out.append("Work in autograd's backward is counted at the site of the forward op that made its node.")
    if report.history is not None:
        out += [history_line(report.history), *(f"Suspects: {w}." for w in report.history.warnings)]
    out.append("")
    if report.environment:
        out += ["**Environment differences**", "", "| what | baseline | candidate |", "|---|---|---|"]
        out += [
            f"| {_cell(e.what)} | {_cell(e.baseline or '')} | {_cell(e.candidate or '')} |" for e in report.environment
        ]
        out.append("")
    suspects = report.history is not None and report.history.looked
    if report.regressions:
        out += [
            "**Regressions**",
            "",
            f"| change | kind | name | site | baseline{unit} | candidate{unit} |"
            + (" top suspect |" if suspects else ""),
            "|---|---|---|---|---|---|" + ("---|" if suspects else ""),
        ]
        for site in report.regressions:
            where = f"`{site.where}` {site.site_function or ''}"
            out.append(
                f"| {_change(site)} | {site.kind} | `{_cell(site.name)}` | {_cell(where)} | "
                f"{_number(site.baseline_events)} | {_number(site.candidate_events)} |"
                + (f" {top_suspect(site)} |" if suspects else "")
            )
        out.append("")
        for site in report.regressions:
            if site.traceback:
                out += [
                    "<details>",
                    f"<summary>{_cell(site.name)} at {site.where} (site {site.site_key})</summary>",
                    "",
                    "```",
                    *traceback_lines(site, frames, report.focus_rules),
                    "```",
                    "</details>",
                    "",
                ]
            out += _suspects_block(site, f"{_cell(site.name)} at {site.where}")
    out += _fewer_events_lines(report)
    out += _gpu_section(report, frames)
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
