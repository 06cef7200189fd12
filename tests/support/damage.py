"""Ways a run gets damaged, each with the words its quarantine reason must hold (`DAMAGE`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from support.ingest import _manifest, _rewrite


def _name_not_utf8(table: pa.Table) -> pa.Table:
    names = [name.encode() for name in table["name"].to_pylist()]
    names[0] += b"\xff"
    column = pa.array(names, pa.binary()).view(pa.string())
    return table.set_column(table.schema.get_field_index("name"), table.schema.field("name"), column)


def _counter(run_dir: Path, key: str, value) -> None:
    counters = json.loads((run_dir / "manifest.json").read_text())["counters"]
    assert key in counters
    _manifest(run_dir, counters={**counters, key: value})


def _drop_described(run_dir: Path, frames: str, field: str, table: str, key: str) -> None:
    """Rewrites `table`'s part without the row describing one module/code object that the stacks'
    `frames` refer to through `field`, so the run is otherwise whole."""
    stacks = pq.read_table(run_dir / "stacks-000001.parquet")
    used = set(pc.struct_field(pc.list_flatten(stacks[frames]), field).to_pylist()) - {-1}
    part = run_dir / f"{table}-000001.parquet"
    described = pq.read_table(part)
    victim = sorted(used & set(described[key].to_pylist()))[0]
    kept = described.filter(pc.not_equal(described[key], pa.scalar(victim, described.schema.field(key).type)))
    assert kept.num_rows == described.num_rows - 1
    pq.write_table(kept, part)


def _flip_a_bit_only_page_checksums_catch(part: Path, column: str) -> None:
    """Flips the first bit in `column`'s pages that pyarrow reads back silently as other values
    when it skips the page checksums, and refuses when it checks them: damage that only the
    checksums the capture writes can catch."""
    original = part.read_bytes()
    good = pq.read_table(part)
    chunk = pq.read_metadata(part).row_group(0).column(good.schema.get_field_index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    for position in range(start, chunk.data_page_offset + chunk.total_compressed_size):
        for bit in range(8):
            damaged = bytearray(original)
            damaged[position] ^= 1 << bit
            part.write_bytes(bytes(damaged))
            try:
                unchecked = pq.read_table(part, page_checksum_verification=False)
            except (OSError, pa.ArrowException):
                continue
            if unchecked.num_rows != good.num_rows or unchecked[column].equals(good[column]):
                continue
            if not unchecked.drop_columns([column]).equals(good.drop_columns([column])):
                continue
            try:
                pq.read_table(part, page_checksum_verification=True)
            except (OSError, pa.ArrowException):
                return  # caught by the checksums alone: keep this damage
    part.write_bytes(original)
    raise AssertionError(f"no bit of {part.name}:{column} is damage that only page checksums catch")


DAMAGE = {
    "truncated": (
        lambda d: (d / "events-000001.parquet").write_bytes((d / "events-000001.parquet").read_bytes()[:200]),
        "unreadable Parquet",
    ),
    "notjson": (lambda d: (d / "manifest.json").write_text("{not json"), "manifest is not JSON"),
    "version": (lambda d: _manifest(d, schema_version=99), "raw schema version 99"),
    "labels": (lambda d: _manifest(d, labels=["suite"]), "manifest field 'labels' is list"),
    "started": (lambda d: _manifest(d, started_at="yesterday"), "'started_at' is not an ISO-8601 time"),
    "runid": (lambda d: _manifest(d, run_id="../../etc"), "malformed run_id"),
    "missing": (
        lambda d: (d / "stacks-000001.parquet").unlink(),
        "files listed in the manifest are missing: stacks-000001.parquet",
    ),
    "othertable": (
        lambda d: shutil.copy(d / "stacks-000001.parquet", d / "events-000001.parquet"),
        "expected table 'events'",
    ),
    "columns": (
        lambda d: _rewrite(
            d / "events-000001.parquet",
            lambda t: t.drop_columns(["attrs"]).replace_schema_metadata(t.schema.metadata),
        ),
        "columns do not match the 'events' schema: no column 'attrs'",
    ),
    "dangling": (
        lambda d: _rewrite(d / "stacks-000001.parquet", lambda t: t.slice(0, 1)),
        "events refer to stacks the run does not hold",
    ),
    "attrs": (
        lambda d: _rewrite(
            d / "events-000001.parquet",
            lambda t: t.set_column(
                5, t.schema.field("attrs"), pa.array(["{broken"] * t.num_rows)
            ).replace_schema_metadata(t.schema.metadata),
        ),
        "attributes that are not JSON",
    ),
    # pyarrow reads a name that is not UTF-8 as it is; DuckDB refuses it. The run whose part holds
    # it must be the one quarantined, not the runs read beside it.
    "badname": (
        lambda d: _rewrite(d / "events-000001.parquet", _name_not_utf8),
        "events unreadable",
    ),
    "nomodule": (
        lambda d: _drop_described(d, "native", "module", "modules", "module_index"),
        "native frames refer to modules the run does not describe",
    ),
    "nocode": (
        lambda d: _drop_described(d, "python", "code_id", "code", "code_id"),
        "Python frames refer to code objects the run does not describe",
    ),
    "startnotz": (
        lambda d: _manifest(d, started_at="2026-01-01T00:00:00"),
        "manifest field 'started_at' has no time zone",
    ),
    "endnotz": (
        lambda d: _manifest(d, ended_at="2026-01-01T00:05:00.123456"),
        "manifest field 'ended_at' has no time zone",
    ),
    # bool is an int in Python: a count that is true/false is garbage all the same.
    "countbool": (
        lambda d: _counter(d, "events_recorded", True),
        "manifest counter 'events_recorded' is True, not a number",
    ),
    "countfalse": (
        lambda d: _counter(d, "events_dropped", False),
        "manifest counter 'events_dropped' is False, not a number",
    ),
    "counttext": (
        lambda d: _counter(d, "events_written", "12"),
        "manifest counter 'events_written' is '12', not a number",
    ),
    "pidbool": (lambda d: _manifest(d, pid=True), "manifest field 'pid' is True, not int"),
    "eventsbit": (
        lambda d: _flip_a_bit_only_page_checksums_catch(d / "events-000001.parquet", "ts"),
        "events-000001.parquet: unreadable Parquet",
    ),
    "stacksbit": (
        lambda d: _flip_a_bit_only_page_checksums_catch(d / "stacks-000001.parquet", "thread_id"),
        "stacks-000001.parquet: unreadable Parquet",
    ),
    "codebit": (
        lambda d: _flip_a_bit_only_page_checksums_catch(d / "code-000001.parquet", "first_line"),
        "code-000001.parquet: unreadable Parquet",
    ),
}
