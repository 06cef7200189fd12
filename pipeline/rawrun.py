"""Reading raw run directories: find them, validate them against schemas/, load their tables."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tbpipe.pipeline.errors import TbpipeError
from tbpipe.schemas import FORMAT_NAME, MANIFEST_FILE, RAW_SCHEMA_VERSION, RUN_TABLES, SCHEMA_KEY, VERSION_KEY


class DamagedRunError(TbpipeError):
    """A run directory that cannot be read as a whole: names the path and the problem."""


@dataclass
class RawRun:
    path: Path
    manifest: dict[str, Any]
    tables: dict[str, pa.Table]

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))


def find_run_dirs(roots: list[Path]) -> list[Path]:
    """Every folder under `roots` (recursively) that holds a manifest."""
    found = set()
    for root in roots:
        if (root / MANIFEST_FILE).is_file():
            found.add(root)
        found.update(p.parent for p in root.rglob(MANIFEST_FILE))
    return sorted(found)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DamagedRunError(f"{path}: manifest unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise DamagedRunError(f"{path}: not a {FORMAT_NAME} manifest")
    if manifest.get("schema_version") != RAW_SCHEMA_VERSION:
        raise DamagedRunError(
            f"{path}: raw schema version {manifest.get('schema_version')!r}, this tbpipe reads {RAW_SCHEMA_VERSION}"
        )
    if not isinstance(manifest.get("run_id"), str):
        raise DamagedRunError(f"{path}: manifest has no run_id")
    return manifest


def _read_part(path: Path, table: str) -> pa.Table:
    try:
        part = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise DamagedRunError(f"{path}: unreadable Parquet: {error}") from None
    metadata = part.schema.metadata or {}
    if metadata.get(SCHEMA_KEY) != table.encode() or metadata.get(VERSION_KEY) != str(RAW_SCHEMA_VERSION).encode():
        raise DamagedRunError(
            f"{path}: expected table {table!r} schema version {RAW_SCHEMA_VERSION}, file says "
            f"{metadata.get(SCHEMA_KEY)!r} version {metadata.get(VERSION_KEY)!r}"
        )
    expected = RUN_TABLES[table]()
    if not part.schema.remove_metadata().equals(expected.remove_metadata()):
        raise DamagedRunError(f"{path}: columns do not match the {table!r} schema")
    return part


def read_run(run_dir: Path) -> RawRun:
    """Loads a whole run; DamagedRunError names the first problem found."""
    manifest = read_manifest(run_dir)
    listed = manifest.get("files") or {}
    tables = {}
    for table, schema in RUN_TABLES.items():
        names = set(listed.get(table, []))
        missing = sorted(n for n in names if not (run_dir / n).is_file())
        if missing:
            raise DamagedRunError(f"{run_dir}: files listed in the manifest are missing: {', '.join(missing)}")
        # Parts written after the last manifest update (a killed process) are whole files too.
        names.update(p.name for p in run_dir.glob(f"{table}-*.parquet"))
        parts = [_read_part(run_dir / n, table) for n in sorted(names)]
        tables[table] = pa.concat_tables(parts) if parts else schema().empty_table()
    return RawRun(run_dir, manifest, tables)
