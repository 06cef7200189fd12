"""The regression report as one self-contained HTML file: inline CSS, SVG and a few lines of JS.

Nothing is fetched when the file is opened (no CDN, no fonts), so it can be attached to a CI job
and read offline. The page shows the verdict, what differs in the environment, a bar chart of the
largest changes, the flagged sites with their combined tracebacks (Python and native frames told
apart), a trend over the window for each flagged site, and every compared site in a filterable table;
then, when the runs recorded GPU activity, the same for GPU time per site with its own verdict. With
suspects, each flagged site shows its top suspect, its suspects' hunks folded, and the frames they
changed highlighted in its traceback. The tracebacks switch between the focus modes of
`stacks.focus` in place: every row carries the modes that show it, computed here, and the page's
switch only hides the others (the mode kept in the URL's fragment, `#frames=python`).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from importlib import resources
from typing import Any

from tbpipe.pipeline.reports.regression.model import GpuSiteChange, RegressionReport, SiteChange, Spread
from tbpipe.pipeline.reports.regression.suspects import touched_frames
from tbpipe.pipeline.reports.regression_markdown import (
    _change,
    _number,
    frame_role,
    gpu_change,
    history_line,
    per_execution,
)
from tbpipe.pipeline.reports.units import format_duration
from tbpipe.pipeline.stacks import focus

BARS_SHOWN = 15


def stylesheet() -> str:
    return resources.files("tbpipe.pipeline.reports").joinpath("assets/tbpipe.css").read_text(encoding="utf-8")


def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("tbpipe.pipeline.reports", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def bar_chart(sites: list[SiteChange]) -> str:
    """SVG bars of the largest changes (candidate minus baseline), red up, green down."""
    changed = sorted((s for s in sites if s.delta), key=lambda s: -abs(s.delta))[:BARS_SHOWN]
    if not changed:
        return ""
    label_w, bar_w, row_h = 430, 330, 20
    largest = max(abs(s.delta) for s in changed)
    middle = label_w + bar_w / 2
    rows = []
    for i, site in enumerate(changed):
        y = i * row_h
        width = max(1.0, abs(site.delta) / largest * (bar_w / 2 - 4))
        x = middle if site.delta > 0 else middle - width
        label = f"{site.name[:28]} @ {site.where}"[:62]
        rows.append(
            f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end">{html.escape(label)}</text>'
            f'<rect class="{"up" if site.delta > 0 else "down"}" x="{x:.1f}" y="{y + 4}" width="{width:.1f}" '
            f'height="{row_h - 7}"><title>{html.escape(site.name)} at {html.escape(site.where)}: '
            f"{_number(site.baseline_events)} -> {_number(site.candidate_events)}</title></rect>"
            f'<text x="{label_w + bar_w + 6}" y="{y + 14}">{site.delta:+,.3g}</text>'
        )
    height = len(changed) * row_h
    axis = f'<line x1="{middle}" y1="0" x2="{middle}" y2="{height}" stroke="#8a94a0" stroke-width="1"/>'
    return (
        f'<svg class="chart" role="img" aria-label="largest changes" width="{label_w + bar_w + 80}" '
        f'height="{height}" viewBox="0 0 {label_w + bar_w + 80} {height}">{axis}{"".join(rows)}</svg>'
    )


def trend(spread: Spread | None, candidate: float) -> str:
    """A small line of the window's values, the band shaded, the candidate as a red dot at the end."""
    if spread is None or not spread.values:
        return ""
    width, height, pad = 170, 38, 4
    points = [*spread.values, candidate]
    low = min(points + [spread.low])
    high = max(points + [spread.high])
    scale = (height - 2 * pad) / (high - low) if high > low else 0.0

    def y(value: float) -> float:
        return height - pad - (value - low) * scale if scale else height / 2

    step = (width - 2 * pad) / max(len(points) - 1, 1)
    line = " ".join(f"{pad + i * step:.1f},{y(v):.1f}" for i, v in enumerate(spread.values))
    band_top, band_bottom = y(spread.high), y(spread.low)
    cx = pad + (len(points) - 1) * step
    values = ", ".join(_number(v) for v in spread.values)
    return (
        f'<svg class="trend" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        f"<title>window: {values}; candidate {_number(candidate)}</title>"
        f'<rect class="band" x="0" y="{band_top:.1f}" width="{width}" height="{max(band_bottom - band_top, 1):.1f}"/>'
        f'<polyline class="line" points="{line}"/>'
        f'<circle class="candidate" cx="{cx:.1f}" cy="{y(candidate):.1f}" r="3"/></svg>'
    )


def _hunk_html(path: str, text: str) -> str:
    lines = [f'<span class="path">{html.escape(path)}</span>']
    for line in text.split("\n"):
        kind = {"+": "add", "-": "del", "@": "at"}.get(line[:1], "")
        lines.append(f'<span class="{kind}">{html.escape(line)}</span>' if kind else html.escape(line))
    return '<pre class="hunk">' + "\n".join(lines) + "</pre>"


def suspects_html(site: SiteChange | GpuSiteChange) -> str:
    """A site's top suspect on one line, then every suspect folded: the commit, what it changed on the
    stack, its hunks. Empty when suspects were not looked for."""
    if site.suspects is None:
        return ""
    if not site.suspects:
        return '<div class="suspect muted">suspects: no commit changed code on its stacks</div>'
    top = site.suspects[0]
    items = []
    for suspect in site.suspects:
        touched = ", ".join(f"{frame_role(f)} <code>{html.escape(f.where)}</code>" for f in suspect.frames[:4]) + (
            f" and {len(suspect.frames) - 4} more" if len(suspect.frames) > 4 else ""
        )
        items.append(
            f'<li><code class="commit">{suspect.short}</code> {html.escape(suspect.subject)}'
            f"{' (merge)' if suspect.merge else ''} "
            f'<span class="muted">{html.escape(suspect.author)}, {html.escape(suspect.author_date[:10])}</span>'
            f'<div class="touched">changed: {touched}</div>'
            + "".join(_hunk_html(h.path, h.text) for h in suspect.hunks)
            + "</li>"
        )
    count = len(site.suspects)
    return (
        f'<div class="suspect">top suspect: <code class="commit">{top.short}</code> {html.escape(top.subject)} '
        f'<span class="muted">({frame_role(top.frames[0])} <code>{html.escape(top.frames[0].where)}</code>)</span></div>'
        f'<details class="suspects"><summary>{count} suspect{"s" if count != 1 else ""}, with their hunks</summary>'
        f"<ol>{''.join(items)}</ol></details>"
    )


def frame_marks(site: SiteChange | GpuSiteChange) -> dict[tuple, str]:
    """(file, line, function) of each frame the site's suspects changed -> a tooltip naming them."""
    return {key: "changed by " + ", ".join(shas) for key, shas in touched_frames(site.suspects).items()}


@dataclass(frozen=True)
class _NoFrames:
    """The row a mode that shows none of a traceback's frames shows instead."""

    text: str
    kind: str = "folded"


def focus_rows(frames: list[Any], rules: focus.FrameRules) -> list[tuple[Any, str]]:
    """A traceback's rows, innermost first, each with the classes of the focus modes that show it
    (`in-program in-all`): its frames, the folded start-up row, and a row for each mode that shows
    none of its frames. Every mode's rows are the traceback `focus.focus_frames` gives."""
    rows = focus.modes_of_frames(frames, rules)
    shown = {mode for _, modes in rows for mode in modes}
    rows += [(_NoFrames(f"no frames in {focus.MODE_LABELS[m]} mode"), (m,)) for m in focus.MODES if m not in shown]
    return [(row, " ".join(f"in-{mode}" for mode in modes)) for row, modes in rows] if frames else []


def render_html(report: RegressionReport) -> str:
    template = _environment().get_template("regression.html.j2")
    return template.render(
        report=report,
        css=stylesheet(),
        chart=bar_chart(report.sites),
        trend=trend,
        change_text=_change,
        number=_number,
        gpu_change_text=gpu_change,
        per_execution=per_execution,
        duration=format_duration,
        unit=f" per {report.request.per[1]}" if report.request.per else "",
        history_line=history_line,
        suspects_html=suspects_html,
        frame_marks=frame_marks,
        focus_rows=lambda frames: focus_rows(frames, report.focus_rules),
        focus_modes=focus.MODE_LABELS,
        default_mode=focus.DEFAULT_MODE,
    )
