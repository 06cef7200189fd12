"""Checks a Parquet file's page checksums without decoding its pages.

The capture writes a CRC-32 with every page (`write_page_checksum`), the one check that catches a
flipped bit in a page whose damaged bytes still decode (delta-encoded timestamps read back as other
times). Arrow verifies them only while decoding the whole file, and the events parts are then
decoded a second time by DuckDB's own Parquet reader, which checks no checksums. Reading each page
header and computing the CRC of the page's bytes costs a small fraction of decoding.

A page header is a Thrift struct in the compact protocol (parquet.thrift's `PageHeader`): field 3
is the page's compressed size and field 4 its CRC-32 (signed), computed over the page's bytes as
stored, after the header. The header itself is under no checksum, so what it says is checked
against the file's footer: page types, encodings and counts of values. The headers are parsed and
checked in the extension (native/parquet_pages.cpp: a Python parser cost a small run's four events
parts 2.7 ms), and the CRCs computed there too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from tbpipe import _native

# `parquet_chunk_checksums`'s verdicts beside a match: a page without a CRC-32, a page whose bytes differ.
_UNCHECKED, _MISMATCH = 1, 2
# Encoding, as parquet.thrift numbers them and Arrow names them in a column chunk's `encodings`.
_ENCODINGS = {
    "PLAIN": 0,
    "PLAIN_DICTIONARY": 2,
    "RLE": 3,
    "BIT_PACKED": 4,
    "DELTA_BINARY_PACKED": 5,
    "DELTA_LENGTH_BYTE_ARRAY": 6,
    "DELTA_BYTE_ARRAY": 7,
    "RLE_DICTIONARY": 8,
    "BYTE_STREAM_SPLIT": 9,
}


class PageDamage(Exception):
    """A page header that does not parse, a page past its column chunk, or a checksum mismatch."""


@dataclass(frozen=True)
class PageSpan:
    """Where one page lies in the file: its header from `header`, its bytes from `body` to `end`."""

    column: str
    row_group: int
    header: int
    body: int
    end: int
    crc: int | None  # CRC-32 of data[body:end] as the writer stored it, None when it stored none


def _chunks(metadata: pq.FileMetaData) -> Iterator[tuple[pq.ColumnChunkMetaData, int]]:
    """Every column chunk with the index of its row group."""
    for group_index in range(metadata.num_row_groups):
        group = metadata.row_group(group_index)
        for column_index in range(group.num_columns):
            yield group.column(column_index), group_index


def _walk_arguments(data: bytes, chunk: pq.ColumnChunkMetaData):
    """The arguments of the extension's page walks over a chunk, as its footer describes it: where
    its pages start and end, whether a dictionary page comes first, and the mask of the encodings it
    lists; PageDamage when its pages lie outside the file."""
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    if start is None or start < 0 or start + chunk.total_compressed_size > len(data):
        raise PageDamage(f"column {chunk.path_in_schema!r}'s pages lie outside the file")
    mask = sum(1 << _ENCODINGS[name] for name in set(chunk.encodings) if name in _ENCODINGS)
    return data, start, start + chunk.total_compressed_size, chunk.has_dictionary_page, mask


def _check_values(chunk: pq.ColumnChunkMetaData, values: int, problem: str, at: int) -> None:
    """PageDamage for a damaged page header the walk stopped at, or pages holding another count of
    values than the footer's."""
    if problem:
        raise PageDamage(f"column {chunk.path_in_schema!r}: {problem} (page at byte {at})")
    if values != chunk.num_values:
        raise PageDamage(
            f"column {chunk.path_in_schema!r}: its pages hold {values} values, its footer says {chunk.num_values}"
        )


def page_spans(data: bytes, metadata: pq.FileMetaData) -> Iterator[PageSpan]:
    """Every page of every column chunk, in file order within each chunk; PageDamage for a header
    that does not parse or does not agree with the footer: the checksums leave the headers out, and
    a flipped bit there (a data page become a dictionary page, another encoding, another count of
    values) would otherwise be read back as other rows."""
    for chunk, group_index in _chunks(metadata):
        pages, values, problem, at = _native.parquet_chunk_pages(*_walk_arguments(data, chunk))
        for header, body, end, crc in np.frombuffer(pages, dtype=np.int64).reshape(-1, 4).tolist():
            yield PageSpan(chunk.path_in_schema, group_index, header, body, end, None if crc < 0 else crc)
        _check_values(chunk, values, problem, at)


def verify_page_checksums(data: bytes, metadata: pq.FileMetaData) -> bool:
    """Checks every page against its CRC-32, as `page_spans` walks them (the CRCs computed in the
    extension, without the GIL: a Python step per page held it for a tenth of a night's ingest).
    True when all carry one and match; False as soon as a page carries none (only decoding can
    check that file); PageDamage otherwise."""
    for chunk, group_index in _chunks(metadata):
        verdict, page_at, values, problem, at = _native.parquet_chunk_checksums(*_walk_arguments(data, chunk))
        if verdict == _UNCHECKED:
            return False
        if verdict == _MISMATCH:
            raise PageDamage(
                f"page checksum mismatch in column {chunk.path_in_schema!r} (row group {group_index}, page at byte "
                f"{page_at})"
            )
        _check_values(chunk, values, problem, at)
    return True
