"""Runs uploaded as archives (`POST /api/runs`): received within a size limit, unpacked safely, checked.

An archive is a tar (plain, gzip, bzip2 or xz) or a zip holding one or more run folders. Unpacking
writes only regular files and folders, each strictly inside the upload's own folder: an entry with
an absolute name, a `..` part, a backslash or NUL, a link (symbolic or hard), a device or a FIFO
refuses the whole archive, and so do more than `MAX_ENTRIES` entries, more than `max_unpacked` bytes
unpacked, or more than `max_expansion` times the archive's own size (a few MB of compressed zeros
would otherwise fill the disk), whatever the archive's headers claim: the bytes are counted as they
are written, and a refused archive leaves nothing on disk. An archive whose largest allowed unpacked
size does not fit on the disk is refused before anything is unpacked (507). Each run folder is then
checked with the ingest's own validation (`rawrun`: manifest, listed parts present, every part's
footer, table, schema and version); a damaged run answers 422 naming the problem, and its upload is
moved to `quarantine/` with the reason beside it (`tbpipe retain --keep-quarantined-days` ages those out).
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tbpipe.pipeline.rawrun import DamagedRunError, check_part, find_run_dirs, part_files, read_manifest

MAX_ENTRIES = 10_000
# Unpacked bytes per byte of archive at most: a run folder is zstd Parquet, which gzip or zip hardly
# shrink further (its manifest, a few kB of JSON, shrinks more, but it is small).
MAX_EXPANSION = 10.0
_CHUNK = 1 << 20


class UploadRefused(Exception):
    """An upload the service does not take: `status` is the HTTP status, the message says why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Upload:
    upload_id: str
    folder: Path  # where it was unpacked
    run_dirs: list[Path]
    run_ids: list[str]


def new_upload_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + os.urandom(4).hex()


def _entry_path(name: str) -> PurePosixPath:
    """The entry's relative path, or UploadRefused when it could land outside the upload folder."""
    if not name or "\x00" in name or "\\" in name:
        raise UploadRefused(f"archive entry {name[:200]!r}: not a plain relative path")
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith("/"):
        raise UploadRefused(f"archive entry {name[:200]!r} has an absolute path")
    if any(part == ".." for part in path.parts):
        raise UploadRefused(f"archive entry {name[:200]!r} reaches outside the archive ('..')")
    if not path.parts:  # PurePosixPath leaves out '.' and empty parts itself
        raise UploadRefused(f"archive entry {name[:200]!r}: empty path")
    return path


class _Writer:
    """Writes entries under `root`, counting bytes against the unpacked limit (`limit` says which it is)."""

    def __init__(self, root: Path, max_unpacked: int, limit: str = "the limit"):
        self.root = root
        self.real_root = os.path.realpath(root)  # once: per entry it was much of an archive's unpacking
        self.max_unpacked = max_unpacked
        self.limit = limit
        self.written = 0
        self.entries = 0

    def _target(self, relative: PurePosixPath) -> Path:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise UploadRefused(f"the archive holds more than {MAX_ENTRIES:,} entries")
        target = self.root.joinpath(*relative.parts)
        # Belt and braces: no entry resolves outside the upload folder (e.g. through a folder
        # that is itself an earlier entry; links are refused anyway).
        if os.path.commonpath([os.path.realpath(target.parent), self.real_root]) != self.real_root:
            raise UploadRefused(f"archive entry {str(relative)[:200]!r} reaches outside the archive")
        return target

    def folder(self, relative: PurePosixPath) -> None:
        self._target(relative).mkdir(parents=True, exist_ok=True)

    def file(self, relative: PurePosixPath, source: BinaryIO) -> None:
        target = self._target(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            raise UploadRefused(f"archive entry {str(relative)[:200]!r} appears twice")
        with open(target, "xb") as out:
            while True:
                chunk = source.read(_CHUNK)
                if not chunk:
                    break
                self.written += len(chunk)
                if self.written > self.max_unpacked:
                    raise UploadRefused(
                        f"the archive unpacks to more than {self.max_unpacked:,} bytes ({self.limit}); nothing was kept",
                        413,
                    )
                out.write(chunk)


def _unpack_tar(archive: Path, writer: _Writer) -> None:
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:
                relative = _entry_path(member.name)
                if member.isdir():
                    writer.folder(relative)
                elif member.isreg():
                    source = tar.extractfile(member)
                    if source is None:
                        raise UploadRefused(f"archive entry {member.name[:200]!r} cannot be read")
                    writer.file(relative, source)
                else:
                    what = (
                        "a symbolic link" if member.issym() else "a hard link" if member.islnk()
                        else "a device" if member.ischr() or member.isblk() else "a FIFO" if member.isfifo()
                        else "not a regular file"
                    )  # fmt: skip
                    raise UploadRefused(
                        f"archive entry {member.name[:200]!r} is {what}; only files and folders are taken"
                    )
    except (tarfile.TarError, EOFError, ValueError) as error:
        raise UploadRefused(f"the tar archive cannot be read: {error}") from None


def _unpack_zip(archive: Path, writer: _Writer) -> None:
    try:
        with zipfile.ZipFile(archive) as bundle:
            for info in bundle.infolist():
                relative = _entry_path(info.filename)
                mode = info.external_attr >> 16
                if info.is_dir():
                    writer.folder(relative)
                    continue
                if stat.S_IFMT(mode) and not stat.S_ISREG(mode):
                    what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                    raise UploadRefused(
                        f"archive entry {info.filename[:200]!r} is {what}; only files and folders are taken"
                    )
                with bundle.open(info) as source:
                    writer.file(relative, source)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError, RuntimeError) as error:
        raise UploadRefused(f"the zip archive cannot be read: {error}") from None


def archive_kind(head: bytes) -> str | None:
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")):
        return "tar"  # compressed; tarfile finds out which
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def unpack_limit(archive_bytes: int, max_unpacked: int, max_expansion: float | None) -> tuple[int, str]:
    """The most bytes an archive of this size may unpack to, and which limit that is, in words."""
    if max_expansion is not None and archive_bytes * max_expansion < max_unpacked:
        limit = int(archive_bytes * max_expansion)
        return limit, f"{max_expansion:g} times the archive's {archive_bytes:,} bytes, the most an archive may expand"
    return max_unpacked, "the limit"


def unpack(archive: Path, into: Path, max_unpacked: int, max_expansion: float | None = MAX_EXPANSION) -> None:
    with open(archive, "rb") as f:
        head = f.read(512)
    kind = archive_kind(head)
    if kind is None:
        raise UploadRefused("the upload is not a tar or zip archive (send a run folder as .tar, .tar.gz or .zip)", 415)
    limit, which = unpack_limit(archive.stat().st_size, max_unpacked, max_expansion)
    free = shutil.disk_usage(into.parent if into.parent.is_dir() else archive.parent).free
    if free < limit:
        raise UploadRefused(
            f"the disk holding the uploads has {free:,} bytes free, less than the {limit:,} this archive may unpack "
            f"to ({which}): free some space (tbpipe retain --keep-quarantined-days, "
            "--delete-ingested-runs-after-days)",
            507,
        )
    into.mkdir(parents=True)
    writer = _Writer(into, limit, which)
    try:
        (_unpack_zip if kind == "zip" else _unpack_tar)(archive, writer)
    except OSError as error:  # e.g. a file entry where an earlier entry made a folder
        raise UploadRefused(f"the archive cannot be unpacked: {error.strerror or error}") from None


def validate_run(run_dir: Path) -> str:
    """The checks `tbpipe ingest` makes before reading a run's data; returns the run id."""
    manifest = read_manifest(run_dir)
    for table, paths in part_files(run_dir, manifest).items():
        for path in paths:
            check_part(path, table)
    return manifest["run_id"]


def receive(archive: Path, uploads: Path, max_unpacked: int, max_expansion: float | None = MAX_EXPANSION) -> Upload:
    """Unpacks `archive` into `uploads/<id>/` and validates every run folder in it.

    UploadRefused when the archive is refused (nothing kept) or a run is damaged (the upload kept
    under `uploads/quarantine/<id>/` with `reason.txt`)."""
    upload_id = new_upload_id()
    folder = uploads / upload_id
    try:
        unpack(archive, folder, max_unpacked, max_expansion)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    run_dirs = find_run_dirs([folder])
    if not run_dirs:
        shutil.rmtree(folder, ignore_errors=True)
        raise UploadRefused("the archive holds no run folder (a folder with manifest.json and its Parquet parts)", 422)
    run_ids = []
    for run_dir in run_dirs:
        try:
            run_ids.append(validate_run(run_dir))
        except DamagedRunError as error:
            reason = str(error).replace(str(folder), f"<upload {upload_id}>")
            quarantine = uploads / "quarantine" / upload_id
            quarantine.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(folder), str(quarantine))
            (quarantine / "reason.txt").write_text(reason + "\n", encoding="utf-8")
            raise UploadRefused(f"quarantined: {reason}", 422) from None
    return Upload(upload_id, folder, run_dirs, run_ids)
