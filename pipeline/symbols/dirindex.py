"""Build-ID index of a user's `--debug-dir`: every ELF file under it, found recursively.

The index is kept as JSON under the cache dir and refreshed by walking the tree again: a file
whose (size, mtime, inode) did not change is not opened again, so a refresh costs one stat per
file. Symlinked directories are followed once (a loop is reported, not walked forever), and
unreadable directories or files are listed in the scan report instead of stopping it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tbpipe.pipeline.symbols.elf import ELF_MAGIC, inspect_elf
from tbpipe.pipeline.symbols.model import ElfFileError

_INDEX_VERSION = 1


@dataclass
class IndexEntry:
    path: str
    build_id: str
    has_dwarf: bool
    has_symbols: bool


@dataclass
class ScanReport:
    directory: str
    files: int = 0  # regular files seen
    elf_files: int = 0  # of which ELF objects with a build-ID
    opened: int = 0  # files (re)read because they were new or changed
    problems: list[str] = field(default_factory=list)  # unreadable files, symlink loops, bad ELF


class DebugDirIndex:
    """Build-ID -> files under one directory."""

    def __init__(self, directory: str | os.PathLike, index_path: Path | None):
        self.directory = os.path.abspath(os.fspath(directory))
        self.index_path = index_path
        # relpath -> [size, mtime_ns, inode, build_id | None, has_dwarf, has_symbols]
        self._files: dict[str, list] = {}
        self._by_build_id: dict[str, list[str]] | None = None
        self.report: ScanReport | None = None
        self._load()

    def _load(self) -> None:
        if self.index_path is None:
            return
        try:
            data = json.loads(self.index_path.read_text())
            if data.get("version") == _INDEX_VERSION and data.get("directory") == self.directory:
                self._files = {str(k): list(v) for k, v in data["files"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self._files = {}

    def _save(self) -> None:
        if self.index_path is None:
            return
        payload = json.dumps({"version": _INDEX_VERSION, "directory": self.directory, "files": self._files})
        temporary = self.index_path.with_name(f".{self.index_path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(payload)
            os.replace(temporary, self.index_path)
        except OSError:
            pass  # an index that cannot be kept is rebuilt next time; never fatal

    def refresh(self) -> ScanReport:
        """Walk the directory again, reading only new or changed files."""
        report = ScanReport(directory=self.directory)
        old = self._files
        fresh: dict[str, list] = {}
        visited: set[tuple[int, int]] = set()
        try:
            root_stat = os.stat(self.directory)
        except OSError as error:
            report.problems.append(f"{self.directory}: {error.strerror or error}")
            self.report = report
            self._files = {}
            self._by_build_id = None
            return report
        visited.add((root_stat.st_dev, root_stat.st_ino))
        pending = [self.directory]
        while pending:
            directory = pending.pop()
            try:
                entries = list(os.scandir(directory))
            except OSError as error:
                report.problems.append(f"{directory}: cannot list ({error.strerror or error})")
                continue
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=True)
                except OSError as error:
                    # Dangling symlinks and ELOOP land here.
                    report.problems.append(f"{entry.path}: {error.strerror or error}")
                    continue
                if entry.is_dir(follow_symlinks=True):
                    key = (info.st_dev, info.st_ino)
                    if key in visited:
                        if entry.is_symlink():
                            report.problems.append(f"{entry.path}: symlink loop (directory already indexed)")
                        continue
                    visited.add(key)
                    pending.append(entry.path)
                    continue
                if not entry.is_file(follow_symlinks=True):
                    continue
                report.files += 1
                relative = os.path.relpath(entry.path, self.directory)
                signature = [info.st_size, info.st_mtime_ns, info.st_ino]
                previous = old.get(relative)
                if previous is not None and previous[:3] == signature:
                    fresh[relative] = previous
                else:
                    report.opened += 1
                    fresh[relative] = signature + self._describe(entry.path, report)
                if fresh[relative][3]:
                    report.elf_files += 1
        self._files = fresh
        self._by_build_id = None
        self.report = report
        self._save()
        return report

    @staticmethod
    def _describe(path: str, report: ScanReport) -> list:
        try:
            with open(path, "rb") as stream:
                if stream.read(4) != ELF_MAGIC:
                    return [None, False, False]
        except OSError as error:
            report.problems.append(f"{path}: {error.strerror or error}")
            return [None, False, False]
        try:
            facts = inspect_elf(path)
        except ElfFileError as error:
            report.problems.append(str(error))
            return [None, False, False]
        return [facts.build_id, facts.has_dwarf, facts.has_symbols]

    def lookup(self, build_id: str) -> list[IndexEntry]:
        """Files with this build-ID, those with DWARF first."""
        if self._by_build_id is None:
            by_id: dict[str, list[str]] = {}
            for relative, value in self._files.items():
                if value[3]:
                    by_id.setdefault(value[3], []).append(relative)
            self._by_build_id = by_id
        entries = []
        for relative in self._by_build_id.get(build_id, []):
            value = self._files[relative]
            entries.append(IndexEntry(os.path.join(self.directory, relative), value[3], bool(value[4]), bool(value[5])))
        entries.sort(key=lambda e: (not e.has_dwarf, not e.has_symbols, e.path))
        return entries

    def __len__(self) -> int:
        return sum(1 for value in self._files.values() if value[3])
