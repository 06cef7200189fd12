"""`tbpipe report`: nightly runs of a small program, really captured with `tbpipe run`, compared.

Every night is a fresh checkout in a folder of its own (build-N/repo), two ranks each, labelled
suite/commit/rank. Nights 1-5 run version 1; night 6 runs version 2, which
  - launches `softmax` twice as often (a site doubled),
  - adds a function that launches `layernorm` (a new site),
  - launches `gemm_splitk` from the line that launches `gemm` (a new kernel at a known site),
  - moves `moved()` down by inserted lines (a site moved, its key the same),
  - keeps `gemm` as it was (unchanged),
and `gather` is launched a data-dependent number of times every night (it must not alarm against
the window). Night 7 runs version 1 for two steps instead of one (normalised away by --per).
Expected lines are read from the program texts, never from the report.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from conftest import TBPIPE
from support.browser import ARTIFACTS, chromium_page, regressions_fit_the_page, tracebacks_show_whole_lines

VERSION_1 = """import sys

from tbpipe import capture


def unchanged():
    for name in ("gemm", "gemm", "gemm"):
        capture.record("kernel_launch", name)  # the gemm site


def doubled(n):
    for _ in range(n):
        capture.record("kernel_launch", "softmax")  # the softmax site


def moved():
    for _ in range(2):
        capture.record("op", "aten::mm")  # the mm site


def data_dependent(night):
    for _ in range(5 + night % 3):
        capture.record("kernel_launch", "gather")  # the gather site


def main(night, steps):
    for _ in range(steps):
        capture.record("step", "train")
        unchanged()
        doubled(4)
        moved()
        data_dependent(night)


main(int(sys.argv[1]), int(sys.argv[2]))
"""


def version_2() -> str:
    text = VERSION_1.replace('("gemm", "gemm", "gemm")', '("gemm", "gemm", "gemm", "gemm_splitk")')
    text = text.replace("def moved():", "# Two comment lines inserted\n# above moved().\n\n\ndef moved():")
    text = text.replace("        doubled(4)", "        doubled(8)\n        added()")
    return text.replace(
        "def main(night, steps):",
        'def added():\n    capture.record("kernel_launch", "layernorm")  # the layernorm site\n\n\ndef main(night, steps):',
    )


def line_of(text: str, marker: str) -> int:
    (number,) = [i for i, line in enumerate(text.splitlines(), 1) if marker in line]
    return number


def tbpipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([*TBPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=180, env=env)


def capture_night(root: Path, night: int, text: str, *, commit: str, steps: int = 1, ranks: int = 2) -> None:
    checkout = root / f"build-{night}" / "repo"
    checkout.mkdir(parents=True)
    (checkout / "app.py").write_text(text)
    for rank in range(ranks):
        result = tbpipe(
            "run", "--out", str(root / "runs"), "--label", "suite=app", "--label", f"commit={commit}",
            "--label", f"rank={rank}", "--", sys.executable, "app.py", str(night), str(steps),
            cwd=checkout,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def nights(tmp_path_factory, symbol_cache) -> Path:
    root = tmp_path_factory.mktemp("nightly")
    for night in range(1, 6):
        capture_night(root, night, VERSION_1, commit=f"c{night}")
    capture_night(root, 6, version_2(), commit="c6")
    capture_night(root, 7, VERSION_1, commit="c7-long", steps=2)
    return root


@pytest.fixture(scope="module")
def db(nights, symbol_cache) -> Path:
    path = nights / "tbpipe.duckdb"
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache))
    result = subprocess.run(
        [*TBPIPE, "ingest", str(nights / "runs"), "--db", str(path)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return path


def report_json(db: Path, *args: str) -> dict:
    result = tbpipe("report", "--db", str(db), "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def by_name(report: dict) -> dict[str, dict]:
    sites = {}
    for site in report["sites"]:
        assert site["name"] not in sites, site
        sites[site["name"]] = site
    return sites


def test_pair_report_sites_across_checkouts(db, nights) -> None:
    report = report_json(db, "--candidate", "commit=c6", "--baseline", "commit=c5")
    assert report["format"] == 1 and report["mode"] == "pair"
    assert len(report["candidate"]["run_ids"]) == 2 and len(report["baseline"][0]["run_ids"]) == 2
    sites = by_name(report)
    v1, v2 = VERSION_1, version_2()
    # Counts are summed over both ranks of each group.
    expected = {
        "softmax": ("increased", 8, 16, line_of(v2, "the softmax site")),
        "layernorm": ("new", 0, 2, line_of(v2, "the layernorm site")),
        "gemm_splitk": ("new", 0, 2, line_of(v2, "the gemm site")),
        "gemm": ("unchanged", 6, 6, line_of(v2, "the gemm site")),
        "aten::mm": ("moved", 4, 4, line_of(v2, "the mm site")),
        "gather": ("decreased", 2 * (5 + 5 % 3), 2 * (5 + 6 % 3), line_of(v2, "the gather site")),
        "train": ("moved", 2, 2, line_of(v2, '"step", "train"')),
    }
    assert set(sites) == set(expected)
    for name, (change, baseline, candidate, line) in expected.items():
        site = sites[name]
        assert (site["change"], site["baseline_events"], site["candidate_events"], site["site_line"]) == (
            change,
            baseline,
            candidate,
            line,
        ), name
        assert site["site_portable_file"] == "app.py"
        assert site["site_file"] == str(nights / "build-6" / "repo" / "app.py")
    assert sites["aten::mm"]["baseline_line"] == line_of(v1, "the mm site") != line_of(v2, "the mm site")
    assert sites["layernorm"]["site_known"] is False and sites["gemm_splitk"]["site_known"] is True
    assert sites["gemm_splitk"]["site_key"] == sites["gemm"]["site_key"]
    assert {s["name"] for s in report["regressions"]} == {"softmax", "layernorm", "gemm_splitk"}
    assert all(s["flagged"] for s in report["regressions"])
    # The site key is the same in every checkout folder: file relative to its root, function, offset.
    unchanged = hashlib.md5(
        f"py\x1fapp.py\x1funchanged\x1f{line_of(v1, 'the gemm site') - line_of(v1, 'def unchanged')}".encode()
    ).hexdigest()[:16]
    assert sites["gemm"]["site_key"] == unchanged
    con = duckdb.connect(str(db), read_only=True)
    try:
        per_night = con.execute(
            "SELECT count(DISTINCT site_file), count(DISTINCT site_key) FROM call_sites WHERE name = 'gemm'"
        ).fetchone()
    finally:
        con.close()
    assert per_night == (7, 1)  # seven checkout folders, one site
    # Environment: the label that changed is said first of all.
    assert {"what": "label commit", "baseline": "c5", "candidate": "c6"} in report["environment"]
    # Tracebacks of flagged sites: combined, innermost first, Python and native frames.
    frames = report["regressions"][0]["traceback"]
    assert frames[0]["kind"] == "python" and any(f["kind"] == "native" for f in frames)


def test_window_does_not_alarm_on_data_dependent_sites(db) -> None:
    report = report_json(db, "--candidate", "commit=c6", "--baseline-window", "5", "--group-by", "commit")
    assert report["mode"] == "window"
    assert [s["name"] for s in report["baseline"]] == [f"commit=c{n}" for n in range(1, 6)]
    sites = by_name(report)
    gather = sites["gather"]
    assert gather["spread"]["values"] == [2 * (5 + n % 3) for n in range(1, 6)]
    assert gather["candidate_events"] == 2 * (5 + 6 % 3)
    assert gather["flagged"] is False and gather["change"] in ("unchanged", "moved")
    assert {s["name"] for s in report["regressions"]} == {"softmax", "layernorm", "gemm_splitk"}
    # Every window night agreed on softmax: its spread is flat, the change exact.
    assert sites["softmax"]["spread"]["values"] == [8.0] * 5 and sites["softmax"]["baseline_events"] == 8


def test_label_selection_latest_and_filters(db, nights) -> None:
    # The newest run of rank 1 (night 7), against rank 1 of night 5 only.
    report = report_json(db, "--candidate", "latest:rank=1", "--baseline", "latest:commit=c5,rank=1")
    assert report["candidate"]["labels"] == {"suite": "app", "commit": "c7-long", "rank": "1"}
    assert report["baseline"][0]["labels"]["rank"] == "1" and len(report["baseline"][0]["run_ids"]) == 1
    assert by_name(report)["softmax"]["candidate_events"] == 8  # two steps of rank 1 alone
    # --label filters what `latest` and the window see; --group-by makes a run stand for its group.
    grouped = report_json(
        db, "--candidate", "latest", "--label", "rank=0", "--baseline-window", "2", "--group-by", "commit"
    )
    assert grouped["candidate"]["name"] == "commit=c7-long"
    assert len(grouped["candidate"]["run_ids"]) == 1  # rank 0 only
    assert [s["name"] for s in grouped["baseline"]] == ["commit=c5", "commit=c6"]


def test_per_normalises_runs_of_different_length(db) -> None:
    raw = report_json(db, "--candidate", "commit=c7-long", "--baseline", "commit=c5")
    assert by_name(raw)["softmax"]["change"] == "increased" and raw["regressions"]
    result = tbpipe(
        "report", "--db", str(db), "--format", "json", "--candidate", "commit=c7-long", "--baseline", "commit=c5",
        "--per", "step:train", "--fail-on-regression",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    per = json.loads(result.stdout)
    sites = by_name(per)
    assert "train" not in sites  # the marker itself is not compared
    assert sites["softmax"]["baseline_events"] == sites["softmax"]["candidate_events"] == 4.0
    assert per["candidate"]["markers"] == 4 and per["baseline"][0]["markers"] == 2
    assert per["regressions"] == []


def test_markdown_starts_with_the_verdict_and_folds_tracebacks(db) -> None:
    result = tbpipe("report", "--db", str(db), "--candidate", "commit=c6", "--baseline", "commit=c5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(":x: **3 regressions (2 new, 1 increased)")
    table = [line for line in lines if line.startswith("| ") and "`app.py:" in line]
    assert len(table) == 3
    assert result.stdout.count("<details>") == 3 and "```" in result.stdout
    # Tracebacks focused as every other view is by default (program): start-up folded into one row,
    # the program's Python frames kept; `--frames all` shows the interpreter's start-up itself.
    blocks = [block.split("```")[0] for block in result.stdout.split("```\n")[1::2]]
    assert len(blocks) == 3 and all("[start-up]" in block and "\npy " in "\n" + block for block in blocks)
    assert not any("Py_RunMain" in block for block in blocks)
    everything = tbpipe(
        "report", "--db", str(db), "--candidate", "commit=c6", "--baseline", "commit=c5", "--frames", "all"
    )
    assert "[start-up]" not in everything.stdout and "Py_RunMain" in everything.stdout
    python = tbpipe(
        "report", "--db", str(db), "--candidate", "commit=c6", "--baseline", "commit=c5", "--frames", "python"
    )
    python_blocks = [block.split("```")[0] for block in python.stdout.split("```\n")[1::2]]
    assert all(line.startswith("py ") for block in python_blocks for line in block.splitlines())
    # Night 5 launches gather 7 times a rank where night 4 did 6: past 10% but not past 50%.
    loose = ("report", "--db", str(db), "--candidate", "commit=c5", "--baseline", "commit=c4")
    assert tbpipe(*loose, "--threshold-rel", "0.1").stdout.startswith(":x: **1 regression (1 increased)")
    quiet = tbpipe(*loose, "--threshold-rel", "0.5")
    assert quiet.stdout.startswith(":white_check_mark: **No regressions")
    assert tbpipe(*loose, "--threshold-abs", "2").stdout.startswith(":white_check_mark:")


def test_exit_codes(db) -> None:
    flagged = ("report", "--db", str(db), "--candidate", "commit=c6", "--baseline", "commit=c5")
    assert tbpipe(*flagged).returncode == 0
    failing = tbpipe(*flagged, "--fail-on-regression")
    assert failing.returncode == 1 and failing.stdout.startswith(":x:")
    clean = tbpipe(
        "report", "--db", str(db), "--candidate", "commit=c5", "--baseline", "commit=c4", "--threshold-rel", "0.5",
        "--fail-on-regression",
    )  # fmt: skip
    assert clean.returncode == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--candidate", "no-such-run", "--baseline", "commit=c5"], "no such run in the database"),
        (["--candidate", "commit=c9", "--baseline", "commit=c5"], "no run has commit=c9 (commit: c1, c2"),
        (["--candidate", "latest:commit=c1", "--baseline-window", "3"], "no earlier run than"),
        (["--candidate", "commit=c5"], "give a baseline"),
        (["--candidate", "commit=c5", "--baseline", "commit=c4", "--per", "step:nope"], "recorded no step 'nope'"),
        (["--candidate", "commit=c5", "--baseline", "commit=c5"], "share runs"),
        (["--candidate", "commit=c5", "--baseline", "commit=c4", "--per", "step"], "expected KIND:NAME"),
        (["--candidate", "commit=c5", "--baseline", "commit=c4", "--frames", "mine"], "--frames is one of program"),
    ],
)
def test_bad_input_is_one_clear_line(db, args, message) -> None:
    result = tbpipe("report", "--db", str(db), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_accept_file(db, tmp_path) -> None:
    v2 = version_2()
    accept = tmp_path / "accepted.toml"
    accept.write_text(
        "[[accept]]\n"
        'site = "app.py:doubled"\nname = "softmax"\nreason = "bigger batches"\n\n'
        "[[accept]]\n"
        'site = "app.py:unchanged"\nname = "gemm_*"\nuntil = 2999-01-01\nreason = "split-K for long inputs"\n\n'
        "[[accept]]\n"
        'site = "app.py:added"\nuntil = 2001-01-01\nreason = "long expired"\n'
    )
    args = ("report", "--db", str(db), "--format", "json", "--candidate", "commit=c6", "--baseline", "commit=c5")
    result = tbpipe(*args, "--accept", str(accept), "--fail-on-regression")
    assert result.returncode == 1  # layernorm's entry expired: it still fails
    report = json.loads(result.stdout)
    assert [s["name"] for s in report["regressions"]] == ["layernorm"]
    assert {s["name"]: s["accepted"] for s in report["accepted"]} == {
        "softmax": "app.py:doubled softmax: bigger batches",
        "gemm_splitk": "app.py:unchanged gemm_* until 2999-01-01: split-K for long inputs",
    }
    assert report["expired_accepts"] == ["app.py:added until 2001-01-01: long expired"]
    assert by_name(report)["layernorm"]["site_line"] == line_of(v2, "the layernorm site")
    accept.write_text('[[accept]]\nsite = "app.py"\nreason = "x"\n')
    bad = tbpipe(*args, "--accept", str(accept))
    assert bad.returncode == 2 and f"{accept}: [[accept]] entry 1: 'site' must be" in bad.stderr


@pytest.mark.default_interpreter_only
def test_html_report_in_chromium(db, tmp_path) -> None:
    page_file = tmp_path / "report.html"
    result = tbpipe(
        "report", "--db", str(db), "--candidate", "commit=c6", "--baseline-window", "5", "--group-by", "commit",
        "--format", "html", "--out", str(page_file),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = page_file.read_text()
    assert "http://" not in text and "https://" not in text  # nothing fetched from anywhere
    with chromium_page() as page:
        page.goto(page_file.as_uri())
        assert page.inner_text("#verdict").startswith("3 regressions (2 new, 1 increased)")
        rows = page.locator("#regressions tr.regression")
        assert rows.count() == 3
        assert page.locator("#regressions .frame.python").first.is_visible() is False
        rows.first.locator("summary").click()
        assert rows.first.locator(".frame.python").first.is_visible()
        assert rows.first.locator(".frame.native").count() > 0
        assert regressions_fit_the_page(page)  # long frames wrap inside their cell
        assert tracebacks_show_whole_lines(page)
        assert page.locator("svg.chart rect").count() >= 4
        assert page.locator("#regressions svg.trend").count() == 3
        page.locator("#all-sites summary").click()
        page.fill("#site-filter", "gather")
        visible = [r for r in page.locator("#sites tr").all()[1:] if r.is_visible()]
        assert len(visible) == 1 and "gather" in visible[0].inner_text()
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)


def _visible_rows(traceback) -> list[tuple[str, str]]:
    """(kind class, text) of the rows a traceback shows in the page's mode."""
    return [
        (classes.split()[1], text)
        for classes, text in traceback.locator(".frame").evaluate_all(
            "rows => rows.filter(r => r.offsetParent !== null).map(r => [r.className, r.innerText])"
        )
    ]


@pytest.mark.default_interpreter_only
def test_html_report_switches_focus_modes_in_chromium(db, tmp_path) -> None:
    """The report's tracebacks in each mode show what `focus.focus_frames` gives (the one rule); the
    switch changes no count and keeps the mode in the URL."""
    from tbpipe.pipeline.db import read
    from tbpipe.pipeline.stacks import focus

    args = ("--candidate", "commit=c6", "--baseline", "commit=c5", "--group-by", "commit", "--no-suspects")
    page_file = tmp_path / "report.html"
    result = tbpipe("report", "--db", str(db), *args, "--format", "html", "--out", str(page_file))
    assert result.returncode == 0, result.stderr
    regressions = report_json(db, *args)["regressions"]
    with duckdb.connect(str(db), read_only=True) as con:
        rules = read.focus_rules(con)
    expected = {mode: [focus.focus_frames(r["traceback"], mode, rules) for r in regressions] for mode in focus.MODES}
    with chromium_page() as page:
        page.goto(page_file.as_uri())
        rows = page.locator("#regressions tr.regression")
        assert rows.count() == len(regressions) > 0
        for row in rows.all():
            row.locator("details.traceback summary").click()
        counts = page.locator("#regressions td.num").all_inner_texts()
        first = rows.first.locator(".frames")
        assert page.locator("body").get_attribute("data-frames") == "program"
        # Program mode: the program's own frames, then the start-up folded into one row.
        shown = _visible_rows(first)
        assert shown[-1][0] == "folded" and shown[-1][1].startswith("[start-up] ")
        assert {kind for kind, _ in shown[:-1]} == {"python"}
        assert all("app.py:" in text for _, text in shown[:-1]) and "<module>" in shown[-2][1]
        page.screenshot(path=str(ARTIFACTS / "report-focus-program.png"), full_page=True)
        for mode in ("all", "python", "native", "program"):
            page.locator(f".focus-modes button[data-mode='{mode}']").first.click()
            assert page.locator("body").get_attribute("data-frames") == mode
            assert page.url.endswith("report.html" if mode == "program" else f"#frames={mode}")
            switches = page.locator(".focus-modes")
            on = page.locator(".focus-modes button.on").evaluate_all("buttons => buttons.map(b => b.dataset.mode)")
            assert on == [mode] * switches.count()
            for row, focused in zip(rows.all(), expected[mode]):
                shown = _visible_rows(row.locator(".frames"))
                assert len(shown) == len(focused), mode
                for (kind, text), frame in zip(shown, focused):
                    if isinstance(frame, focus.StartUp):
                        assert (kind, text) == ("folded", frame.text)
                    else:
                        assert kind == frame["kind"] and (frame["function"] or "??") in text, (mode, text)
            functions = {text.split()[-1] for _, text in _visible_rows(first)}
            if mode == "all":
                assert {"_start", "Py_BytesMain", "_PyEval_Vector", "<module>"} <= functions
            if mode == "python":
                assert "<module>" in functions and not functions & {"Py_BytesMain", "_PyEval_Vector"}
            if mode == "native":
                assert "Py_BytesMain" in functions and "<module>" not in functions
            assert page.locator("#regressions td.num").all_inner_texts() == counts  # folding changes no count
            if mode != "program":
                page.screenshot(path=str(ARTIFACTS / f"report-focus-{mode}.png"), full_page=True)
        # A link with the mode opens the page in it; a changed fragment switches it.
        page.goto("about:blank")
        page.goto(page_file.as_uri() + "#frames=native")
        assert page.locator("body").get_attribute("data-frames") == "native"
        assert page.locator(".focus-modes button.on").first.get_attribute("data-mode") == "native"
        page.evaluate("location.hash = 'frames=python'")
        page.wait_for_function("document.body.dataset.frames === 'python'")


def _downgrade_to_schema_2(path: Path) -> None:
    """Turns a database into what tbpipe wrote before schema 3: schema 12's table, schema 11's tables and column gone,
    schema 10's, 9's and 8's records gone (their events table goes with schema 4's), schema 7's indexes (those 9 left), schema 6's GPU
    tables and schema 5's table gone, schema 4's compact tables back into the wide ones (the events'
    attributes with their correlation ids, as schema 2 held them), schema 3's columns and table
    gone, sites keyed the old way."""
    con = duckdb.connect(str(path))
    try:
        for statement in (
            "DROP TABLE rolled_up_leads",
            "DELETE FROM schema_versions WHERE version = 12",
            *(f"DROP TABLE {table}" for table in ("rolled_up_counts", "rolled_up_name_counts", "rolled_up_threads")),
            "DROP TABLE rolled_up_forward_counts",
            "DROP TABLE rolled_up_runs",
            "ALTER TABLE runs DROP COLUMN rolled_up_at",
            "DELETE FROM schema_versions WHERE version = 11",
            "DELETE FROM schema_versions WHERE version = 10",
            "DELETE FROM schema_versions WHERE version = 9",
            "DELETE FROM schema_versions WHERE version = 8",
            "DROP INDEX sites_by_key",
            "DROP INDEX event_counts_by_stack",
            "DROP INDEX site_counts_by_site",
            "DELETE FROM schema_versions WHERE version = 7",
            "DROP TABLE gpu_time_counts",
            "DROP TABLE gpu_activity",
            "DELETE FROM schema_versions WHERE version = 6",
            "CREATE TABLE wide_frames AS SELECT stack_id, depth, slot, chain_depth, kind, function, file, line, "
            "module, module_key, address, exact, inlined, reason FROM stack_frames ORDER BY stack_id, depth",
            "CREATE TABLE wide_events AS SELECT * EXCLUDE (correlation_id) FROM events ORDER BY event_id",
            "DROP VIEW stack_frames",
            "DROP VIEW events",
            "DROP TABLE frames",
            "DROP TABLE stack_frame_rows",
            "DROP TABLE event_rows",
            "DROP TABLE site_counts",
            "ALTER TABLE wide_frames RENAME TO stack_frames",
            "ALTER TABLE wide_events RENAME TO events",
            "DELETE FROM sql_modules",  # the views and macros of that version were other texts
            "DROP TABLE generated_code",
            "DELETE FROM schema_versions WHERE version = 5",
            "DELETE FROM schema_versions WHERE version = 4",
            "ALTER TABLE runs DROP COLUMN cuda_version",
            "ALTER TABLE runs DROP COLUMN sys_path",
            "DROP TABLE source_files",
            "ALTER TABLE sites DROP COLUMN kind",
            "ALTER TABLE sites DROP COLUMN portable_file",
            "ALTER TABLE sites DROP COLUMN line_offset",
            "ALTER TABLE sites DROP COLUMN module",
            "ALTER TABLE stack_sites DROP COLUMN site_file",
            "ALTER TABLE stack_sites DROP COLUMN site_line",
            "DELETE FROM schema_versions WHERE version = 3",
            "DELETE FROM settings WHERE key = 'site_identity_backfilled'",
            # Schema 2 keyed sites by (function, absolute file, line).
            "UPDATE sites SET site_key = substr(md5(concat_ws(chr(31), coalesce(function, ''), coalesce(file, ''), "
            "coalesce(CAST(line AS VARCHAR), ''))), 1, 16)",
        ):
            con.execute(statement)
    finally:
        con.close()


def test_a_database_of_the_previous_schema_is_migrated_and_stays_comparable(nights, symbol_cache, tmp_path) -> None:
    old_runs, new_runs = tmp_path / "old", tmp_path / "new"
    for run_dir in (nights / "runs").iterdir():
        labels = json.loads((run_dir / "manifest.json").read_text())["labels"]
        target = new_runs if labels["commit"] == "c6" else old_runs
        if labels["commit"] in ("c5", "c6"):
            shutil.copytree(run_dir, target / run_dir.name)
    path = tmp_path / "old.duckdb"
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache))
    ingest = [*TBPIPE, "ingest", "--db", str(path)]
    assert subprocess.run([*ingest, str(old_runs)], capture_output=True, env=env).returncode == 0
    _downgrade_to_schema_2(path)

    refused = tbpipe("report", "--db", str(path), "--candidate", "commit=c5", "--baseline", "commit=c5")
    assert refused.returncode == 2 and "older than this tbpipe's" in refused.stderr
    result = subprocess.run([*ingest, str(new_runs)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    con = duckdb.connect(str(path), read_only=True)
    try:
        missing = con.execute(
            "SELECT count(*) FROM stack_frames WHERE kind = 'python' AND first_line IS NULL"
        ).fetchone()
        columns = [c for (c,) in con.execute("SELECT column_name FROM (DESCRIBE event_rows)").fetchall()]
    finally:
        con.close()
    assert missing == (0,)  # the old runs' first lines came back from their folders
    # The events table of schema 4, rebuilt by schemas 8 and 10: a CUDA call's correlation id in a column.
    assert columns == ["event_id", "run_number", "ts", "thread_id", "name_id", "stack_id", "attrs", "correlation_id"]
    report = report_json(path, "--candidate", "commit=c6", "--baseline", "commit=c5")
    assert {s["name"] for s in report["regressions"]} == {"softmax", "layernorm", "gemm_splitk"}
    assert by_name(report)["gemm"]["change"] == "unchanged"
