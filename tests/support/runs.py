"""Whole run folders read back into Arrow tables, validated the way the ingest validates them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tbpipe.pipeline.rawrun import (
    DamagedRunError,
    find_run_dirs,
    part_files,
    read_manifest,
    read_tables,
    reference_problems,
)
from tbpipe.schemas.op_attributes import OP_COLUMNS, event_attrs_text
from tbpipe.schemas.raw import RUN_TABLES


@dataclass
class RawRun:
    path: Path
    manifest: dict[str, Any]
    tables: dict[str, pa.Table]
    # What an incomplete run lacks (rows referring to parts a killed process never wrote).
    notes: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))


def read_run(run_dir: Path, manifest: dict[str, Any] | None = None) -> RawRun:
    """Loads a whole run; DamagedRunError names the first problem found."""
    manifest = manifest if manifest is not None else read_manifest(run_dir)
    tables = read_tables(part_files(run_dir, manifest), tuple(RUN_TABLES))
    problems = reference_problems(tables)
    if problems and manifest.get("complete"):
        raise DamagedRunError(f"{run_dir}: {'; '.join(problems)}")
    return RawRun(run_dir, manifest, tables, notes=problems)


def read_runs(out_dir: Path) -> list[RawRun]:
    """Every run folder under `out_dir`, read whole."""
    return [read_run(d) for d in find_run_dirs([out_dir])]


def rewrite_as_raw_version(run_dir: Path, version: int) -> None:
    """Rewrites a run's parts as tbpipe wrote them at raw schema `version`: their metadata and the
    manifest say it, events parts before version 3 keep a CUDA call's correlation id in `attrs` (a
    column of its own since), events parts before version 5 an op's attributes (op_* columns since),
    and stacks parts before version 4 have no `stack_hash`."""
    import json

    import pyarrow.parquet as pq

    from tbpipe.schemas.raw import VERSION_KEY

    for part in sorted(run_dir.glob("*.parquet")):
        table = pq.read_table(part)
        metadata = dict(table.schema.metadata)
        if part.name.startswith("events-") and version < 5 and "op_id" in table.column_names:
            # An op's attributes, as JSON text (only these columns: `ts` needs pandas to become Python).
            attrs = [event_attrs_text(row) for row in table.select(["attrs", *OP_COLUMNS]).to_pylist()]
            table = table.drop_columns(list(OP_COLUMNS))
            table = table.set_column(table.column_names.index("attrs"), "attrs", pa.array(attrs, pa.string()))
        if part.name.startswith("events-") and version < 3 and "correlation_id" in table.column_names:
            attrs = [
                json.dumps({"correlation_id": ids, **json.loads(text or "{}")}) if ids is not None else text
                for ids, text in zip(table["correlation_id"].to_pylist(), table["attrs"].to_pylist())
            ]
            table = table.drop_columns(["correlation_id"])
            table = table.set_column(table.column_names.index("attrs"), "attrs", pa.array(attrs, pa.string()))
        if part.name.startswith("stacks-") and version < 4 and "stack_hash" in table.column_names:
            table = table.drop_columns(["stack_hash"])  # written by the capture since version 4
        metadata[VERSION_KEY] = str(version).encode()
        pq.write_table(table.replace_schema_metadata(metadata), part, compression="zstd")
    manifest_path = run_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["schema_version"] = version
    manifest_path.write_text(json.dumps(manifest))


def transaction_sizes() -> tuple[Any, list[int]]:
    """Hooks for `IngestOptions(hooks=...)` and the number of runs in each transaction the ingest
    loads with them, in order (filled as it goes)."""
    from tbpipe.pipeline.db.ingest import IngestHooks

    sizes: list[int] = []
    return IngestHooks(finishing=lambda run_ids: sizes.append(len(run_ids))), sizes
