"""The web UI: server-rendered pages (Jinja2, `templates/`), icicle graphs drawn by `static/icicle.js`
from the JSON API. Every asset is served from the package (`/static/NAME`, `security.StaticFiles`)."""

from __future__ import annotations

import html
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Query, Request
from starlette.responses import HTMLResponse, Response

from tbpipe.pipeline.db.read import NotFoundError
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.reports.regression import ReportRequest, compare
from tbpipe.pipeline.reports.regression.model import RegressionReport
from tbpipe.pipeline.reports.regression_html import bar_chart, frame_marks, suspects_html, trend
from tbpipe.pipeline.reports.regression_markdown import _change, _number, history_line
from tbpipe.pipeline.serve import flame, queries
from tbpipe.pipeline.serve.api import compare_params, parse_labels, with_suspects
from tbpipe.pipeline.serve.app import service_of
from tbpipe.pipeline.stacks import focus

router = APIRouter(include_in_schema=False)

PAGE_RUNS = 50
SITES_SHOWN = 25
COMPARED_SHOWN = 1000  # rows of the comparison page's all-sites table

CANNED_QUERIES = [
    (
        "Top kernel-launch sites",
        # One row per site over every run, whichever checkout a run came from: by site key, the
        # file relative to its import root, and every line the site was at.
        "SELECT name, any_value(site_function) AS site_function,\n"
        "       any_value(coalesce(site_portable_file, site_file)) AS site_file,\n"
        "       string_agg(DISTINCT site_line::VARCHAR, ', ' ORDER BY site_line::VARCHAR) AS site_lines,\n"
        "       count(DISTINCT run_id) AS runs, sum(events) AS launches\n"
        "FROM kernel_launch_sites GROUP BY name, site_key ORDER BY launches DESC, name LIMIT 20",
    ),
    (
        "Launches per commit",
        "SELECT r.labels['commit'] AS commit, count(DISTINCT r.run_id) AS runs, sum(s.events) AS launches\n"
        "FROM kernel_launch_sites s JOIN runs r USING (run_id)\nGROUP BY ALL ORDER BY commit",
    ),
    (
        "Runs",
        "SELECT run_id, started_at, complete, rolled_up_at, labels, events, stacks FROM runs\n"
        "ORDER BY started_at DESC LIMIT 50",
    ),
    (
        "Unsymbolized frames",
        "SELECT reason, frames, modules FROM unsymbolized_frames ORDER BY frames DESC",
    ),
    (
        "Documented columns",
        "SELECT table_name, column_name, comment FROM duckdb_columns()\n"
        "WHERE comment IS NOT NULL AND schema_name = 'main' ORDER BY table_name, column_index",
    ),
]

_environment = None


def environment():
    global _environment
    if _environment is None:
        import jinja2

        _environment = jinja2.Environment(
            # The reports' templates too: a traceback's rows are shown one way in both (frame_row).
            loader=jinja2.ChoiceLoader(
                [
                    jinja2.PackageLoader("tbpipe.pipeline.serve", "templates"),
                    jinja2.PackageLoader("tbpipe.pipeline.reports", "templates"),
                ]
            ),
            autoescape=jinja2.select_autoescape(["html", "j2"]),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        _environment.filters["q"] = lambda text: quote(str(text), safe="")
        _environment.globals.update(number=_number, change_text=_change, trend=trend, where=_where)
        _environment.globals.update(suspects_html=suspects_html, frame_marks=frame_marks, history_line=history_line)
        _environment.globals.update(
            focused=_focused, frames_mode=frames_mode, with_frames=_with_frames, focus_modes=FOCUS_LABELS
        )
    return _environment


FOCUS_LABELS = tuple(focus.MODE_LABELS.items())


def frames_mode(request: Request) -> str:
    """The focus mode the page's URL asks for (`?frames=`), program by default."""
    mode = request.query_params.get("frames") or focus.DEFAULT_MODE
    if mode not in focus.MODES:
        raise UsageError(f"frames must be one of {', '.join(focus.MODES)}, not {mode!r}")
    return mode


def _with_frames(request: Request, mode: str) -> str:
    """This page's URL with the focus mode `mode`."""
    params = [(k, v) for k, v in request.query_params.multi_items() if k != "frames"]
    if mode != focus.DEFAULT_MODE:
        params.append(("frames", mode))
    return request.url.path + ("?" + urlencode(params) if params else "")


def _focused(frames: list[Any], request: Request) -> list[Any]:
    """A traceback as the page's focus mode shows it (a StartUp row where start-up frames fold)."""
    rules = getattr(request.state, "focus_rules", None)
    if rules is None:
        with service_of(request).database.read() as cursor:
            rules = request.state.focus_rules = flame.rules_of(cursor)
    return focus.focus_frames(frames, frames_mode(request), rules)


def _where(file: str | None, line: int | None) -> str:
    return f"{file or '??'}:{line if line is not None else '?'}"


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    text = environment().get_template(template).render(request=request, path=request.url.path, **context)
    return HTMLResponse(text, status_code=status)


def render_error(request: Request, status: int, message: str) -> str:
    return (
        environment()
        .get_template("error.html.j2")
        .render(request=request, path=request.url.path, status=status, message=message)
    )


# ------------------------------------------------------------------------------------------ static


@router.get("/static/{name}")
def static(request: Request, name: str) -> Response:
    response = service_of(request).static.response(name)
    if response is None:
        from starlette.exceptions import HTTPException

        raise HTTPException(404, f"no static file {name!r}")
    return response


# ------------------------------------------------------------------------------------------ runs


@router.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request,
    label: Annotated[list[str] | None, Query()] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> HTMLResponse:
    labels = parse_labels([item for item in label or [] if item])
    with service_of(request).database.read() as cursor:
        page = queries.runs_page(
            cursor, labels, None, PAGE_RUNS, offset, generation=service_of(request).database.state_key()
        )
        values = queries.label_values(cursor)
    kinds = sorted({k for run in page["runs"] for k in run["counts"]})

    def with_labels(extra: dict[str, str | None], new_offset: int = 0) -> str:
        chosen = {**labels, **extra}
        params = [("label", f"{k}={v}") for k, v in chosen.items() if v is not None]
        if new_offset:
            params.append(("offset", str(new_offset)))
        return "/" + ("?" + urlencode(params) if params else "")

    ingesting = service_of(request).ingest.running is not None
    response = render(
        request, "runs.html.j2", page=page, labels=labels, values=values, kinds=kinds, with_labels=with_labels,
        page_size=PAGE_RUNS, ingesting=ingesting,
    )  # fmt: skip
    if ingesting:  # the page says so: not kept past the ingest (cache.py)
        response.headers["cache-control"] = "no-store"
    return response


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str) -> HTMLResponse:
    frames_mode(request)  # a wrong mode is refused here, not by the graph's request
    database = service_of(request).database
    with database.read() as cursor:
        generation = database.state_key()
        run = queries.run(cursor, run_id, generation)
        order = [k for k in ("kernel_launch", "op") if k in run["counts"]]
        order += [k for k in run["counts"] if k not in order][:4]
        sections = [(kind, queries.run_sites(cursor, run_id, kind, None, SITES_SHOWN, 0, generation)) for kind in order]
    return render(request, "run.html.j2", run=run, sections=sections)


# ------------------------------------------------------------------------------------------ sites


def history_chart(runs: list[dict[str, Any]]) -> str:
    """Bars of a site's events per run, oldest first, the newest run in red."""
    if not runs:
        return ""
    shown = runs[-60:]
    width, height, gap = 720, 90, 2
    bar = min(24.0, max(2.0, (width - gap * len(shown)) / len(shown)))
    largest = max(r["events"] for r in shown) or 1
    parts = []
    for i, entry in enumerate(shown):
        h = max(1.0, entry["events"] / largest * (height - 14))
        x = i * (bar + gap)
        latest = ' class="latest"' if i == len(shown) - 1 else ""
        parts.append(
            f'<a href="/runs/{quote(entry["run_id"], safe="")}"><rect{latest} x="{x:.1f}" y="{height - h:.1f}" '
            f'width="{bar:.1f}" height="{h:.1f}"><title>{html.escape(entry["run_id"])}: {entry["events"]:,} events'
            f"</title></rect></a>"
        )
    return (
        f'<svg role="img" aria-label="events per run" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">{"".join(parts)}</svg>'
    )


def history_rows(runs: list[dict[str, Any]]) -> str:
    """The rows of a site's history table, newest run first. Made here rather than in the template:
    a year of nightly ranks is hundreds of rows, which Jinja renders several times slower."""
    escape = html.escape
    rows = []
    for entry in reversed(runs):
        labels = sorted(entry["labels"].items(), key=lambda item: item[0].lower())  # Jinja's dictsort
        pills = "".join(f'<span class="pill">{escape(k)}={escape(v)}</span> ' for k, v in labels)
        names = ", ".join(f"{escape(name.split(':', 1)[1])} {count:,}" for name, count in entry["names"].items())
        started = (entry["started_at"] or "")[:19].replace("T", " ")
        rows.append(
            f'<tr><td><a class="mono" href="/runs/{quote(entry["run_id"], safe="")}">{escape(entry["run_id"])}</a></td>'
            f'<td class="mono">{escape(started)}</td><td>{pills}</td>'
            f'<td class="mono">{escape(_where(entry["site_file"], entry["site_line"]))}</td>'
            f'<td class="mono">{names}</td><td class="num">{entry["events"]:,}</td></tr>'
        )
    return "\n".join(rows)


@router.get("/sites/{site_key}", response_class=HTMLResponse)
def site_page(request: Request, site_key: str) -> HTMLResponse:
    frames_mode(request)
    database = service_of(request).database
    with database.read() as cursor:
        site = queries.site(cursor, site_key, 5, database.state_key())
    names = sorted({n for entry in site["runs"] for n in entry["names"]})
    return render(
        request, "site.html.j2", site=site, chart=history_chart(site["runs"]), rows=history_rows(site["runs"]),
        names=names,
    )  # fmt: skip


@router.get("/kernels/{name:path}", response_class=HTMLResponse)
def kernel_page(request: Request, name: str) -> HTMLResponse:
    with service_of(request).database.read() as cursor:
        kinds = queries.event_kinds(cursor, name)
        if not kinds:
            raise NotFoundError(f"no event named {name!r} in the database")
        sites = queries.kernel_sites(cursor, name, None, None, 50)
    return render(request, "kernel.html.j2", name=name, kinds=kinds, sites=sites)


# ------------------------------------------------------------------------------------------ compare


def _compare_form(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.query_params.items()}


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request) -> HTMLResponse:
    form = _compare_form(request)
    with service_of(request).database.read() as cursor:
        values = queries.label_values(cursor)
    if not form.get("baseline") and not form.get("baseline_window"):
        return render(request, "compare.html.j2", form=form, report=None, values=values, icicle_src=None, chart="")
    report_request: ReportRequest = _request_from(request)
    with service_of(request).database.read() as cursor:
        report: RegressionReport = compare(cursor, with_suspects(request, report_request), None)
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if v])
    return render(
        request, "compare.html.j2", form=form, report=report, values=values, query=query,
        icicle_src="/api/compare/icicle?" + query,
        chart=bar_chart(report.sites), shown=COMPARED_SHOWN, unit=f" per {report_request.per[1]}" if report_request.per else "",
    )  # fmt: skip


def _request_from(request: Request) -> ReportRequest:
    params = request.query_params

    def number(key: str, cast, default):
        text = params.get(key)
        if text in (None, ""):
            return default
        try:
            value = cast(text)
        except ValueError:
            raise UsageError(f"{key} must be a number, not {text!r}") from None
        if value < 0 or (key == "baseline_window" and value < 1):
            raise UsageError(f"{key} must be {'at least 1' if key == 'baseline_window' else 'positive'}, not {text!r}")
        return value

    return compare_params(
        candidate=params.get("candidate") or "latest",
        baseline=params.get("baseline") or None,
        baseline_window=number("baseline_window", int, None),
        label=[v for v in params.getlist("label") if v],
        kind=[v for v in params.getlist("kind") if v],
        per=params.get("per") or None,
        group_by=params.get("group_by") or None,
        vary=[v for v in params.getlist("vary") if v],
        threshold_rel=number("threshold_rel", float, 0.0),
        threshold_abs=number("threshold_abs", float, 0.0),
    )


# ------------------------------------------------------------------------------------------ SQL, API


@router.get("/sql", response_class=HTMLResponse)
def sql_page(request: Request, sql: str = "") -> HTMLResponse:
    config = service_of(request).config
    return render(
        request, "sql.html.j2", sql=sql, canned=CANNED_QUERIES, timeout_s=config.query_timeout_s,
        max_rows=config.query_max_rows,
    )  # fmt: skip


@router.get("/api", response_class=HTMLResponse)
def api_page(request: Request) -> HTMLResponse:
    schema = request.app.openapi()
    endpoints = []
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            params = [p["name"] for p in operation.get("parameters", []) if p.get("in") == "query"]
            endpoints.append((method.upper(), path, operation.get("summary", ""), params))
    return render(request, "api.html.j2", endpoints=endpoints)
