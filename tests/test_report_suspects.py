"""Suspects: which commit between two nights changed the code on a regressed site's stacks.

A real git repository is built here, and a small program in it is really captured (`tbpipe run`)
at its first commit and at its last. Between them:
  1. `launches()` loops twice as often: `softmax`, launched inside it, increases;
  2. an unrelated file changes;
  3. `helper()`, called by `step()` (the caller of `launches()`) but on no stack, changes a line;
  4. `step()` calls `added()` (a new `layernorm` site) instead of `old()` (the `gather` site, removed).
The nights run three ways: from one checkout folder, from two clones in different folders, and from
plain copies without git (commit labels only); all three must name the same suspects. A third night
at commit 1 makes a window whose newest night is past commit 1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TBPIPE
from support.browser import regressions_fit_the_page, tracebacks_show_whole_lines
from support.cupti_double import PRELUDE, build_double

from tbpipe.capture.manifest import git_state

APP = """import sys

from tbpipe import capture


def helper():
    total = 0
    for i in range(3):
        total += i
    return total


def launches(n):
    for _ in range(n):
        capture.record("kernel_launch", "softmax")  # the softmax site


def old():
    capture.record("kernel_launch", "gather")  # the gather site


def step():
    helper()
    launches(4)
    old()


def main():
    step()


main()
"""

# The edits of commits 1-4, applied to the program in turn.
LOOP = ("    for _ in range(n):", "    for _ in range(2 * n):")
HELPER = ("    for i in range(3):", "    for i in range(5):")
ADDED = 'def added():\n    capture.record("kernel_launch", "layernorm")  # the layernorm site\n\n\n'


def git_env(home: Path) -> dict[str, str]:
    """git as a fresh user would run it: no global or system configuration, a fixed author."""
    return dict(
        os.environ, HOME=str(home), GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="Ada", GIT_AUTHOR_EMAIL="ada@example.com",
        GIT_COMMITTER_NAME="Ada", GIT_COMMITTER_EMAIL="ada@example.com",
    )  # fmt: skip


def git(env: dict[str, str], cwd: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def commit_all(env: dict[str, str], repo: Path, message: str) -> str:
    git(env, repo, "add", "-A")
    git(env, repo, "commit", "-q", "-m", message)
    return git(env, repo, "rev-parse", "HEAD")


def line_of(text: str, marker: str) -> int:
    (number,) = [i for i, line in enumerate(text.splitlines(), 1) if marker in line]
    return number


class History:
    """The repository, its commits, and the database of every night."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env
        self.origin = root / "origin"
        self.origin.mkdir()
        git(env, self.origin, "init", "-q", "-b", "main")
        self.texts = [APP]
        (self.origin / "app.py").write_text(APP)
        (self.origin / "NOTES.md").write_text("notes\n")
        self.first = commit_all(env, self.origin, "first")
        self.loop = self._change("launch softmax twice per call", LOOP)
        (self.origin / "NOTES.md").write_text("notes\nmore notes\n")
        self.notes = commit_all(env, self.origin, "notes")
        self.helper = self._change("helper sums more", HELPER)
        text = self.texts[-1].replace("    old()\n", "    added()\n").replace("def step():", ADDED + "def step():")
        self.added = self._write(text, "layernorm instead of gather")
        self.final = self.texts[-1]

    def _change(self, message: str, edit: tuple[str, str]) -> str:
        return self._write(self.texts[-1].replace(*edit), message)

    def _write(self, text: str, message: str) -> str:
        self.texts.append(text)
        (self.origin / "app.py").write_text(text)
        return commit_all(self.env, self.origin, message)

    def clone(self, folder: Path, commit: str) -> Path:
        git(self.env, self.root, "clone", "-q", str(self.origin), str(folder))
        git(self.env, folder, "checkout", "-q", commit)
        return folder

    def capture(self, checkout: Path, *labels: str) -> None:
        args = [a for label in labels for a in ("--label", label)]
        result = subprocess.run(
            [*TBPIPE, "run", "--out", str(self.root / "runs"), *args, "--", sys.executable, "app.py"],
            cwd=checkout, capture_output=True, text=True, timeout=180, env=self.env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def history(tmp_path_factory, symbol_cache) -> History:
    root = tmp_path_factory.mktemp("suspects")
    env = dict(git_env(root), TBPIPE_CACHE_DIR=str(symbol_cache))
    h = History(root, env)
    # One checkout folder, moved from the first commit to the last between the nights.
    same = h.clone(root / "same" / "repo", h.first)
    h.capture(same, "suite=same", "night=1")
    git(env, same, "checkout", "-q", h.added)
    h.capture(same, "suite=same", "night=2")
    # A clone per night, in folders of their own; a night at commit 1 between them.
    h.capture(h.clone(root / "build-1" / "repo", h.first), "suite=moved", "night=1")
    h.capture(h.clone(root / "build-2" / "repo", h.loop), "suite=moved", "night=2")
    h.capture(h.clone(root / "build-3" / "repo", h.added), "suite=moved", "night=3")
    # Plain copies without git: only the commit labels say where they came from.
    for night, (commit, text) in enumerate(((h.first, APP), (h.added[:12], h.final)), 1):
        copy = root / f"plain-{night}" / "src"
        copy.mkdir(parents=True)
        (copy / "app.py").write_text(text)
        h.capture(copy, "suite=plain", f"night={night}", f"commit={commit}")
    h.db = root / "tbpipe.duckdb"
    result = subprocess.run(
        [*TBPIPE, "ingest", str(root / "runs"), "--db", str(h.db)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return h


def report(h: History, *args: str, cwd: Path | None = None, code: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [*TBPIPE, "report", "--db", str(h.db), *args],
        cwd=cwd or h.root, capture_output=True, text=True, timeout=180, env=dict(h.env, COLUMNS="200"),
    )  # fmt: skip
    assert result.returncode == code, result.stdout + result.stderr
    return result


def pair(suite: str, last: int = 2) -> tuple[str, ...]:
    return ("--candidate", f"suite={suite},night={last}", "--baseline", f"suite={suite},night=1")


def report_json(h: History, *args: str, cwd: Path | None = None) -> dict:
    return json.loads(report(h, "--format", "json", *args, cwd=cwd).stdout)


def sites(result: dict) -> dict[str, dict]:
    return {s["name"]: s for s in result["sites"]}


def summary(result: dict) -> dict[str, list[tuple]]:
    """What must not depend on where the nights ran: per site, each suspect with the frames it touched."""
    return {
        name: [
            (s["commit"], [(f["path"], f["function"], f["from_site"], f["what"]) for f in s["frames"]])
            for s in site["suspects"]
        ]
        for name, site in sites(result).items()
        if site["suspects"] is not None
    }


def test_git_state_is_read_from_the_checkouts_files(tmp_path) -> None:
    """HEAD from the files (a branch, packed refs, a worktree's own HEAD), dirty from `git status`."""
    env = git_env(tmp_path)
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    git(env, repo, "init", "-q", "-b", "main")
    (repo / "app.py").write_text("print(1)\n")
    first = commit_all(env, repo, "first")
    (repo / "app.py").write_text("print(2)\n")
    second = commit_all(env, repo, "second")
    git(env, repo, "pack-refs", "--all")
    assert git_state(str(repo / "sub")) == {"commit": second, "branch": "main", "dirty": False, "root": str(repo)}
    (repo / "app.py").write_text("changed\n")
    assert git_state(str(repo))["dirty"] is True
    git(env, repo, "worktree", "add", "-q", "--detach", str(tmp_path / "tree"), first)
    assert git_state(str(tmp_path / "tree")) == {
        "commit": first, "branch": None, "dirty": False, "root": str(tmp_path / "tree"),
    }  # fmt: skip
    assert git_state(str(tmp_path)) is None


@pytest.mark.default_interpreter_only
def test_the_runs_manifests_say_where_they_ran(history) -> None:
    manifests = [json.loads(p.read_text()) for p in (history.root / "runs").glob("*/manifest.json")]
    by_folder = {m["cwd"]: m["git"] for m in manifests}
    assert by_folder[str(history.root / "build-2" / "repo")] == {
        "commit": history.loop, "branch": None, "dirty": False, "root": str(history.root / "build-2" / "repo"),
    }  # fmt: skip
    assert by_folder[str(history.root / "plain-1" / "src")] is None


@pytest.mark.default_interpreter_only
def test_suspects_of_increased_new_and_removed_sites(history) -> None:
    h = history
    result = report_json(h, *pair("moved", 3), "--repo", str(h.origin))
    assert result["history"] == {
        "repository": str(h.origin), "baseline": h.first, "candidate": h.added, "commits": 4, "note": None,
        "warnings": [],
    }  # fmt: skip
    assert all("suspects" in s for s in result["regressions"])
    by_name = sites(result)
    assert {s["name"] for s in result["regressions"]} == {"softmax", "layernorm"}

    # softmax: the loop count in its own function is the top suspect; the notes and helper() are none.
    softmax = by_name["softmax"]
    assert softmax["change"] == "increased"
    commits = [s["commit"] for s in softmax["suspects"]]
    assert commits[0] == h.loop
    assert h.notes not in commits and h.helper not in commits
    top = softmax["suspects"][0]
    assert (top["subject"], top["author"]) == ("launch softmax twice per call", "Ada")
    assert re.match(r"\d{4}-\d\d-\d\dT", top["author_date"])
    loop_line = line_of(h.final, 'capture.record("kernel_launch", "softmax")')
    assert [(f["where"], f["depth"], f["from_site"], f["what"]) for f in top["frames"]] == [
        (f"app.py:{loop_line}:launches", 0, 0, "function")
    ]
    assert top["frames"][0]["file"] == str(h.root / "build-3" / "repo" / "app.py")
    assert top["hunks"] == [
        {"path": "app.py", "text": f"@@ -{line_of(APP, LOOP[0])} +{line_of(h.final, LOOP[1])} @@ def launches(n):\n"
         f"-{LOOP[0]}\n+{LOOP[1]}"}
    ]  # fmt: skip
    # Commit 4 changed step(), the caller: a suspect, ranked after the change to the site's function.
    assert commits == [h.loop, h.added]
    assert [(f["function"], f["from_site"]) for f in softmax["suspects"][1]["frames"]] == [("step", 1)]

    # layernorm: a new site, its line added by commit 4.
    layernorm = by_name["layernorm"]
    assert layernorm["change"] == "new"
    assert [s["commit"] for s in layernorm["suspects"]] == [h.added]
    first = layernorm["suspects"][0]["frames"][0]
    assert (first["line"], first["function"], first["from_site"], first["what"]) == (
        line_of(h.final, "the layernorm site"), "added", 0, "line",
    )  # fmt: skip
    assert any("+    added()" in hunk["text"] for hunk in layernorm["suspects"][0]["hunks"])

    # gather: removed; explained from the baseline's stacks (lines of the first commit).
    gather = by_name["gather"]
    assert gather["change"] == "removed"
    assert [s["commit"] for s in gather["suspects"]] == [h.added]
    frame = gather["suspects"][0]["frames"][0]
    assert (frame["line"], frame["function"], frame["from_site"], frame["what"]) == (
        line_of(APP, "    old()"), "step", 1, "line",
    )  # fmt: skip


@pytest.mark.default_interpreter_only
def test_the_same_suspects_whatever_folder_the_nights_ran_in(history) -> None:
    h = history
    moved = report_json(h, *pair("moved", 3), "--repo", str(h.origin))
    same = report_json(h, *pair("same"), "--repo", str(h.origin))
    # Plain copies: no recorded checkout, the commit labels name the commits (the second by a prefix);
    # the repository is the working folder's.
    plain = report_json(h, *pair("plain"), cwd=h.origin)
    assert plain["history"]["repository"] == str(h.origin)
    assert (plain["history"]["baseline"], plain["history"]["candidate"]) == (h.first, h.added)
    assert summary(moved) == summary(same) == summary(plain)
    assert summary(moved)["softmax"][0][0] == h.loop
    # Without --repo, from a folder outside any checkout: the checkout the candidate ran in.
    recorded = report_json(h, *pair("moved", 3))
    assert recorded["history"]["repository"] == str(h.root / "build-3" / "repo")
    assert summary(recorded) == summary(moved)


@pytest.mark.default_interpreter_only
def test_a_window_starts_at_its_newest_night(history) -> None:
    h = history
    result = report_json(
        h, "--candidate", "suite=moved,night=3", "--baseline-window", "2", "--group-by", "night", "--vary", "night",
        "--repo", str(h.origin),
    )  # fmt: skip
    assert [b["name"] for b in result["baseline"]] == ["night=1", "night=2"]
    assert (result["history"]["baseline"], result["history"]["commits"]) == (h.loop, 3)
    by_name = sites(result)
    assert by_name["softmax"]["flagged"] is False  # night 2 already launched it twice as often
    assert [s["commit"] for s in by_name["layernorm"]["suspects"]] == [h.added]


@pytest.mark.default_interpreter_only
def test_a_missing_history_is_said_once(history, tmp_path) -> None:
    h = history
    shallow = tmp_path / "depth-1"
    git(h.env, tmp_path, "clone", "-q", "--depth", "1", f"file://{h.origin}", str(shallow))
    text = report(h, *pair("moved", 3), "--repo", str(shallow)).stdout
    assert len([line for line in text.splitlines() if "shallow" in line]) == 1
    assert re.search(r"^Suspects: none looked for: .*has no commit .*shallow clone.*--unshallow", text, re.M)
    assert text.startswith(":x: **2 regressions (1 new, 1 increased)")  # the same verdict as with suspects
    assert "top suspect" not in text and text.count("<details>") == 2  # the two tracebacks, no suspects
    result = report_json(h, *pair("moved", 3), "--repo", str(shallow))
    assert result["history"]["note"].startswith("the baseline night=1,suite=moved")
    assert {s["name"] for s in result["regressions"]} == {"softmax", "layernorm"}
    assert all(s["suspects"] is None for s in result["sites"])
    # Plain copies with no checkout anywhere: said why; --no-suspects: not a word.
    outside = report(h, *pair("plain"), cwd=tmp_path).stdout
    assert outside.count("Suspects:") == 1 and "no git repository" in outside
    assert "Suspects" not in report(h, *pair("plain"), "--no-suspects", cwd=tmp_path).stdout
    bad = report(h, *pair("plain"), "--repo", str(tmp_path / "nowhere"), code=2)
    assert f"--repo {tmp_path / 'nowhere'}: not a git repository" in bad.stderr


@pytest.mark.default_interpreter_only
def test_markdown_puts_the_top_suspect_on_the_regressions_line(history) -> None:
    h = history
    text = report(h, *pair("moved", 3), "--repo", str(h.origin)).stdout
    assert "Suspects: 4 commits from " + h.first[:10] + " to " + h.added[:10] in text
    (softmax,) = [line for line in text.splitlines() if line.startswith("| increased") and "`softmax`" in line]
    assert softmax.endswith(f"`{h.loop[:10]}` launch softmax twice per call (site function `app.py:"
                            f"{line_of(h.final, 'the softmax site')}:launches`) |")  # fmt: skip
    folded = text.split("<summary>2 suspects of softmax")[1].split("</details>")[0]
    assert folded.index(h.loop[:10]) < folded.index(h.added[:10])
    assert f"+{LOOP[1]}" in folded and "```diff" in folded
    traceback = text.split("<summary>softmax at ")[1].split("</details>")[0]
    assert f"launches  <- changed by {h.loop[:10]}" in traceback and "helper" not in traceback
    assert f"- removed `gather` at `app.py:{line_of(APP, 'the gather site')}`: `{h.added[:10]}`" in text


@pytest.mark.default_interpreter_only
def test_html_report_shows_hunks_and_changed_frames(history, tmp_path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium package is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    h = history
    page_file = tmp_path / "report.html"
    report(h, *pair("moved", 3), "--repo", str(h.origin), "--format", "html", "--out", str(page_file))
    artifacts = Path(__file__).resolve().parents[1] / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(page_file.as_uri())
            assert page.inner_text("#history").startswith("Suspects: 4 commits")
            row = page.locator("#regressions tr.regression", has_text="softmax")
            assert f"top suspect: {h.loop[:10]} launch softmax twice per call" in row.locator(".suspect").inner_text()
            assert not row.locator("pre.hunk").first.is_visible()
            row.locator("details.suspects summary").click()
            row.locator("details.traceback summary").click()
            hunk = row.locator("pre.hunk").first
            assert hunk.is_visible() and f"+{LOOP[1]}" in hunk.inner_text()
            touched = row.locator(".frame.touched")
            functions = [re.search(r"app\.py:\d+\s+(\S+)", t)[1] for t in touched.all_inner_texts()]
            assert functions == ["launches", "step"]
            assert touched.first.get_attribute("title") == f"changed by {h.loop[:10]}"
            assert page.locator("#fewer-suspects tr", has_text="gather").count() == 1
            assert regressions_fit_the_page(page) and tracebacks_show_whole_lines(page)
            page.screenshot(path=str(artifacts / "report-suspects.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()


@pytest.mark.default_interpreter_only
def test_the_services_compare_page_and_api(history) -> None:
    import httpx
    from support.serve import Server

    h = history
    with Server(h.db, "--repo", str(h.origin), env=h.env) as server:
        args = {"candidate": "suite=moved,night=3", "baseline": "suite=moved,night=1"}
        api = httpx.get(server.url + "/api/compare", params=args, timeout=60).json()
        assert api == report_json(h, *pair("moved", 3), "--repo", str(h.origin))
        page = httpx.get(server.url + "/compare", params=args, timeout=60).text
    assert f'<code class="commit">{h.loop[:10]}</code> launch softmax twice per call' in page
    assert f'title="changed by {h.loop[:10]}"' in page and '<pre class="hunk">' in page
    assert 'id="history"' in page and "4 commits" in page


# GPU time per site: the `cuda` source driving the CUPTI test double (tests/cupti_double/), the
# durations the double's numbers. Commit 2 changes the gemm launch's line; commit 3 another function.
GPU_APP = (
    PRELUDE
    + """
GEMM = b"_Z4gemmIfEvPT_S1_"
duration = int(os.environ["GEMM_NS"])


def gemm_site(c):
    double.tbpipe_double_cuda_launch_kernel(GEMM, 4, 2, 1, 128, 1, 1, c_size_t(0), c_size_t(0), c)


def other():
    return 1


with capture.session(os.environ["OUT"], labels={"night": os.environ["NIGHT"]}, sources=["cuda"]):
    for c in range(1, 21):
        gemm_site(c)
        assert kernel_record(GEMM, c, int(duration * (1 + 0.02 * (c % 5 - 2)))) == 1
    other()
    double.tbpipe_double_activity_deliver(1)
"""
)


@pytest.mark.default_interpreter_only
def test_suspects_of_a_site_whose_gpu_time_grew(tmp_path, symbol_cache) -> None:
    double = build_double(tmp_path)
    if double is None:
        pytest.skip("no C compiler to build the libcupti test double")
    env = dict(git_env(tmp_path), TBPIPE_CACHE_DIR=str(symbol_cache), TBPIPE_CUPTI_LIBRARY=str(double))
    repo = tmp_path / "repo"
    repo.mkdir()
    git(env, repo, "init", "-q", "-b", "main")
    (repo / "gpu.py").write_text(GPU_APP)
    first = commit_all(env, repo, "first")
    (repo / "gpu.py").write_text(GPU_APP.replace("(GEMM, 4, 2, 1,", "(GEMM, 8, 2, 1,"))
    grid = commit_all(env, repo, "a wider grid")
    (repo / "gpu.py").write_text(GPU_APP.replace("(GEMM, 4, 2, 1,", "(GEMM, 8, 2, 1,").replace("return 1", "return 2"))
    other = commit_all(env, repo, "other")
    for number, commit, nanoseconds in ((1, first, "10000"), (2, other, "13000")):  # the last 30% slower a run
        git(env, repo, "checkout", "-q", commit)
        night = subprocess.run(
            [sys.executable, "gpu.py"], cwd=repo, capture_output=True, text=True, timeout=180,
            env=dict(env, OUT=str(tmp_path / "runs"), GEMM_NS=nanoseconds, NIGHT=str(number)),
        )  # fmt: skip
        assert night.returncode == 0, night.stderr
    db = tmp_path / "gpu.duckdb"
    loaded = subprocess.run([*TBPIPE, "ingest", str(tmp_path / "runs"), "--db", str(db)], env=env, capture_output=True)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    args = ("report", "--db", str(db), "--candidate", "night=2", "--baseline", "night=1", "--repo", str(repo))
    result = subprocess.run([*TBPIPE, *args, "--format", "json"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    gpu = json.loads(result.stdout)["gpu_time"]
    (slower,) = gpu["regressions"]
    assert slower["site_function"] == "gemm_site"
    assert [s["commit"] for s in slower["suspects"]] == [grid]
    (frame,) = slower["suspects"][0]["frames"]
    assert (frame["path"], frame["function"], frame["from_site"], frame["what"]) == ("gpu.py", "gemm_site", 0, "line")
    text = subprocess.run([*TBPIPE, *args], env=env, capture_output=True, text=True).stdout
    (row,) = [line for line in text.splitlines() if line.startswith("| increased") and "gemm_site" in line]
    assert row.endswith(
        f"`{grid[:10]}` a wider grid (site line `gpu.py:{line_of(GPU_APP, 'def gemm_site') + 1}:gemm_site`) |"
    )
