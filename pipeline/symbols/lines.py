"""Exact DWARF line-table rows for the addresses a SymCache cannot place on a line.

SymCache keeps line records only inside DWARF functions (DW_TAG_subprogram). Code that the
line table covers but no subprogram does - functions GCC emits without a concrete DIE (e.g.
`PyObject_Call` in libpython 3.11), hand-written assembly, alignment padding between functions -
comes back from SymCache with no file:line. For those addresses this module asks the line table.

The line programs are read by the extension (`tbpipe._native.LineTable`, native/line_table.cpp):
one pass over .debug_line indexes every sequence, and a lookup decodes only the sequence that
covers the address. pyelftools, which builds an object per opcode, took ~0.3 s of a 0.8 s budget
for the 26 units 100k random libpython addresses touch; it stays the reference the extension is
tested against, and reads the compile-unit DIEs where .debug_aranges or DW_AT_comp_dir are needed.
"""

from __future__ import annotations

import posixpath
from bisect import bisect_right
from typing import Any

from tbpipe.pipeline.symbols.elf import load_dwarf, read_section, read_sections
from tbpipe.pipeline.symbols.model import ElfFileError


def line_index(path: str) -> Any:
    """The built `tbpipe._native.LineTable` of the ELF file at `path`."""
    from tbpipe import _native

    sections, little_endian = read_sections(path, (".debug_line", ".debug_line_str", ".debug_str"))
    if not sections[".debug_line"]:
        raise ElfFileError(f"{path}: no DWARF line tables")
    index = _native.LineTable(
        sections[".debug_line"], sections[".debug_line_str"] or b"", sections[".debug_str"] or b"", little_endian
    )
    index.build()
    return index


class LineTable:
    """Line-table lookups for one debug file, loading what they need lazily."""

    def __init__(self, path: str):
        self._path = path
        self._dwarf: Any = None
        self._ranges_loaded = False
        self._range_starts: list[int] = []
        self._ranges: list[tuple[int, int, int]] = []  # (start, end, cu_offset), sorted
        self._index: Any = None
        self._unit_paths: dict[int, dict[int, str | None]] = {}
        self._comp_dirs: dict[int, str] | None = None  # .debug_line offset -> DW_AT_comp_dir

    def _load_dwarf(self) -> Any:
        # Decompressing .debug_info and friends is expensive: only done when compile-unit DIEs
        # are really needed (no .debug_aranges, or DWARF < 5 with relative paths).
        if self._dwarf is None:
            self._dwarf = load_dwarf(self._path)
        return self._dwarf

    def build_index(self) -> None:
        """Read and index the line table now (done on the first lookup otherwise). The
        compile-unit ranges, which only padding needs, stay lazy: without .debug_aranges they
        mean reading every CU's DIE."""
        self._load_index()

    def _load_index(self) -> Any:
        if self._index is None:
            self._index = line_index(self._path)
        return self._index

    def _load_ranges(self) -> None:
        if self._ranges_loaded:
            return
        data = read_section(self._path, ".debug_aranges")
        ranges = read_aranges(data) if data else []
        if not ranges:
            ranges = self._cu_die_ranges()
        ranges.sort()
        self._ranges = ranges
        self._range_starts = [r[0] for r in ranges]
        self._ranges_loaded = True

    def _cu_die_ranges(self) -> list[tuple[int, int, int]]:
        # Without .debug_aranges (clang's default) the CU DIEs say which addresses they cover.
        found: list[tuple[int, int, int]] = []
        dwarf = self._load_dwarf()
        try:
            range_lists = dwarf.range_lists()
        except Exception:
            range_lists = None
        for cu in dwarf.iter_CUs():
            try:
                top = cu.get_top_DIE()
                attributes = top.attributes
                if "DW_AT_ranges" in attributes and range_lists is not None:
                    base = attributes["DW_AT_low_pc"].value if "DW_AT_low_pc" in attributes else 0
                    entries = range_lists.get_range_list_at_offset(attributes["DW_AT_ranges"].value, cu=cu)
                    for entry in entries:
                        if hasattr(entry, "begin_offset"):
                            is_absolute = getattr(entry, "is_absolute", False)
                            begin = entry.begin_offset if is_absolute else base + entry.begin_offset
                            end = entry.end_offset if is_absolute else base + entry.end_offset
                            if end > begin:
                                found.append((begin, end, cu.cu_offset))
                        elif hasattr(entry, "base_address"):
                            base = entry.base_address
                elif "DW_AT_low_pc" in attributes and "DW_AT_high_pc" in attributes:
                    low = attributes["DW_AT_low_pc"].value
                    high_attribute = attributes["DW_AT_high_pc"]
                    high = high_attribute.value
                    if high_attribute.form != "DW_FORM_addr":
                        high += low  # DWARF 4+: high_pc as an offset from low_pc
                    if high > low:
                        found.append((low, high, cu.cu_offset))
            except Exception:
                continue  # one unreadable unit must not hide the others
        return found

    def unit_range(self, address: int) -> tuple[int, int, int] | None:
        """(start, end, cu_offset) of the compile-unit address range containing `address`."""
        self._load_ranges()
        index = bisect_right(self._range_starts, address) - 1
        for candidate in range(index, max(index - 4, -1), -1):
            start, end, cu_offset = self._ranges[candidate]
            if start <= address < end:
                return start, end, cu_offset
        return None

    def row(self, address: int) -> tuple[str | None, int] | None:
        """(file, line) of the line-table row covering `address`; None when no row does."""
        found = self._load_index().row(address)
        if found is None:
            return None
        unit, file, line = found
        paths = self._unit_paths.get(unit)
        if paths is None:
            paths = self._unit_paths[unit] = self._file_paths(unit)
        return paths.get(file), line

    def _file_paths(self, unit: int) -> dict[int, str | None]:
        """File index -> path, joined and normalized the way symbolic reports paths."""
        version, offset, directories, files = self._index.unit(unit)
        if version >= 5:
            # DWARF 5 numbers files and directories from 0; directory 0 is the unit's
            # DW_AT_comp_dir, which relative directories are relative to.
            comp_dir = directories[0] if directories else ""
            numbered = [
                (position, name, directories[d] if d < len(directories) else "")
                for position, (name, d) in enumerate(files)
            ]
        else:
            numbered = [
                (position + 1, name, directories[d - 1] if 0 < d <= len(directories) else "")
                for position, (name, d) in enumerate(files)
            ]
            relative = any(not posixpath.isabs(posixpath.join(directory, name)) for _i, name, directory in numbered)
            comp_dir = self._comp_dir(offset) if relative else ""
        paths: dict[int, str | None] = {}
        for index, name, directory in numbered:
            # join() drops what comes before an absolute part, as llvm-symbolizer and symbolic do.
            joined = posixpath.join(comp_dir, directory, name)
            paths[index] = posixpath.normpath(joined) if joined else None
        return paths

    def _comp_dir(self, line_offset: int) -> str:
        """DW_AT_comp_dir of the compile unit whose DW_AT_stmt_list is `line_offset`."""
        if self._comp_dirs is None:
            self._comp_dirs = {}
            try:
                for cu in self._load_dwarf().iter_CUs():
                    try:
                        attributes = cu.get_top_DIE().attributes
                        if "DW_AT_stmt_list" in attributes and "DW_AT_comp_dir" in attributes:
                            comp_dir = _text(attributes["DW_AT_comp_dir"].value)
                            self._comp_dirs[attributes["DW_AT_stmt_list"].value] = comp_dir
                    except Exception:
                        continue  # one unreadable unit must not hide the others
            except Exception:
                pass  # no usable .debug_info: paths stay as the line table has them
        return self._comp_dirs.get(line_offset, "")


def read_aranges(data: bytes, little_endian: bool = True) -> list[tuple[int, int, int]]:
    """(start, end, cu_offset) for every range in a .debug_aranges section.

    The section is a flat list of per-CU tables; pyelftools parses it at ~50 us per entry
    (0.1 s for glibc's 2,000 ranges, all of it on the cold path), this reads it directly.
    """
    order = "little" if little_endian else "big"
    ranges: list[tuple[int, int, int]] = []
    pos = 0
    size = len(data)
    while pos + 4 <= size:
        unit_start = pos
        length = int.from_bytes(data[pos : pos + 4], order)
        pos += 4
        offset_size = 4
        if length == 0xFFFFFFFF:
            length = int.from_bytes(data[pos : pos + 8], order)
            pos += 8
            offset_size = 8
        end = pos + length
        if length == 0 or end > size:
            break
        pos += 2  # version
        cu_offset = int.from_bytes(data[pos : pos + offset_size], order)
        pos += offset_size
        address_size = data[pos]
        segment_size = data[pos + 1]
        pos += 2
        if address_size not in (4, 8):
            pos = end
            continue
        tuple_size = 2 * address_size + segment_size
        # Tuples start at a multiple of the tuple size from the start of the unit.
        remainder = (pos - unit_start) % tuple_size
        if remainder:
            pos += tuple_size - remainder
        while pos + tuple_size <= end:
            pos += segment_size
            start = int.from_bytes(data[pos : pos + address_size], order)
            span = int.from_bytes(data[pos + address_size : pos + 2 * address_size], order)
            pos += 2 * address_size
            if start == 0 and span == 0:
                break
            if span:
                ranges.append((start, start + span, cu_offset))
        pos = end
    return ranges


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
