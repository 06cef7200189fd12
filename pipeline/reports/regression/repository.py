"""The git repository a report reads its suspects from: commits, trees, file contents and diffs.

Everything goes through the `git` command as a subprocess, each call bounded in time, with no
network (no fetch, no remote), no pager, no colour, no external diff or text conversion, and no
lock taken on the repository's index. A call that fails or runs out of time raises `GitError`
with one line saying which command and why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Each git call's limit. A nightly range is tens of commits over a few files: far below it.
GIT_TIMEOUT_S = 20.0
# Options that keep git's output the same whatever the user's configuration says.
_CONFIG = (
    "-c", "core.quotePath=false", "-c", "color.ui=false", "-c", "diff.noprefix=false",
    "-c", "diff.mnemonicPrefix=false", "-c", "log.showSignature=false", "-c", "core.pager=cat",
)  # fmt: skip
_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")
_FIELD = "\x1f"


class GitError(Exception):
    """A git command that failed or took too long, in one line."""


@dataclass(frozen=True)
class Hunk:
    """One hunk of a `--unified=0` diff: old lines [old_start, +old_count) became new ones. With a count
    of 0 the start is the line after which lines were inserted (or removed), as git writes it."""

    old_start: int
    old_count: int
    new_start: int
    new_count: int
    header: str  # git's function context after the second @@ (the nearest line above that looks like one)
    text: str  # the @@ line and the -/+ lines


@dataclass
class FileDiff:
    path: str  # the path in the newer tree ('' when the file was deleted)
    old_path: str  # the path in the older tree ('' when the file was created)
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def created(self) -> bool:
        return not self.old_path

    @property
    def deleted(self) -> bool:
        return not self.path


@dataclass
class Commit:
    sha: str
    parents: list[str]
    author: str
    author_date: str  # ISO-8601, as git writes %aI
    subject: str
    files: dict[str, FileDiff] = field(default_factory=dict)  # by path in the newer tree (old path if deleted)


class Repository:
    """A git repository on this machine, read through the `git` command."""

    def __init__(self, root: Path, timeout_s: float = GIT_TIMEOUT_S):
        self.root = root
        self.timeout_s = timeout_s
        self._tracked: dict[str, frozenset[str]] = {}

    @classmethod
    def find(cls, folder: Path, timeout_s: float = GIT_TIMEOUT_S) -> Repository | None:
        """The repository whose work tree (or bare folder) holds `folder`; None when none does."""
        if shutil.which("git") is None or not folder.is_dir():
            return None
        try:
            out = _git(folder, ["rev-parse", "--show-toplevel"], timeout_s)
            top = out.decode("utf-8", "surrogateescape").strip()
            if not top:  # a bare repository has no work tree
                out = _git(folder, ["rev-parse", "--absolute-git-dir"], timeout_s)
                top = out.decode("utf-8", "surrogateescape").strip()
        except GitError:
            return None
        return cls(Path(top), timeout_s)

    def git(self, args: list[str], stdin: bytes | None = None) -> bytes:
        return _git(self.root, args, self.timeout_s, stdin)

    def commit(self, revision: str) -> str | None:
        """The full object name of the commit `revision` names (a hash, a prefix, a tag...); None if none."""
        if not revision or revision.startswith("-"):
            return None
        try:
            out = self.git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{revision}^{{commit}}"])
        except GitError:
            return None
        return out.decode().strip() or None

    def is_shallow(self) -> bool:
        try:
            return self.git(["rev-parse", "--is-shallow-repository"]).strip() == b"true"
        except GitError:
            return False

    def is_ancestor(self, older: str, newer: str) -> bool:
        try:
            self.git(["merge-base", "--is-ancestor", older, newer])
        except GitError:
            return False
        return True

    def tracked(self, commit: str) -> frozenset[str]:
        """Every file path in the tree of `commit`."""
        if commit not in self._tracked:
            out = self.git(["ls-tree", "-r", "-z", "--name-only", "--full-tree", commit])
            self._tracked[commit] = frozenset(p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p)
        return self._tracked[commit]

    def contents(self, commit: str, paths: list[str]) -> dict[str, bytes]:
        """The files `paths` as they are in `commit` (one `git cat-file --batch` for all); absent ones left out."""
        if not paths:
            return {}
        request = "".join(f"{commit}:{p}\n" for p in paths).encode("utf-8", "surrogateescape")
        out = self.git(["cat-file", "--batch"], stdin=request)
        found, at = {}, 0
        for path in paths:
            end = out.index(b"\n", at)
            header = out[at:end].split()
            at = end + 1
            if len(header) == 3 and header[1] == b"blob":
                size = int(header[2])
                found[path] = out[at : at + size]
                at += size + 1
        return found

    def first_parent_commits(self, base: str, candidate: str, paths: list[str]) -> list[Commit]:
        """The commits from `base` (excluded) to `candidate` along the candidate's first parents, oldest
        first, each with its `--unified=0` diff against its first parent restricted to `paths` (a merge
        stands for what it brought in)."""
        if not paths:
            return []
        args = [
            "log", "--first-parent", "--diff-merges=first-parent", "--patch", "--unified=0", "--no-renames",
            "--no-ext-diff", "--no-textconv", "--reverse", f"--format=%x00%H{_FIELD}%P{_FIELD}%an{_FIELD}%aI{_FIELD}%s",
            f"{base}..{candidate}", "--", *paths,
        ]  # fmt: skip
        return [_parse_commit(chunk) for chunk in self.git(args).split(b"\0")[1:]]

    def commit_count(self, base: str, candidate: str) -> int:
        return int(self.git(["rev-list", "--count", "--first-parent", f"{base}..{candidate}"]).strip() or 0)

    def diff(self, older: str, newer: str, paths: list[str]) -> dict[str, FileDiff]:
        """The `--unified=0` diff between two commits, restricted to `paths`, by path."""
        if not paths or older == newer:
            return {}
        args = ["diff", "--unified=0", "--no-renames", "--no-ext-diff", "--no-textconv", older, newer, "--", *paths]
        return _parse_files(self.git(args).split(b"\n"))


def _git(folder: Path, args: list[str], timeout_s: float, stdin: bytes | None = None) -> bytes:
    git = shutil.which("git")
    if git is None:
        raise GitError("the git command is not installed")
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C", GIT_PAGER="cat")
    for variable in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_EXTERNAL_DIFF"):
        env.pop(variable, None)
    command = [git, "-C", str(folder), *_CONFIG, *args]
    try:
        done = subprocess.run(
            command, input=stdin, capture_output=True, timeout=timeout_s, env=env, check=False,
            stdin=None if stdin is not None else subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise GitError(f"git {args[0]} in {folder} took longer than {timeout_s:g} s") from None
    except OSError as error:
        raise GitError(f"git {args[0]} in {folder}: {error.strerror or error}") from None
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GitError(f"git {args[0]} in {folder} failed: {said[-1] if said else f'exit status {done.returncode}'}")
    return done.stdout


def _parse_commit(chunk: bytes) -> Commit:
    head, _, patch = chunk.partition(b"\n")
    sha, parents, author, date, subject = head.decode("utf-8", "replace").split(_FIELD, 4)
    commit = Commit(sha, parents.split(), author, date, subject)
    commit.files = _parse_files(patch.split(b"\n"))
    return commit


def _path(line: bytes, prefix: bytes) -> str:
    """The path of a `--- a/...` or `+++ b/...` line; '' for /dev/null."""
    text = line[4:].rstrip(b"\t")
    if text == b"/dev/null":
        return ""
    return text[len(prefix) :].decode("utf-8", "surrogateescape") if text.startswith(prefix) else ""


def _parse_files(lines: list[bytes]) -> dict[str, FileDiff]:
    """The files of a `--unified=0` patch. Hunk lines are counted, not recognised by their first
    character, so a removed line that reads '-- x' is never taken for a file header."""
    files: dict[str, FileDiff] = {}
    current: FileDiff | None = None
    old_path = new_path = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith(b"diff --git "):
            current, old_path, new_path = None, "", ""
        elif line.startswith(b"--- ") and current is None:
            old_path = _path(line, b"a/")
        elif line.startswith(b"+++ ") and current is None:
            new_path = _path(line, b"b/")
            current = FileDiff(new_path, old_path)
            files[new_path or old_path] = current
        elif current is not None and (match := _HUNK.match(line)):
            old_count = int(match[2]) if match[2] is not None else 1
            new_count = int(match[4]) if match[4] is not None else 1
            body = []
            remaining = old_count + new_count
            while remaining and i < len(lines):
                body.append(lines[i])
                if not lines[i].startswith(b"\\"):  # '\ No newline at end of file' is not a line
                    remaining -= 1
                i += 1
            if i < len(lines) and lines[i].startswith(b"\\"):
                body.append(lines[i])
                i += 1
            text = b"\n".join([line, *body]).decode("utf-8", "replace")
            current.hunks.append(
                Hunk(int(match[1]), old_count, int(match[3]), new_count, match[5].decode("utf-8", "replace"), text)
            )
    return files
