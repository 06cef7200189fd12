"""Suspects: the commits between the two sides that changed code on a regressed site's stacks.

For each regressed site (new, increased, GPU time slower) the candidate's stacks of that site are
read, each frame whose file lies in the repository is named by its path there, and two regions of
the file are followed back through the commits from the candidate's commit to the baseline's: the
frame's own statement, and its function's body (Python: the function's lines, less the bodies of
functions defined inside it; the module's frame: its top-level statements; native: the line, and the
hunks git places in that function). A commit whose diff touches a region is a suspect of the site.
A removed or decreased site is explained the same way from the baseline's stacks, forwards.

Ranking: a change to the site's own line, then to the site's function, then to frames nearer the
site (line before function), then farther callers; between equals, the commit touching more frames,
then the newer one. The commits are those along the candidate's first parents (a merge stands for
what it brought in). A file renamed inside the range is followed under its newer name only.

The result is typed (`Suspect`, `SuspectHistory`); the renderings read it. When the history is not
there (no repository, a commit it does not have, a shallow clone) `SuspectHistory.note` says why,
once, and no site gets suspects.
"""

from __future__ import annotations

import ast
import bisect
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.reports.regression.model import DECREASED, REMOVED
from tbpipe.pipeline.reports.regression.repository import Commit, GitError, Hunk, Repository

if TYPE_CHECKING:
    from tbpipe.pipeline.reports.regression.model import RegressionReport, RunSet

STACKS_PER_SITE = 20  # the heaviest stacks of a site that are read
SUSPECTS_PER_SITE = 10
HUNKS_PER_SUSPECT = 5
HUNK_LINES = 40
LINE, FUNCTION = "line", "function"


@dataclass
class TouchedFrame:
    """A frame of the site's stack whose code a suspect changed."""

    path: str  # the file in the repository
    line: int | None
    function: str | None
    file: str | None  # the file as captured
    kind: str  # 'python' or 'native'
    depth: int  # position in the stack, 0 = innermost
    from_site: int  # 0: the site's own frame; 1: its caller, 2: the caller's caller...; < 0: called by the site
    what: str  # 'line': the frame's own statement; 'function': elsewhere in its function's body

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line if self.line is not None else '?'}:{self.function or '??'}"

    def rank(self) -> tuple[int, bool, bool]:
        return abs(self.from_site), self.from_site < 0, self.what != LINE


@dataclass
class SuspectHunk:
    path: str
    text: str  # the @@ line and the -/+ lines (cut to HUNK_LINES)


@dataclass
class Suspect:
    commit: str
    subject: str
    author: str
    author_date: str  # ISO-8601
    merge: bool  # a merge commit: it stands for what it brought in along its second parent
    frames: list[TouchedFrame]  # best first
    hunks: list[SuspectHunk]

    @property
    def short(self) -> str:
        return self.commit[:10]

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "subject": self.subject,
            "author": self.author,
            "author_date": self.author_date,
            "merge": self.merge,
            "frames": [{**vars(f), "where": f.where} for f in self.frames],
            "hunks": [vars(h) for h in self.hunks],
        }


@dataclass
class SuspectHistory:
    """Where the suspects came from, or why there are none (`note`, said once for the whole report)."""

    repository: str | None = None
    baseline: str | None = None  # the baseline's commit (the newest night's, with a window)
    candidate: str | None = None
    commits: int | None = None  # commits between them along the candidate's first parents
    note: str | None = None  # why no suspects were looked for; None when they were
    warnings: list[str] = field(default_factory=list)  # things to know about the ones found
    seconds: float = 0.0

    @property
    def looked(self) -> bool:
        return self.note is None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "seconds"}  # the JSON says the same each time


# ------------------------------------------------------------------------------------------ entry point


def attach_suspects(
    con: Any, report: RegressionReport, repo: str | None, *, event_counts: str = "event_counts", cwd: Path | None = None
) -> None:
    """Fills `report.history` and the `suspects` of its regressed sites (and removed or decreased ones).
    `repo`: the repository (None: the working folder's checkout, else one the candidate ran in);
    `event_counts`: the table of events per stack the report counted (`--site-of` chooses it)."""
    started = time.monotonic()
    history = SuspectHistory()
    report.history = history
    try:
        _attach(con, report, repo, cwd or Path.cwd(), event_counts, history)
    except GitError as error:
        history.note = f"suspects left out: {error}"
        for site in [*report.sites, *report.gpu_sites]:
            site.suspects = None
    history.seconds = time.monotonic() - started


def _attach(
    con: Any, report: RegressionReport, repo_path: str | None, cwd: Path, event_counts: str, history: SuspectHistory
) -> None:
    limit = max(report.request.tracebacks, 0)
    forward = [s for s in report.sites if s.flagged and s.site_key is not None][:limit]
    gpu = [s for s in report.gpu_sites if s.flagged and s.site_key is not None][:limit]
    backward = [s for s in report.sites if s.change in (REMOVED, DECREASED) and s.site_key is not None][:limit]
    base_set, candidate_set = report.baseline[-1], report.candidate
    states = _git_states(con, [*candidate_set.run_ids, *base_set.run_ids])
    repo = _repository(repo_path, cwd, candidate_set, states, history)
    if repo is None:
        return
    history.repository = str(repo.root)
    candidate = _side_commit(repo, candidate_set, states, "candidate", history)
    baseline = _side_commit(repo, base_set, states, "baseline", history) if candidate else None
    if candidate is None or baseline is None:
        return
    history.candidate, history.baseline = candidate, baseline
    if baseline != candidate and not repo.is_ancestor(baseline, candidate):
        if repo.is_shallow():
            history.note = (
                f"{repo.root} is a shallow clone without the history between {base_set.name} ({baseline[:10]}) and "
                f"{candidate_set.name} ({candidate[:10]}): `git fetch --unshallow` brings it"
            )
            return
        history.warnings.append(
            f"{base_set.name} ({baseline[:10]}) is not an ancestor of {candidate_set.name} ({candidate[:10]}): "
            "the suspects are the commits only the candidate has"
        )
    history.commits = repo.commit_count(baseline, candidate) if baseline != candidate else 0
    for run_set in (candidate_set, base_set):
        dirty = [r for r in run_set.run_ids if states.get(r, {}).get("dirty") is True]
        if dirty:
            history.warnings.append(
                f"{len(dirty)} run{'s' if len(dirty) > 1 else ''} of {run_set.name} ran with uncommitted changes: "
                "their lines may differ from the commit's"
            )
    for site in [*forward, *gpu, *backward]:
        site.suspects = []
    if history.commits == 0:
        return
    explained = [(s, event_counts) for s in forward] + [(s, "gpu_time_counts") for s in gpu]
    if explained:
        _explain(con, repo, explained, candidate_set, candidate, (baseline, candidate), states, backwards=True)
    if backward:
        wanted = [(s, event_counts) for s in backward]
        _explain(con, repo, wanted, base_set, baseline, (baseline, candidate), states, backwards=False)


def touched_frames(suspects: list[Suspect] | None) -> dict[tuple[str | None, int | None, str | None], list[str]]:
    """(file as captured, line, function) of each frame the suspects touched -> their short hashes, for
    marking those frames in a printed traceback."""
    marks: dict[tuple[str | None, int | None, str | None], list[str]] = defaultdict(list)
    for suspect in suspects or []:
        for frame in suspect.frames:
            key = (frame.file, frame.line, frame.function)
            if suspect.short not in marks[key]:
                marks[key].append(suspect.short)
    return marks


# ------------------------------------------------------------------------------------------ repository and commits


def _git_states(con: Any, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per run, the checkout state the capture recorded (manifest `git`: commit, dirty, root)."""
    rows = query_rows(
        con,
        """
        SELECT run_id, json_extract_string(manifest, '$.git.commit'), json_extract_string(manifest, '$.git.root'),
               json_extract_string(manifest, '$.git.dirty')
        FROM runs WHERE list_contains(?, run_id)
        """,
        [run_ids],
    )
    return {
        run_id: {"commit": commit, "root": root, "dirty": {"true": True, "false": False}.get(dirty or "")}
        for run_id, commit, root, dirty in rows
    }


def _repository(
    explicit: str | None, cwd: Path, candidate: RunSet, states: dict[str, dict[str, Any]], history: SuspectHistory
) -> Repository | None:
    """`--repo`, else the working folder's checkout, else a checkout the candidate's runs were captured in
    when it is on this machine; of the last two, the first that has the candidate's commit."""
    if explicit is not None:
        repo = Repository.find(Path(explicit))
        if repo is None:
            history.note = f"--repo {explicit}: not a git repository (or git is not installed)"
        return repo
    found = []
    for folder in [cwd, *sorted({s["root"] for r, s in states.items() if r in candidate.run_ids and s["root"]})]:
        repo = Repository.find(Path(folder))
        if repo is not None and all(repo.root != f.root for f in found):
            found.append(repo)
    if not found:
        history.note = (
            "no git repository to read suspects from: the working folder is not a checkout and the candidate's "
            "runs were not captured in one on this machine (give --repo PATH)"
        )
        return None
    revisions = _side_revisions(candidate, states)
    return next((repo for repo in found if any(repo.commit(r) for r in revisions)), found[0])


def _recorded(run_set: RunSet, states: dict[str, dict[str, Any]]) -> list[str]:
    """The commits a side's runs were captured at, as the capture read them."""
    return sorted({states[r]["commit"] for r in run_set.run_ids if states.get(r, {}).get("commit")})


def _side_revisions(run_set: RunSet, states: dict[str, dict[str, Any]]) -> list[str]:
    """What names a side's commit: its `commit` label, then the revision its runs recorded."""
    revisions = []
    if run_set.labels.get("commit"):
        revisions.append(run_set.labels["commit"])
    recorded = _recorded(run_set, states)
    if len(recorded) == 1:
        revisions.append(recorded[0])
    return revisions


def _side_commit(
    repo: Repository, run_set: RunSet, states: dict[str, dict[str, Any]], role: str, history: SuspectHistory
) -> str | None:
    for revision in _side_revisions(run_set, states):
        commit = repo.commit(revision)
        if commit is not None:
            return commit
    recorded = _recorded(run_set, states)
    label = run_set.labels.get("commit")
    if not label and not recorded:
        history.note = (
            f"the {role} {run_set.name} has no commit: label its runs (--label commit=SHA) or capture them "
            "inside a git checkout"
        )
    elif not label and len(recorded) > 1:
        history.note = f"the {role} {run_set.name} was captured at {len(recorded)} different commits"
    else:
        names = [n for n in dict.fromkeys([*([label] if label else []), *recorded[:1]]) if n not in run_set.name]
        what = f"commit {' or '.join(names)}" if names else "such commit"
        history.note = f"the {role} {run_set.name}: {repo.root} has no {what}"
        if repo.is_shallow():
            history.note += " (a shallow clone: `git fetch --unshallow` brings the history)"
    return None


# ------------------------------------------------------------------------------------------ stacks and frames


@dataclass(frozen=True)
class _Frame:
    kind: str
    function: str | None
    file: str
    line: int | None
    first_line: int | None


def _stacks(con: Any, wanted: list[tuple[Any, str]], run_ids: list[str]) -> dict[int, list[tuple[int, int]]]:
    """Per wanted (site, table of its events per stack), by index, the site's heaviest stacks in these
    runs as (stack_id, site_depth)."""
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for source in dict.fromkeys(table for _, table in wanted):
        chosen = [(i, s) for i, (s, table) in enumerate(wanted) if table == source]
        keys = pa.table(
            {
                "i": pa.array([i for i, _ in chosen], pa.int64()),
                "kind": pa.array([s.kind for _, s in chosen], pa.string()),
                "name": pa.array([s.name for _, s in chosen], pa.string()),
                "site_key": pa.array([s.site_key for _, s in chosen], pa.string()),
            }
        )
        if source != "gpu_time_counts":
            sql = f"""
                SELECT w.i, c.stack_id, any_value(ss.site_depth)
                FROM {source} c
                JOIN runs r USING (run_number)
                JOIN event_names n USING (name_id)
                JOIN stack_sites ss USING (stack_id)
                JOIN sites t USING (site_id)
                JOIN report_suspects w ON w.kind = n.kind AND w.name = n.name AND w.site_key = t.site_key
                WHERE list_contains(?, r.run_id)
                GROUP BY w.i, c.stack_id
                QUALIFY row_number() OVER (PARTITION BY w.i ORDER BY sum(c.events) DESC, c.stack_id) <= ?
                """
        else:
            sql = """
                SELECT w.i, g.stack_id, any_value(ss.site_depth)
                FROM gpu_time_counts g
                JOIN runs r USING (run_number)
                JOIN stack_sites ss ON ss.stack_id = g.stack_id
                JOIN sites t ON t.site_id = ss.site_id
                JOIN report_suspects w ON w.kind = g.kind AND w.name = g.name AND w.site_key = t.site_key
                WHERE list_contains(?, r.run_id)
                GROUP BY w.i, g.stack_id
                QUALIFY row_number() OVER (PARTITION BY w.i ORDER BY sum(g.gpu_time_ns) DESC, g.stack_id) <= ?
                """
        con.register("report_suspects", keys)
        try:
            for i, stack_id, site_depth in query_rows(con, sql, [run_ids, STACKS_PER_SITE]):
                if site_depth is not None:
                    out[i].append((stack_id, site_depth))
        finally:
            con.unregister("report_suspects")
    return out


def _frames(con: Any, stack_ids: list[int]) -> dict[int, list[tuple[int, _Frame]]]:
    """Per stack, its (depth, frame) with a source file, innermost first."""
    rows = query_rows(
        con,
        """
        SELECT stack_id, depth, kind, function, file, line, first_line FROM stack_frames
        WHERE list_contains(?, stack_id) AND kind IN ('python', 'native') AND file IS NOT NULL
        ORDER BY stack_id, depth
        """,
        [stack_ids],
    )
    out: dict[int, list[tuple[int, _Frame]]] = defaultdict(list)
    for stack_id, depth, kind, function, file, line, first_line in rows:
        out[stack_id].append((depth, _Frame(kind, function, file, line, first_line)))
    return out


class _Paths:
    """Names a captured file by its path in the repository at one commit: relative to the checkout
    folder the runs recorded, else to the folder found by matching the sites' files to the tree
    (the longest path of the tree that the captured file ends with), so another checkout folder matches."""

    def __init__(self, tracked: frozenset[str], roots: set[str], site_files: set[str]):
        self.tracked = tracked
        self.by_name: dict[str, list[str]] = defaultdict(list)
        for path in tracked:
            self.by_name[path.rsplit("/", 1)[-1]].append(path)
        found = set(roots)
        for file in site_files:
            if os.path.isabs(file) and not self._under(file, found):
                suffix = self._longest_suffix(file)
                if suffix is not None:
                    found.add(file[: -len(suffix) - 1])
        self.roots = sorted(found, key=len, reverse=True)

    @staticmethod
    def _under(file: str, roots: set[str]) -> bool:
        return any(file.startswith(root.rstrip("/") + "/") for root in roots)

    def _longest_suffix(self, file: str) -> str | None:
        matches = [p for p in self.by_name.get(file.rsplit("/", 1)[-1], ()) if file.endswith("/" + p)]
        return max(matches, key=len) if matches else None

    def path(self, frame: _Frame) -> str | None:
        file = frame.file
        if not os.path.isabs(file):
            return file if file in self.tracked else None
        for root in self.roots:
            if file.startswith(root.rstrip("/") + "/"):
                relative = file[len(root.rstrip("/")) + 1 :]
                if relative in self.tracked:
                    return relative
        if frame.kind == "native":  # a build folder elsewhere: a path of at least two parts the tree has
            suffix = self._longest_suffix(file)
            return suffix if suffix is not None and "/" in suffix else None
        return None


# ------------------------------------------------------------------------------------------ regions


@dataclass(frozen=True)
class _Target:
    """One region of one file, followed through the commits: a frame's line, or its function's body."""

    path: str
    lines: frozenset[int]
    what: str
    native_function: str | None = None  # native body: hunks git places in this function


@dataclass(frozen=True)
class _Scope:
    """A function or class of a file: its first line (its first decorator's), last line, first body line."""

    start: int
    end: int
    body: int


@dataclass
class _Outline:
    """What a Python file's regions are made of, read from its syntax tree once."""

    scopes: list[_Scope]
    statements: list[tuple[int, int]]  # each statement's lines (a compound statement's header only)
    module: frozenset[int]  # the lines of top-level statements other than definitions


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _outline(source: bytes) -> _Outline | None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # newer syntax than this interpreter's, or not Python
        return None
    scopes, statements = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        end = node.end_lineno or node.lineno
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        body = getattr(node, "body", None)
        compound = isinstance(body, list) and body and isinstance(body[0], ast.stmt)
        if isinstance(node, _SCOPES):
            inline = not compound or body[0].lineno == node.lineno  # `def f(): ...` on one line
            scopes.append(_Scope(first, end, end + 1 if inline else body[0].lineno))
        statements.append((node.lineno, body[0].lineno - 1) if compound else (node.lineno, end))
    module = frozenset(
        line
        for node in tree.body
        if not isinstance(node, _SCOPES)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    )
    return _Outline(scopes, [(a, b) for a, b in statements if a <= b], module)


class _Regions:
    """The regions of frames in the files of one commit (Python files outlined with `ast`, once each)."""

    def __init__(self, repo: Repository, commit: str, python_paths: list[str]):
        self.outlines = {path: _outline(source) for path, source in repo.contents(commit, python_paths).items()}

    def targets(self, path: str, frame: _Frame) -> list[_Target]:
        if frame.line is None:
            return []
        if frame.kind == "native":
            name = _native_name(frame.function)
            out = [_Target(path, frozenset([frame.line]), LINE)]
            if name:
                out.append(_Target(path, frozenset([frame.line]), FUNCTION, name))
            return out
        outline = self.outlines.get(path)
        if outline is None:
            return [_Target(path, frozenset([frame.line]), LINE)]
        line = _statement(outline, frame.line)
        return [_Target(path, line, LINE), _Target(path, _body(outline, frame) | line, FUNCTION)]


def _native_name(function: str | None) -> str | None:
    """The bare name of a demangled C/C++ function ('ns::Class::run(int) const' -> 'run')."""
    if not function:
        return None
    depth, end = 0, len(function)
    for i, char in enumerate(function):  # the name ends where its outermost parameter list begins
        if char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
        elif char == "(" and depth == 0:
            end = i
            break
    name = function[:end].rsplit("::", 1)[-1].split("<", 1)[0].strip()
    return name or None


def _body(outline: _Outline, frame: _Frame) -> frozenset[int]:
    """The lines of the frame's function that run when it runs: its lines less the bodies of the
    functions and classes defined inside it; for a module's frame, its top-level statements other
    than definitions (a function added to the module is not a change to what the module runs)."""
    if frame.function == "<module>":
        return outline.module
    containing = [s for s in outline.scopes if s.start <= frame.line <= s.end]
    exact = [s for s in containing if s.start == frame.first_line]  # co_firstlineno: the first decorator's
    if not (exact or containing):
        return frozenset([frame.line])
    scope = min(exact or containing, key=lambda s: s.end - s.start)
    lines = set(range(scope.start, scope.end + 1))
    for inner in outline.scopes:
        if inner != scope and scope.start <= inner.start and inner.end <= scope.end:
            lines.difference_update(range(inner.body, inner.end + 1))
    return frozenset(lines)


def _statement(outline: _Outline, line: int) -> frozenset[int]:
    """The lines of the innermost statement at `line` (for a compound statement, its header)."""
    spans = [(a, b) for a, b in outline.statements if a <= line <= b]
    if not spans:
        return frozenset([line])
    first, last = min(spans, key=lambda span: span[1] - span[0])
    return frozenset(range(first, last + 1))


# ------------------------------------------------------------------------------------------ following regions


def _touches(lines: frozenset[int], start: int, count: int) -> bool:
    """A hunk side touches a region: one of its lines is in it, or (count 0) the gap after `start` is inside it."""
    if count:
        return any(x in lines for x in range(start, start + count))
    return start in lines and start + 1 in lines


def _carry(lines: frozenset[int], hunks: list[tuple[int, int, int, int]], fill: bool) -> frozenset[int]:
    """The region on the other side of a diff, hunks given as (from_start, from_count, to_start, to_count).
    Lines a hunk replaced leave the region; with `fill`, lines a hunk put strictly inside the region
    join it (forwards: code added inside a function is that function's from then on)."""
    if not lines or not hunks:
        return lines
    hunks = sorted(hunks)
    lasts, shifts, total = [], [], 0
    for start, count, _to_start, to_count in hunks:
        total += to_count - count
        lasts.append(start + count - 1 if count else start)
        shifts.append(total)
    removed = set()
    for start, count, _, _ in hunks:
        removed.update(range(start, start + count))
    out = set()
    for x in lines:
        if x in removed:
            continue
        before = bisect.bisect_left(lasts, x)  # hunks whose last line is before x
        out.add(x + (shifts[before - 1] if before else 0))
    if fill:
        for start, count, to_start, to_count in hunks:
            inside = (
                (start - 1 in lines and start + count in lines) if count else (start in lines and start + 1 in lines)
            )
            if inside and to_count:
                out.update(range(to_start, to_start + to_count))
    return frozenset(out)


def _follow(
    targets: set[_Target], commits: list[Commit], backwards: bool, lead: dict[str, list[Hunk]] | None = None
) -> dict[_Target, list[tuple[int, list[Hunk]]]]:
    """Per target, the commits (by index) whose diffs touch it, with the hunks that do. Backwards: from
    the newest commit's tree down (regions in the newest tree's lines); forwards: from the oldest
    commit's parent up, after `lead` (a diff that brings the regions there) when given."""
    found: dict[_Target, list[tuple[int, list[Hunk]]]] = {}
    order = range(len(commits) - 1, -1, -1) if backwards else range(len(commits))
    for target in targets:
        lines = target.lines
        if lead and target.path in lead:
            lines = _carry(
                lines, [(h.old_start, h.old_count, h.new_start, h.new_count) for h in lead[target.path]], True
            )
        hits = []
        for index in order:
            diff = commits[index].files.get(target.path)
            if diff is None or not lines:
                continue
            touched = []
            for hunk in diff.hunks:
                side = (hunk.new_start, hunk.new_count) if backwards else (hunk.old_start, hunk.old_count)
                if _touches(lines, *side) or (
                    target.native_function is not None and f"{target.native_function}(" in hunk.header
                ):
                    touched.append(hunk)
            if touched:
                hits.append((index, touched))
            if backwards:
                pairs = [(h.new_start, h.new_count, h.old_start, h.old_count) for h in diff.hunks]
            else:
                pairs = [(h.old_start, h.old_count, h.new_start, h.new_count) for h in diff.hunks]
            lines = _carry(lines, pairs, fill=not backwards)
        found[target] = hits
    return found


# ------------------------------------------------------------------------------------------ explaining sites


def _explain(
    con: Any,
    repo: Repository,
    wanted: list[tuple[Any, str]],
    run_set: RunSet,
    commit: str,
    between: tuple[str, str],
    states: dict[str, dict[str, Any]],
    *,
    backwards: bool,
) -> None:
    """Sets the suspects of the `wanted` sites from their stacks in `run_set`, captured at `commit`,
    among the commits `between` (baseline, candidate)."""
    baseline, candidate = between
    stacks = _stacks(con, wanted, run_set.run_ids)
    frames = _frames(con, sorted({s for per_site in stacks.values() for s, _ in per_site}))
    roots = {states[r]["root"] for r in run_set.run_ids if states.get(r, {}).get("root")}
    site_files = {
        frame.file
        for per_site in stacks.values()
        for stack_id, site_depth in per_site
        for depth, frame in frames.get(stack_id, [])
        if depth == site_depth
    }
    paths = _Paths(repo.tracked(commit), roots, site_files)
    named = {
        frame: paths.path(frame) for per_stack in frames.values() for _, frame in per_stack if frame.line is not None
    }
    named = {frame: path for frame, path in named.items() if path is not None}
    files = sorted(set(named.values()))
    if not files:
        return
    commits = repo.first_parent_commits(baseline, candidate, files)
    lead = None
    if not backwards and commits and commits[0].parents and commits[0].parents[0] != baseline:
        lead = {p: d.hunks for p, d in repo.diff(baseline, commits[0].parents[0], files).items()}
    # Only the frames of files the range changed can have suspects: only those files are read and parsed.
    changed = {path for c in commits for path in c.files}
    named = {frame: path for frame, path in named.items() if path in changed}
    regions = _Regions(repo, commit, sorted({p for f, p in named.items() if f.kind == "python"}))
    targets_of = {frame: regions.targets(path, frame) for frame, path in named.items()}
    hits = _follow({t for ts in targets_of.values() for t in ts}, commits, backwards, lead)
    for index, (site, _) in enumerate(wanted):
        site.suspects = _rank(stacks.get(index, []), frames, named, targets_of, hits, commits)


def _rank(
    site_stacks: list[tuple[int, int]],
    frames: dict[int, list[tuple[int, _Frame]]],
    named: dict[_Frame, str],
    targets_of: dict[_Frame, list[_Target]],
    hits: dict[_Target, list[tuple[int, list[Hunk]]]],
    commits: list[Commit],
) -> list[Suspect]:
    touched: dict[int, dict[tuple, TouchedFrame]] = defaultdict(dict)
    hunks: dict[int, dict[tuple[str, str], tuple[tuple, SuspectHunk]]] = defaultdict(dict)
    for stack_id, site_depth in site_stacks:
        for depth, frame in frames.get(stack_id, []):
            path = named.get(frame)
            if path is None:
                continue
            for target in targets_of.get(frame, []):
                for index, commit_hunks in hits.get(target, []):
                    entry = TouchedFrame(
                        path, frame.line, frame.function, frame.file, frame.kind, depth, depth - site_depth, target.what
                    )
                    key = (path, frame.line, frame.function)
                    known = touched[index].get(key)
                    if known is None or entry.rank() < known.rank():
                        touched[index][key] = entry
                    for hunk in commit_hunks:
                        hunk_key = (path, hunk.text)
                        if hunk_key not in hunks[index] or entry.rank() < hunks[index][hunk_key][0]:
                            hunks[index][hunk_key] = (entry.rank(), SuspectHunk(path, _cut(hunk.text)))
    suspects = []
    for index, by_frame in touched.items():
        commit = commits[index]
        frame_list = sorted(by_frame.values(), key=lambda f: (f.rank(), f.depth))
        hunk_list = [h for _, h in sorted(hunks[index].values(), key=lambda pair: pair[0])][:HUNKS_PER_SUSPECT]
        suspects.append(
            (
                (frame_list[0].rank(), -len(frame_list), -index),
                Suspect(
                    commit.sha,
                    commit.subject,
                    commit.author,
                    commit.author_date,
                    len(commit.parents) > 1,
                    frame_list,
                    hunk_list,
                ),
            )
        )
    suspects.sort(key=lambda pair: pair[0])
    return [s for _, s in suspects[:SUSPECTS_PER_SITE]]


def _cut(text: str) -> str:
    lines = text.split("\n")
    if len(lines) <= HUNK_LINES:
        return text
    return "\n".join([*lines[:HUNK_LINES], f"... {len(lines) - HUNK_LINES} more lines"])
