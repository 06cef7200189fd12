"""Checks a Parquet file's page checksums without decoding its pages.

The capture writes a CRC-32 with every page (`write_page_checksum`), the one check that catches a
flipped bit in a page whose damaged bytes still decode (delta-encoded timestamps read back as other
times). Arrow verifies them only while decoding the whole file, and the events parts are then
decoded a second time by DuckDB's own Parquet reader, which checks no checksums. Reading each page
header and computing the CRC of the page's bytes costs a small fraction of decoding.

A page header is a Thrift struct in the compact protocol (parquet.thrift's `PageHeader`): field 3
is the page's compressed size and field 4 its CRC-32 (signed), computed over the page's bytes as
stored, after the header. The header itself is under no checksum, so what it says is checked
against the file's footer: page types, encodings and counts of values.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.parquet as pq

# Thrift compact protocol type codes (in field headers; 1 and 2 are booleans whose value is the code).
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_MAX_NESTING = 16  # PageHeader nests two levels; deeper is damage, not a reason to recurse on
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3  # PageType
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
_LEVEL_ENCODINGS = {_ENCODINGS["RLE"], _ENCODINGS["BIT_PACKED"]}


class PageDamage(Exception):
    """A page header that does not parse, a page past its column chunk, or a checksum mismatch."""


class _CompactReader:
    __slots__ = ("data", "pos", "end")

    def __init__(self, data: memoryview, pos: int, end: int):
        self.data, self.pos, self.end = data, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise PageDamage("a page header runs past its column chunk")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        result = shift = 0
        while True:
            byte = self.byte()
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise PageDamage("a page header holds a malformed number")

    def zigzag(self) -> int:
        value = self.varint()
        return (value >> 1) ^ -(value & 1)

    def advance(self, count: int) -> None:
        if count < 0 or self.pos + count > self.end:
            raise PageDamage("a page header runs past its column chunk")
        self.pos += count

    def fields(self):
        """(field id, type) of a struct's fields up to its stop byte."""
        field_id = 0
        while True:
            header = self.byte()
            if header == 0:
                return
            delta = header >> 4
            field_id = field_id + delta if delta else self.zigzag()
            yield field_id, header & 0x0F

    def skip(self, kind: int, depth: int, in_collection: bool = False) -> None:
        if depth > _MAX_NESTING:
            raise PageDamage("a page header nests too deep")
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            if in_collection:  # a collection's booleans take a byte each; a field's is in its header
                self.advance(1)
        elif kind == _BYTE:
            self.advance(1)
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.advance(8)
        elif kind == _BINARY:
            self.advance(self.varint())
        elif kind in (_LIST, _SET):
            header = self.byte()
            size = header >> 4
            if size == 15:
                size = self.varint()
            for _ in range(size):
                self.skip(header & 0x0F, depth + 1, in_collection=True)
        elif kind == _MAP:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1, in_collection=True)
                    self.skip(types & 0x0F, depth + 1, in_collection=True)
        elif kind == _STRUCT:
            for _field_id, field_kind in self.fields():
                self.skip(field_kind, depth + 1)
        else:
            raise PageDamage(f"a page header holds an unknown field type {kind}")

    def page_header(self) -> _Header:
        """The page header starting here (PageHeader: 1 type, 2 uncompressed size, 3 compressed size,
        4 CRC, then one of 5 data page, 7 dictionary page, 8 data page v2 headers)."""
        header = _Header()
        for field_id, kind in self.fields():
            if kind == _I32 and field_id in (1, 2, 3, 4):
                value = self.zigzag()
                if field_id == 1:
                    header.type = value
                elif field_id == 2:
                    header.uncompressed = value
                elif field_id == 3:
                    header.size = value
                else:
                    header.crc = value & 0xFFFFFFFF
            elif kind == _STRUCT and field_id in (5, 7, 8):
                header.kinds.append(field_id)
                self.type_header(header, field_id)
            else:
                self.skip(kind, 1)
        if header.size is None or header.size < 0 or header.uncompressed is None or header.uncompressed < 0:
            raise PageDamage("a page header gives no page size")
        return header

    def type_header(self, header: _Header, which: int) -> None:
        """DataPageHeader (5: 1 values, 2 encoding, 3/4 level encodings), DictionaryPageHeader (7: 1
        values, 2 encoding) or DataPageHeaderV2 (8: 1 values, 4 encoding, 5/6 level byte lengths)."""
        encoding_field = 4 if which == 8 else 2
        for field_id, kind in self.fields():
            if kind != _I32:
                self.skip(kind, 2)
                continue
            value = self.zigzag()
            if field_id == 1:
                header.values = value
            elif field_id == encoding_field:
                header.encodings.append(value)
            elif which == 5 and field_id in (3, 4):
                header.level_encodings.append(value)
            elif which == 8 and field_id in (5, 6):
                header.level_bytes.append(value)


class _Header:
    __slots__ = (
        "type",
        "uncompressed",
        "size",
        "crc",
        "kinds",
        "values",
        "encodings",
        "level_encodings",
        "level_bytes",
    )

    def __init__(self):
        self.type = self.uncompressed = self.size = self.crc = self.values = None
        self.kinds: list[int] = []
        self.encodings: list[int] = []
        self.level_encodings: list[int] = []
        self.level_bytes: list[int] = []  # a v2 page's definition and repetition levels, in bytes


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
    view = memoryview(data)
    for group_index in range(metadata.num_row_groups):
        group = metadata.row_group(group_index)
        for column_index in range(group.num_columns):
            chunk = group.column(column_index)
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            if start is None or start < 0 or start + chunk.total_compressed_size > len(data):
                raise PageDamage(f"column {chunk.path_in_schema!r}'s pages lie outside the file")
            encodings = {_ENCODINGS.get(name, -1) for name in chunk.encodings}
            reader = _CompactReader(view, start, start + chunk.total_compressed_size)
            values = 0
            first = True
            while reader.pos < reader.end:
                at = reader.pos
                header = reader.page_header()
                body = reader.pos
                reader.advance(header.size)
                expected = _DICTIONARY_PAGE if first and chunk.has_dictionary_page else None
                problem = _header_problem(header, expected, encodings)
                if problem:
                    raise PageDamage(f"column {chunk.path_in_schema!r}: {problem} (page at byte {at})")
                if header.type != _DICTIONARY_PAGE:
                    values += header.values
                first = False
                yield PageSpan(chunk.path_in_schema, group_index, at, body, reader.pos, header.crc)
            if values != chunk.num_values:
                raise PageDamage(
                    f"column {chunk.path_in_schema!r}: its pages hold {values} values, its footer says {chunk.num_values}"
                )


def _header_problem(header: _Header, expected_type: int | None, encodings: set[int]) -> str | None:
    """What a page header says that cannot be, or None."""
    sub_header = {_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}.get(header.type)
    if sub_header is None or header.kinds != [sub_header]:
        return f"a page of unknown type {header.type}"
    if (header.type == _DICTIONARY_PAGE) != (expected_type == _DICTIONARY_PAGE):
        return "a dictionary page where a data page belongs" if expected_type is None else "no dictionary page first"
    if header.values is None or header.values < 0:
        return "a page without its count of values"
    if len(header.encodings) != 1 or header.encodings[0] not in encodings:
        return "a page in an encoding its column chunk does not list"
    if any(level not in _LEVEL_ENCODINGS for level in header.level_encodings):
        return "levels in an unknown encoding"
    if header.type == _DATA_PAGE_V2 and (
        min(header.level_bytes, default=0) < 0 or sum(header.level_bytes) > header.size
    ):
        return "levels longer than their page"
    return None


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
