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
parts 2.7 ms), the CRCs computed by zlib.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from tbpipe import _native

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


def page_spans(data: bytes, metadata: pq.FileMetaData) -> Iterator[PageSpan]:
    """Every page of every column chunk, in file order within each chunk; PageDamage for a header
    that does not parse or does not agree with the footer: the checksums leave the headers out, and
    a flipped bit there (a data page become a dictionary page, another encoding, another count of
    values) would otherwise be read back as other rows."""
    for group_index in range(metadata.num_row_groups):
        group = metadata.row_group(group_index)
        for column_index in range(group.num_columns):
            chunk = group.column(column_index)
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            if start is None or start < 0 or start + chunk.total_compressed_size > len(data):
                raise PageDamage(f"column {chunk.path_in_schema!r}'s pages lie outside the file")
            mask = sum(1 << _ENCODINGS[name] for name in set(chunk.encodings) if name in _ENCODINGS)
            pages, values, problem, at = _native.parquet_chunk_pages(
                data, start, start + chunk.total_compressed_size, chunk.has_dictionary_page, mask
            )
            for header, body, end, crc in np.frombuffer(pages, dtype=np.int64).reshape(-1, 4).tolist():
                yield PageSpan(chunk.path_in_schema, group_index, header, body, end, None if crc < 0 else crc)
            if problem:
                raise PageDamage(f"column {chunk.path_in_schema!r}: {problem} (page at byte {at})")
            if values != chunk.num_values:
                raise PageDamage(
                    f"column {chunk.path_in_schema!r}: its pages hold {values} values, its footer says {chunk.num_values}"
                )


def verify_page_checksums(data: bytes, metadata: pq.FileMetaData) -> bool:
    """Checks every page against its CRC-32. True when all carry one and match; False as soon as a
    page carries none (only decoding can check that file); PageDamage otherwise."""
    view = memoryview(data)
    for span in page_spans(data, metadata):
        if span.crc is None:
            return False
        if zlib.crc32(view[span.body : span.end]) != span.crc:
            raise PageDamage(
                f"page checksum mismatch in column {span.column!r} (row group {span.row_group}, page at byte "
                f"{span.header})"
            )
    return True
