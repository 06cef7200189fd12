"""Run folders as the file system shows them: where they are, their manifests checked field by
field, the part files each holds and a fingerprint of them. Everything here is the standard library
and the format's constants, no Parquet: whether a run needs loading at all is decided by these
(an ingest with nothing to load imports no pyarrow); `rawrun` reads the parts themselves.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from tbpipe.pipeline.errors import TbpipeError, UsageError
from tbpipe.schemas.format import (
    FORMAT_NAME,
    MANIFEST_FILE,
    OLDEST_READABLE_RAW_SCHEMA_VERSION,
    RAW_SCHEMA_VERSION,
    TABLE_SINCE,
    readable_raw_schema_version,
)

PART_NAME = re.compile(r"^(?P<table>[a-z_]+)-(?P<sequence>\d{6})\.parquet$")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,199}$")


class DamagedRunError(TbpipeError):
    """A run directory that cannot be read as a whole: names the path and the problem."""


class MissingManifestError(DamagedRunError):
    """A folder holding a run's Parquet parts but no manifest (deleted, or lost with a disk)."""


def _is_run_folder(files: list[str]) -> bool:
    """A manifest, or parts of a run's tables: a run folder, even when its manifest was lost."""
    if MANIFEST_FILE in files:
        return True
    for name in files:
        match = PART_NAME.match(name)
        if match and match.group("table") in TABLE_SINCE:
            return True
    return False


def find_run_dirs(roots: list[Path]) -> list[Path]:
    """Every folder under `roots` (recursively) that holds a manifest or a run's Parquet parts."""
    found = set()
    for root in roots:
        if not root.exists():
            raise UsageError(f"no such folder: {root}")
        if root.is_file():
            raise UsageError(f"{root} is a file: give the folder that holds run folders")
        if root.is_dir():
            seen: set[str] = set()
            for folder, dirs, files in os.walk(root, followlinks=True):
                # Symlinked run folders are followed; a link back up the tree is not walked twice.
                real = os.path.realpath(folder)
                if real in seen:
                    dirs[:] = []
                    continue
                seen.add(real)
                if _is_run_folder(files):
                    found.add(Path(folder))
                    dirs[:] = []  # a run folder holds no other runs
    return sorted(found)


# ---------------------------------------------------------------------------------------- manifest


def damaged(path: Path, problem: str) -> DamagedRunError:
    """The error for a run folder's (or one of its files') `problem`."""
    return DamagedRunError(f"{path}: {problem}")


def _check_type(path: Path, manifest: dict, key: str, types: tuple, required: bool) -> None:
    if key not in manifest or manifest[key] is None:
        if required:
            raise damaged(path, f"manifest has no {key!r}")
        return
    value = manifest[key]
    # bool is an int in Python; a count or pid that is true/false is garbage.
    if isinstance(value, bool) and bool not in types:
        raise damaged(path, f"manifest field {key!r} is {value!r}, not {' or '.join(t.__name__ for t in types)}")
    if not isinstance(value, types):
        raise damaged(
            path, f"manifest field {key!r} is {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}"
        )


def _check_timestamp(path: Path, manifest: dict, key: str, required: bool) -> None:
    _check_type(path, manifest, key, (str,), required)
    value = manifest.get(key)
    if value is None:
        return
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise damaged(path, f"manifest field {key!r} is not an ISO-8601 time: {value[:60]!r}") from None
    if parsed.tzinfo is None:
        raise damaged(path, f"manifest field {key!r} has no time zone: {value[:60]!r}")


def _check_str_map(path: Path, manifest: dict, key: str, key_pattern: re.Pattern | None = None) -> None:
    _check_type(path, manifest, key, (dict,), False)
    for k, v in (manifest.get(key) or {}).items():
        if not isinstance(v, str) or (key_pattern is not None and not key_pattern.match(k)):
            raise damaged(path, f"manifest field {key!r} has a bad entry {k!r}: {v!r}"[:300])


def _check_files(path: Path, manifest: dict) -> None:
    _check_type(path, manifest, "files", (dict,), False)
    for table, names in (manifest.get("files") or {}).items():
        if not isinstance(names, list):
            raise damaged(path, f"manifest field 'files' lists {table!r} as {type(names).__name__}, not a list")
        for name in names:
            match = PART_NAME.match(name) if isinstance(name, str) else None
            if match is None or match.group("table") != table:
                raise damaged(path, f"manifest lists a file {name!r} that is not a {table} part"[:300])


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The run's manifest, checked field by field; DamagedRunError on any garbage."""
    path = run_dir / MANIFEST_FILE
    if not path.exists():
        parts = sorted(p.name for p in run_dir.glob("*-[0-9][0-9][0-9][0-9][0-9][0-9].parquet"))
        raise MissingManifestError(
            f"{path}: manifest is missing, {len(parts)} Parquet parts are there ({', '.join(parts[:4])}"
            f"{', ...' if len(parts) > 4 else ''}); `tbpipe ingest --recover-manifests` loads what they hold as "
            "an incomplete run without labels"
        )
    try:
        manifest = json.loads(path.read_bytes())
    except OSError as error:
        raise damaged(path, f"manifest unreadable: {error.strerror or error}") from None
    except ValueError as error:
        raise damaged(path, f"manifest is not JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise damaged(path, f"not a {FORMAT_NAME} manifest")
    if not readable_raw_schema_version(manifest.get("schema_version")):
        raise damaged(
            path,
            f"raw schema version {manifest.get('schema_version')!r}, this tbpipe reads {_readable_versions()}",
        )
    run_id = manifest.get("run_id")
    if not isinstance(run_id, str):
        raise damaged(path, "manifest has no run_id")
    if not RUN_ID.match(run_id):
        raise damaged(path, f"manifest has a malformed run_id {run_id[:80]!r}")
    _check_type(path, manifest, "complete", (bool,), True)
    _check_timestamp(path, manifest, "started_at", True)
    _check_timestamp(path, manifest, "ended_at", False)
    for key in (
        "parent_run_id",
        "host",
        "cwd",
        "python_version",
        "python_implementation",
        "torch_version",
        "cuda_version",
        "tbpipe_version",
    ):
        _check_type(path, manifest, key, (str,), False)
    _check_type(path, manifest, "pid", (int,), False)
    for key in ("argv", "sources", "errors", "sys_path"):
        _check_type(path, manifest, key, (list,), False)
        if not all(isinstance(item, str) for item in manifest.get(key) or []):
            raise damaged(path, f"manifest field {key!r} holds something other than strings")
    _check_type(path, manifest, "capture", (dict,), False)
    _check_str_map(path, manifest, "labels")
    _check_str_map(path, manifest, "generated_code")
    _check_str_map(path, manifest, "threads", re.compile(r"^\d{1,19}$"))
    _check_type(path, manifest, "counters", (dict,), False)
    for key, value in (manifest.get("counters") or {}).items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise damaged(path, f"manifest counter {key!r} is {value!r}, not a number"[:300])
    _check_files(path, manifest)
    return manifest


def _readable_versions() -> str:
    if OLDEST_READABLE_RAW_SCHEMA_VERSION == RAW_SCHEMA_VERSION:
        return str(RAW_SCHEMA_VERSION)
    return f"{OLDEST_READABLE_RAW_SCHEMA_VERSION} to {RAW_SCHEMA_VERSION}"


# ---------------------------------------------------------------------------------------- part files


def part_files(run_dir: Path, manifest: dict[str, Any]) -> dict[str, list[Path]]:
    """Per table, the part files to read: those listed (which must exist) and any written after
    the last manifest update (a killed process leaves whole files behind)."""
    listed = manifest.get("files") or {}
    # The folder listed once (a glob per table cost a small run a millisecond): `TABLE-*.parquet`.
    try:
        present = {entry.name: entry.is_file() for entry in os.scandir(run_dir)}
    except OSError as error:
        raise damaged(run_dir, f"unreadable: {error.strerror or error}") from None
    written: dict[str, set[str]] = {table: set() for table in TABLE_SINCE}
    for name in present:
        table, dash, _rest = name.partition("-")
        if dash and table in written and name.endswith(".parquet") and len(name) >= len(table) + 9:
            written[table].add(name)
    out = {}
    for table in TABLE_SINCE:
        names = set(listed.get(table, []))
        missing = sorted(n for n in names if not present.get(n, False))
        if missing:
            raise damaged(run_dir, f"files listed in the manifest are missing: {', '.join(missing)}")
        names.update(written[table])
        out[table] = [run_dir / n for n in sorted(names)]
    return out


def parts_fingerprint(run_dir: Path, manifest: dict[str, Any], files: dict[str, list[Path]] | None = None) -> str:
    """Changes whenever the run's files or completeness change (an incomplete run still growing).
    `files`: the run's `part_files`, when the caller has them already."""
    entries = [f"complete={bool(manifest.get('complete'))}"]
    for _table, paths in (files if files is not None else part_files(run_dir, manifest)).items():
        for path in paths:
            try:
                entries.append(f"{path.name}:{path.stat().st_size}")
            except OSError as error:
                raise damaged(path, f"unreadable: {error.strerror or error}") from None
    return ";".join(entries)
