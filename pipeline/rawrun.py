"""Reading raw run directories: validate their parts against schemas/, load their tables. Finding
run folders, their manifests and part files is `runfolder`'s (re-exported here for the readers).

Everything that can be wrong with a run directory ends up as one `DamagedRunError` naming the
path and the problem: a manifest that is not JSON or lacks/garbles a field, a schema version
this tbpipe does not read, listed files that are missing, Parquet parts that are truncated,
unreadable or of another table/schema/version, and (for a run that closed cleanly) rows that
refer to stacks, modules or code the run does not hold. A run that was killed mid-capture
(`complete: false`) is not damaged for lacking what it never flushed: `reference_problems` says
what is missing instead, and the ingest keeps that as the run's notes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tbpipe.pipeline.errors import first_line
from tbpipe.pipeline.parquet_pages import PageDamage, verify_page_checksums
from tbpipe.pipeline.runfolder import (  # noqa: F401 - re-exported: a run's folder and parts read together
    PART_NAME,
    RUN_ID,
    DamagedRunError,
    MissingManifestError,
    damaged,
    find_run_dirs,
    part_files,
    parts_fingerprint,
    read_manifest,
)
from tbpipe.schemas.format import TABLE_SINCE, readable_raw_schema_version
from tbpipe.schemas.raw import (
    FORMAT_NAME,
    NATIVE_FRAME_MARKER,
    OLDEST_READABLE_RAW_SCHEMA_VERSION,
    RAW_SCHEMA_VERSION,
    RUN_TABLES,
    SCHEMA_KEY,
    VERSION_KEY,
    table_schema,
)

# ---------------------------------------------------------------------------------------- parts


def _part_version(metadata: dict) -> int | None:
    try:
        return int(metadata.get(VERSION_KEY, b"").decode())
    except (UnicodeDecodeError, ValueError):
        return None


def _check_schema(path: Path, table: str, schema: pa.Schema) -> None:
    metadata = schema.metadata or {}
    version = _part_version(metadata)
    if (
        metadata.get(SCHEMA_KEY) != table.encode()
        or not readable_raw_schema_version(version)
        or version < TABLE_SINCE[table]
    ):
        readable = f"{max(OLDEST_READABLE_RAW_SCHEMA_VERSION, TABLE_SINCE[table])} to {RAW_SCHEMA_VERSION}"
        if TABLE_SINCE[table] == RAW_SCHEMA_VERSION:
            readable = str(RAW_SCHEMA_VERSION)
        raise damaged(
            path,
            f"expected table {table!r} schema version {readable}, file says "
            f"{_decoded(metadata.get(SCHEMA_KEY))} version {_decoded(metadata.get(VERSION_KEY))}",
        )
    expected = table_schema(table, version)
    if not schema.equals(expected, check_metadata=False):
        raise damaged(path, f"columns do not match the {table!r} schema: {_schema_difference(schema, expected)}")


def check_part(path: Path, table: str) -> int:
    """Checks a part's footer (readable, right table, schema and version) without reading its data;
    returns its row count."""
    with _opened(path, table) as parquet:
        return parquet.metadata.num_rows


def _opened(
    path: Path, table: str, data: bytes | None = None, read_dictionary: list[str] | None = None
) -> pq.ParquetFile:
    """The part opened (its footer read, its schema checked), from `data` (its bytes) when given.
    One ParquetFile a part, its footer parsed once, for every read after: opening one costs about as
    much as reading a small part's column."""
    source = path if data is None else pa.BufferReader(data)
    try:
        try:
            parquet = pq.ParquetFile(source, read_dictionary=read_dictionary)
        except KeyError:  # a column to read as a dictionary is missing: the schema check says more
            parquet = pq.ParquetFile(source)
        schema = parquet.metadata.schema.to_arrow_schema()
    except (OSError, pa.ArrowException, ValueError) as error:
        raise damaged(path, f"unreadable Parquet ({first_line(error, 300)})") from None
    try:
        _check_schema(path, table, schema)
    except DamagedRunError:
        parquet.close()  # (a file's handle, when opened from its path)
        raise
    return parquet


# Parts already read and checked by `_verified`, by path: each opened over its bytes, read again
# from them, its pages not checked twice.
VerifiedParts = dict[Path, pq.ParquetFile]


def _read_part(path: Path, table: str, verified: pq.ParquetFile | None = None) -> pa.Table:
    try:
        if verified is not None:
            # Decoded on the calling thread: the ingest reads its runs on threads of its own, and
            # handing a part's columns to Arrow's pool as well costs more CPU than it saves time.
            part = verified.read(use_threads=False)
        else:
            # The capture writes page checksums: a flipped bit in an uncompressed
            # page (delta-encoded timestamps) is caught here, not loaded silently.
            # One file: ParquetFile reads it without the dataset discovery of `pq.read_table`.
            with pq.ParquetFile(path, page_checksum_verification=True) as parquet:
                part = parquet.read(use_threads=_threaded(parquet.metadata))
    except (OSError, pa.ArrowException, ValueError) as error:
        raise damaged(path, f"unreadable Parquet ({first_line(error, 300)})") from None
    _check_schema(path, table, part.schema)
    return part


def _read_columns(path: Path, table: str, columns: list[str]) -> pa.Table | None:
    """Only `columns` of a part (Parquet column paths, such as "native.list.element.module" for one
    field of a list of structs), every page of the part checked as `verify_part` does (damage in a
    column not read is damage all the same); None when the part lacks one of the columns."""
    return _columns_of(path, _verified(path, table), columns)


def _columns_of(path: Path, parquet: pq.ParquetFile, columns: list[str]) -> pa.Table | None:
    """`columns` of a part opened by `_verified`; None when it lacks one of them."""
    metadata = parquet.metadata
    leaves = metadata.schema
    if not set(columns) <= {leaves.column(i).path for i in range(len(leaves))}:
        return None
    try:
        return parquet.read(columns=columns, use_threads=_threaded(metadata))
    except (OSError, pa.ArrowException, ValueError) as error:
        raise damaged(path, f"unreadable Parquet ({first_line(error, 300)})") from None


# Parts of fewer rows are decoded on the calling thread: the ingest reads several runs at once on
# threads of its own, and handing a small part's columns to Arrow's pool costs more than it saves.
# A big run's columns are still decoded side by side.
_THREADED_ROWS = 20_000


def _threaded(metadata: pq.FileMetaData) -> bool:
    return metadata.num_rows >= _THREADED_ROWS


def verify_part(path: Path, table: str) -> int:
    """`check_part`, and every page checked against its checksum; returns the row count. For parts
    that DuckDB loads itself: its Parquet reader checks no page checksums. The pages are not decoded
    unless one carries no checksum (a part not written by the capture): decoding is then the check."""
    return _verified(path, table).metadata.num_rows


def _verified(path: Path, table: str, read_dictionary: list[str] | None = None) -> pq.ParquetFile:
    """A part opened over its bytes (`_opened`), its footer and page checksums checked (see
    `verify_part`)."""
    try:
        data = path.read_bytes()  # once: the footer and the pages are read from these bytes
    except OSError as error:
        raise damaged(path, f"unreadable ({first_line(error, 300)})") from None
    parquet = _opened(path, table, data, read_dictionary)
    try:
        checked = verify_page_checksums(data, parquet.metadata)
    except PageDamage as damage:
        raise damaged(path, f"unreadable Parquet ({damage})") from None
    if not checked:
        _read_part(path, table)
    return parquet


class EventsPart(NamedTuple):
    """What the ingest needs to know of an events part before DuckDB loads it."""

    rows: int
    without_stack: int  # events that took no stack (a NULL stack id)
    names: set[tuple[str, str]]  # the distinct (kind, name) pairs
    # The part has the `correlation_id` column (raw schema 3 on); older parts keep the id in `attrs`.
    correlation_column: bool = True
    # The part has the op_* columns (raw schema 5 on); older parts keep an op's attributes in `attrs`.
    op_columns: bool = True


def events_part(path: Path) -> EventsPart:
    """An events part verified as `verify_part` does, with its distinct (kind, name) pairs (read
    from the part's dictionaries in the same bytes, not a string per event) and its events without
    a stack (from the footer's statistics; the column is read only where the writer kept none). The
    ingest tells the events whose stack the run does not hold from these after loading them."""
    parquet = _verified(path, "events", read_dictionary=["kind", "name"])
    metadata = parquet.metadata
    try:
        threaded = _threaded(metadata)
        batches = parquet.read(columns=["kind", "name"], use_threads=threaded).to_batches()
        without_stack = _null_count(metadata, "stack_id")
        if without_stack is None:
            without_stack = parquet.read(columns=["stack_id"], use_threads=threaded).column(0).null_count
    except (OSError, pa.ArrowException, ValueError) as error:
        raise damaged(path, f"unreadable Parquet ({first_line(error, 300)})") from None
    names: set[tuple[str, str]] = set()
    for kinds, texts in (batch.columns for batch in batches):
        if kinds.null_count or texts.null_count:
            raise damaged(path, "events without a kind or a name")
        try:  # Arrow reads text that is not UTF-8 as it is; DuckDB would refuse it.
            kinds.dictionary.validate(full=True)
            texts.dictionary.validate(full=True)
        except pa.ArrowInvalid as error:
            raise damaged(path, f"events unreadable ({first_line(error, 300)})") from None
        # The pairs used, by their pair of dictionary indices.
        width = max(len(texts.dictionary), 1)
        codes = kinds.indices.to_numpy().astype(np.int64) * width + texts.indices.to_numpy()
        possible = len(kinds.dictionary) * width
        # Few possible pairs (the usual): counted, rather than sorted or hashed.
        pairs = (
            np.flatnonzero(np.bincount(codes, minlength=possible)) if possible <= 4 * len(codes) else np.unique(codes)
        )
        kind_text, name_text = kinds.dictionary.to_pylist(), texts.dictionary.to_pylist()
        names.update(zip([kind_text[i] for i in pairs // width], [name_text[i] for i in pairs % width]))
    correlation_column = "correlation_id" in metadata.schema.names
    op_columns = "op_id" in metadata.schema.names
    return EventsPart(metadata.num_rows, without_stack, names, correlation_column, op_columns)


def dangling_events_note(count: int) -> str:
    """The note of a run with events whose stack it does not hold (a killed process flushed the
    events but not the stack): damage in a run that closed cleanly."""
    return f"{count} events refer to stacks the run does not hold: their stack is NULL"


def _column_index(metadata: pq.FileMetaData, column: str) -> int:
    """The index of a leaf column (its Parquet path, such as "native.list.element.module") in the footer."""
    schema = metadata.schema
    return next(i for i in range(len(schema)) if schema.column(i).path == column)


def _null_count(metadata: pq.FileMetaData, column: str) -> int | None:
    """The column's NULLs over every row group, as the footer's statistics count them; None when a
    row group has no such count."""
    index = _column_index(metadata, column)
    total = 0
    for group in range(metadata.num_row_groups):
        statistics = metadata.row_group(group).column(index).statistics
        if statistics is None or not statistics.has_null_count:
            return None
        total += statistics.null_count
    return total


def _references_described(metadata: pq.FileMetaData, column: str, described: np.ndarray) -> bool:
    """Whether the footer's statistics show every value of `column` (an integer reference, never
    NULL) within a range all of whose values are in `described` (sorted, distinct): per row group,
    its min and max, and every value between them described. False when a row group has no such
    statistics, or a value outside (a frame flagged as a marker holds -1: its frames are then read)."""
    index = _column_index(metadata, column)
    for group in range(metadata.num_row_groups):
        statistics = metadata.row_group(group).column(index).statistics
        if statistics is None or not statistics.has_min_max or statistics.null_count:
            return False
        low, high = int(statistics.min), int(statistics.max)
        inside = np.searchsorted(described, high, side="right") - np.searchsorted(described, low)
        if inside != high - low + 1:
            return False
    return True


def read_tables(
    files: dict[str, list[Path]], names: tuple[str, ...], verified: VerifiedParts | None = None
) -> dict[str, pa.Table]:
    """The named tables of a run, each its parts concatenated (an empty table when it has none);
    parts in `verified` are read from the bytes checked there."""
    tables = {}
    verified = verified or {}
    for table in names:
        parts = [_in_current_columns(_read_part(path, table, verified.get(path)), table) for path in files[table]]
        tables[table] = pa.concat_tables(parts) if parts else table_schema(table).empty_table()
    return tables


# What checks a run's references without its stacks' frames (`read_stack_keys`, with the hashes
# the capture wrote): frames are read only for runs that bring a new stack.
STACK_KEY_COLUMNS = [
    "stack_id",
    "native.list.element.module",
    "native.list.element.flags",
    "python.list.element.code_id",
]


def read_stack_keys(
    files: dict[str, list[Path]], all_stored: Callable[[np.ndarray], bool], verified: VerifiedParts | None = None
) -> dict[str, pa.Table] | None:
    """A run's stacks without their frames (`STACK_KEY_COLUMNS`), its modules, and the ids of its code
    objects: enough for `reference_problems` and to find its stacks by the hashes the capture wrote,
    when `all_stored` says the database holds every stack of these hashes (by the time the run
    loads). None otherwise, when a stacks part has no such hashes (written before raw schema 4), or
    when the run has `code_origins` (its stacks are hashed with those frames spliced in, which the
    capture does not do): the run is then read whole (`read_tables`, from the stacks parts' bytes
    this adds to `verified`). Every page of the parts is checked."""
    if files.get("code_origins") or not files["stacks"]:
        return None
    parts = [(path, _verified(path, "stacks")) for path in files["stacks"]]
    if verified is not None:
        verified.update(parts)
    hashes = [_columns_of(*part, ["stack_hash"]) for part in parts]
    if any(column is None or column["stack_hash"].null_count for column in hashes):
        return None
    if not all_stored(np.concatenate([column["stack_hash"].to_numpy() for column in hashes])):
        return None
    code = [_read_columns(path, "code", ["code_id"]) for path in files["code"]]
    modules = read_tables(files, ("modules",))["modules"]
    # The native frames' module references, decoded only when the parts' statistics cannot show
    # that each one is a module the run describes (most runs: they can). Code ids are hashes,
    # which no range shows described: they are always read.
    described = np.unique(modules["module_index"].to_numpy())
    columns = STACK_KEY_COLUMNS
    if all(_references_described(part.metadata, "native.list.element.module", described) for _, part in parts):
        columns = [name for name in columns if not name.startswith("native.")]
    stacks = [
        _columns_of(*part, columns).append_column("stack_hash", column["stack_hash"])
        for part, column in zip(parts, hashes)
    ]
    return {
        "stacks": pa.concat_tables(stacks),
        "modules": modules,
        "code": pa.concat_tables(code) if code else pa.table({"code_id": pa.array([], pa.uint64())}),
    }


def _in_current_columns(part: pa.Table, table: str) -> pa.Table:
    """A part of an older raw schema version with the columns added since, as nulls."""
    schema = table_schema(table)
    for name in schema.names[part.num_columns :]:
        part = part.append_column(schema.field(name), pa.nulls(part.num_rows, schema.field(name).type))
    return part


def _decoded(value: bytes | None) -> str:
    return repr(value.decode(errors="replace")) if value is not None else "nothing"


def _schema_difference(actual: pa.Schema, expected: pa.Schema) -> str:
    for field_ in expected:
        index = actual.get_field_index(field_.name)
        if index < 0:
            return f"no column {field_.name!r}"
        if not actual.field(index).equals(field_):
            return f"column {field_.name!r} is {actual.field(index).type}, expected {field_.type}"
    extra = [name for name in actual.names if name not in expected.names]
    return f"unexpected columns {extra}" if extra else "columns in a different order"


def reference_problems(tables: dict[str, pa.Table]) -> list[str]:
    """Rows that refer to stacks, modules or code the run does not hold (events only when loaded)."""
    problems = []
    stacks = tables["stacks"]
    if "events" in tables:
        stack_ids = tables["events"]["stack_id"].drop_null()
        if len(stack_ids):
            found = pc.sum(pc.is_in(stack_ids, value_set=stacks["stack_id"].combine_chunks())).as_py() or 0
            if len(stack_ids) - found:
                problems.append(f"{len(stack_ids) - found} events refer to stacks the run does not hold")
    # A run read without its frames (`read_stack_keys`) leaves the native references out when the
    # parts' statistics show every one of them described.
    if "native" in stacks.column_names:
        missing = _frames_missing(
            stacks["native"], "module", tables["modules"]["module_index"], skip_flag=NATIVE_FRAME_MARKER
        )
        if missing:
            problems.append(f"{missing} native frames refer to modules the run does not describe")
    missing = _frames_missing(stacks["python"], "code_id", tables["code"]["code_id"])
    if missing:
        problems.append(f"{missing} Python frames refer to code objects the run does not describe")
    return problems


def _frames_missing(column: pa.ChunkedArray, field: str, described: pa.ChunkedArray, skip_flag: int = 0) -> int:
    """How many frames of a list<struct> stacks column refer (by `field`) to a row the run does not
    describe, frames flagged `skip_flag` aside. The distinct references are checked first; only the
    frames with one the run does not describe (a marker's -1, or damage) are then looked at."""
    values = pc.list_flatten(column)
    if not len(values):
        return 0
    references = pc.struct_field(values, field)
    distinct = pc.unique(references)
    undescribed = distinct.filter(pc.invert(pc.is_in(distinct, value_set=described.combine_chunks())))
    if not len(undescribed):
        return 0
    suspect = pc.is_in(references, value_set=undescribed)
    if skip_flag:
        flagged = pc.not_equal(pc.bit_wise_and(pc.struct_field(values, "flags"), pa.scalar(skip_flag, pa.uint32())), 0)
        suspect = pc.and_(suspect, pc.invert(flagged))
    return pc.sum(suspect).as_py() or 0


def manifest_or_recovered(run_dir: Path, recover: bool) -> tuple[dict[str, Any], list[str]]:
    """The run's manifest, and notes on it: with `recover`, a folder whose manifest.json is lost gets
    one rebuilt from its parts (`recovered_manifest`), with a note saying so; without, the
    MissingManifestError stands."""
    try:
        return read_manifest(run_dir), []
    except MissingManifestError:
        if not recover:
            raise
    note = "manifest.json was missing: recovered from the run's parts (no labels, argv or versions)"
    return recovered_manifest(run_dir), [note]


def recovered_manifest(run_dir: Path) -> dict[str, Any]:
    """A manifest for a run folder that lost its own, from what its parts say; DamagedRunError when
    they cannot say enough. Nothing is written: the folder stays as it was found.

    The run id is the folder's name (the capture names run folders so), the start time the first
    event's (else the oldest part's modification time); the run is incomplete and carries no
    labels, command line or versions. Every part must be a readable part of a schema version this
    tbpipe reads.
    """
    name = run_dir.name
    if not RUN_ID.match(name):
        raise damaged(
            run_dir, f"manifest is missing and the folder name {name[:80]!r} is not a run id to recover it by"
        )
    files: dict[str, list[str]] = {}
    for path in sorted(run_dir.glob("*.parquet")):
        match = PART_NAME.match(path.name)
        if match and match.group("table") in RUN_TABLES:
            check_part(path, match.group("table"))
            files.setdefault(match.group("table"), []).append(path.name)
    if not files:
        raise damaged(run_dir, "manifest is missing and no run parts are left to recover")
    started = _first_event_time(run_dir, files.get("events", []))
    if started is None:
        oldest = min((run_dir / n).stat().st_mtime for names in files.values() for n in names)
        started = datetime.fromtimestamp(oldest, timezone.utc)
    return {
        "format": FORMAT_NAME,
        "schema_version": RAW_SCHEMA_VERSION,
        "run_id": name,
        "started_at": started.isoformat(timespec="microseconds"),
        "ended_at": None,
        "complete": False,
        "labels": {},
        "files": files,
        "errors": [],
        "recovered": True,
    }


def _first_event_time(run_dir: Path, names: list[str]) -> datetime | None:
    earliest_ns = None
    for name in names:
        column = pq.read_table(run_dir / name, columns=["ts"])["ts"].cast(pa.int64())
        value = pc.min(column).as_py() if len(column) else None
        if value is not None and (earliest_ns is None or value < earliest_ns):
            earliest_ns = value
    return None if earliest_ns is None else datetime.fromtimestamp(earliest_ns / 1e9, timezone.utc)


def code_first_lines(run_dir: Path) -> dict[tuple[str, str], int] | None:
    """{(file, qualname): first line} of a run folder's code objects, for pairs with one first line
    only; None when the folder or its code parts cannot be read."""
    try:
        parts = [_read_part(path, "code") for path in sorted(run_dir.glob("code-*.parquet"))]
    except (DamagedRunError, OSError):
        return None
    seen: dict[tuple[str, str], set[int]] = {}
    for part in parts:
        for file, qualname, first in zip(
            part["filename"].to_pylist(), part["qualname"].to_pylist(), part["first_line"].to_pylist()
        ):
            seen.setdefault((file, qualname), set()).add(first)
    return {key: lines.pop() for key, lines in seen.items() if len(lines) == 1}
