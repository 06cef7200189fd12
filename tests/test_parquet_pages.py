"""Page checksums checked without decoding (pipeline/parquet_pages.py), on parts the capture wrote."""

from __future__ import annotations

import zlib
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tbpipe import _native, _native_test, capture
from tbpipe.pipeline.parquet_pages import PageDamage, page_spans, verify_page_checksums
from tbpipe.pipeline.rawrun import DamagedRunError, events_part, verify_part


@pytest.fixture(scope="module")
def captured_events(tmp_path_factory) -> Path:
    """An events part as the capture writes it (delta-encoded times, dictionaries, JSON attributes)."""
    out = tmp_path_factory.mktemp("pages")
    with capture.session(out / "runs", flush_interval_s=60):
        for i in range(600):
            capture.record("kernel_launch", f"kernel_{i % 7}", grid=i, note="é" * (i % 4))
    (part,) = (out / "runs").glob("*/events-*.parquet")
    return part


def _read_back(con: duckdb.DuckDBPyConnection, path: Path) -> list[tuple]:
    return con.execute(
        "SELECT epoch_ns(ts), thread_id, kind, name, stack_id, attrs FROM read_parquet(?)", [str(path)]
    ).fetchall()


def test_every_page_the_capture_writes_carries_a_checksum(captured_events: Path) -> None:
    metadata = pq.read_metadata(captured_events)
    spans = list(page_spans(captured_events.read_bytes(), metadata))
    assert {s.column for s in spans} == set(metadata.schema.to_arrow_schema().names)
    assert all(s.crc is not None and s.header < s.body <= s.end for s in spans)
    assert verify_page_checksums(captured_events.read_bytes(), metadata)
    assert verify_part(captured_events, "events") == metadata.num_rows == 600


def test_the_extension_computes_the_crc32_zlib_does() -> None:
    """Page checksums are CRC-32s as zlib computes them: every length around the eight-byte steps."""
    data = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    for size in [*range(0, 40), 4095, 4096, 4097, 5000]:
        for offset in (0, 3):
            assert _native_test.crc32(data[offset : offset + size]) == zlib.crc32(data[offset : offset + size])


def test_a_flipped_bit_in_any_page_is_refused(captured_events: Path, tmp_path: Path) -> None:
    original = captured_events.read_bytes()
    metadata = pq.read_metadata(captured_events)
    damaged_path = tmp_path / captured_events.name
    for span in page_spans(original, metadata):
        for position in range(span.body, span.end, max(1, (span.end - span.body) // 16)):
            damaged = bytearray(original)
            damaged[position] ^= 1 << (position % 8)
            with pytest.raises(PageDamage, match="page checksum mismatch") as refused:
                verify_page_checksums(bytes(damaged), metadata)
            assert f"column {span.column!r} (row group 0, page at byte {span.header})" in str(refused.value)
            damaged_path.write_bytes(bytes(damaged))
            with pytest.raises(DamagedRunError, match=f"{damaged_path.name}: unreadable Parquet"):
                verify_part(damaged_path, "events")


def test_a_damaged_page_header_is_refused_or_reads_the_same_rows(captured_events: Path, tmp_path: Path) -> None:
    """A page header is not under the page's checksum. Every bit of every header is flipped in turn:
    the part is refused, or DuckDB cannot read it (the ingest quarantines the run then), or it reads
    back the very same rows (a field nothing reads). Never other rows in silence."""
    original = captured_events.read_bytes()
    metadata = pq.read_metadata(captured_events)
    con = duckdb.connect()
    expected = _read_back(con, captured_events)
    outcomes = {"refused": 0, "unreadable": 0, "same rows": 0}
    for span in page_spans(original, metadata):
        for position in range(span.header, span.body):
            for bit in range(8):
                damaged = bytearray(original)
                damaged[position] ^= 1 << bit
                try:
                    verify_page_checksums(bytes(damaged), metadata)
                except PageDamage:
                    outcomes["refused"] += 1
                    continue
                # Each copy under a name of its own: DuckDB keeps what it read of a file by path (and
                # mtime), so copies rewritten under one name within a second read back a stale one.
                damaged_path = tmp_path / f"{position}-{bit}-{captured_events.name}"
                damaged_path.write_bytes(bytes(damaged))
                try:
                    rows = _read_back(con, damaged_path)
                except duckdb.Error:
                    outcomes["unreadable"] += 1
                    continue
                assert rows == expected, f"{span.column} header byte {position - span.header}, bit {bit}"
                outcomes["same rows"] += 1
    con.close()
    assert outcomes["refused"] > 0 and outcomes["same rows"] > 0, outcomes


def test_parts_without_checksums_are_decoded_instead(captured_events: Path, tmp_path: Path) -> None:
    table = pq.read_table(captured_events)
    plain = tmp_path / captured_events.name
    pq.write_table(table, plain, compression="zstd", write_page_checksum=False)
    assert not verify_page_checksums(plain.read_bytes(), pq.read_metadata(plain))
    assert verify_part(plain, "events") == 600
    # Cut inside a page (the footer kept): the decode that stands in for the checksums refuses it.
    data = bytearray(plain.read_bytes())
    span = max(page_spans(bytes(data), pq.read_metadata(plain)), key=lambda s: s.end - s.body)
    data[span.body : span.end] = bytes(span.end - span.body)
    plain.write_bytes(bytes(data))
    with pytest.raises(DamagedRunError, match="unreadable Parquet"):
        verify_part(plain, "events")


def test_a_header_past_its_column_chunk_is_damage() -> None:
    table = pa.table({"x": pa.array(range(1000), pa.int64())})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    metadata = pq.read_metadata(pa.BufferReader(data))
    span = list(page_spans(data, metadata))[-1]  # the data page, after the dictionary page
    # The header's size field made huge: its page would end past the column chunk.
    damaged = data[: span.header] + bytes([0x15, 0x00, 0x15, 0xFE, 0xFF, 0xFF, 0xFF, 0x0F]) + data[span.header + 8 :]
    with pytest.raises(PageDamage):
        verify_page_checksums(damaged, metadata)


@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_many_pages_of_either_data_page_version(version: str) -> None:
    table = pa.table(
        {
            "x": pa.array(range(50_000), pa.int64()),
            "text": pa.array([str(i % 10) for i in range(50_000)]),
            "sparse": pa.array([None if i % 3 else i for i in range(50_000)], pa.int64()),
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, data_page_version=version, write_page_checksum=True, data_page_size=4096)
    data = sink.getvalue().to_pybytes()
    metadata = pq.read_metadata(pa.BufferReader(data))
    spans = list(page_spans(data, metadata))
    assert len(spans) > 3 * 10 and verify_page_checksums(data, metadata)
    middle = spans[len(spans) // 2]
    damaged = bytearray(data)
    damaged[(middle.body + middle.end) // 2] ^= 0x10
    with pytest.raises(PageDamage, match=f"column '{middle.column}'"):
        verify_page_checksums(bytes(damaged), metadata)


def test_events_part_names_are_the_distinct_kinds_and_names_of_every_row_group(
    captured_events: Path, tmp_path: Path
) -> None:
    """The names come from each row group's dictionaries: a part of several row groups, whose
    dictionaries differ (a name only in the second, the same names at other indices), gives the
    pairs DuckDB reads, and its rows; the part is verified as `verify_part` does."""
    table = pq.read_table(captured_events)
    part = events_part(captured_events)
    assert part.rows == 600 and part.names == {("kernel_launch", f"kernel_{i}") for i in range(7)}
    # Rewritten in row groups of 100 rows, the last group's names changed and in another order.
    renamed = table.set_column(
        table.schema.get_field_index("name"),
        table.schema.field("name"),
        pa.array([f"late_{n}" if i >= 500 else n for i, n in enumerate(table["name"].to_pylist())], pa.string()),
    )
    split = tmp_path / captured_events.name
    pq.write_table(renamed[::-1], split, row_group_size=100, write_page_checksum=True)
    expected = set(duckdb.execute("SELECT DISTINCT kind, name FROM read_parquet(?)", [str(split)]).fetchall())
    assert pq.read_metadata(split).num_row_groups == 6 and len(expected) == 14
    split_part = events_part(split)
    assert (split_part.rows, split_part.names) == (600, expected)


@pytest.mark.parametrize("statistics", [True, False], ids=["footer statistics", "no statistics"])
def test_events_part_counts_the_events_without_a_stack(captured_events: Path, tmp_path: Path, statistics: bool) -> None:
    """Events that took no stack are counted from the footer's statistics, or from the column
    itself when a writer kept none; the count is DuckDB's over several row groups."""
    table = pq.read_table(captured_events)
    stack_ids = pa.array([None if i % 3 == 0 else 1000 + i for i in range(table.num_rows)], pa.uint64())
    index = table.schema.get_field_index("stack_id")
    table = table.set_column(index, table.schema.field(index), stack_ids)
    path = tmp_path / captured_events.name
    pq.write_table(table, path, row_group_size=128, write_statistics=statistics, write_page_checksum=True)
    (nulls,) = duckdb.execute("SELECT count(*) FROM read_parquet(?) WHERE stack_id IS NULL", [str(path)]).fetchone()
    assert nulls == 200 and pq.read_metadata(path).num_row_groups == 5
    assert events_part(path).without_stack == nulls


def test_the_native_parser_stays_inside_its_chunk() -> None:
    """The extension's header parser reads only data[start:end]: a chunk outside the bytes is refused
    before any read, and a header cut short is damage at its offset, not a read past the chunk."""
    table = pa.table({"x": pa.array(range(100), pa.int64())})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    metadata = pq.read_metadata(pa.BufferReader(data))
    first = next(page_spans(data, metadata))
    with pytest.raises(ValueError, match="outside the data"):
        _native.parquet_chunk_pages(data, first.header, len(data) + 1, True, 0xFFFF)
    with pytest.raises(ValueError, match="outside the data"):
        _native.parquet_chunk_pages(data, -1, first.body, True, 0xFFFF)
    # The chunk ends two bytes into the first header.
    pages, values, problem, at = _native.parquet_chunk_pages(data, first.header, first.header + 2, True, 0xFFFF)
    assert (pages, values, problem, at) == (b"", 0, "a page header runs past its column chunk", first.header)
    # The whole header but not its page.
    pages, _values, problem, at = _native.parquet_chunk_pages(data, first.header, first.body + 1, True, 0xFFFF)
    assert pages == b"" and problem == "a page header runs past its column chunk" and at == first.header
