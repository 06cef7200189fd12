"""Exact DWARF line-table rows for the addresses a SymCache cannot place on a line.

SymCache keeps line records only inside DWARF functions (DW_TAG_subprogram). Code that the
line table covers but no subprogram does - functions GCC emits without a concrete DIE (e.g.
`PyObject_Call` in libpython 3.11), hand-written assembly, alignment padding between functions -
comes back from SymCache with no file:line. For those addresses this module finds the compile
unit (from .debug_aranges, else the CU DIE ranges) and reads that unit's line program.

pyelftools parses the line program header (directory/file tables, every DWARF version); the
rows themselves are decoded by a small state machine here, because pyelftools' decoder builds
an object per opcode and costs ~10 us per row (1 s for libpython's parser.c alone), while
this loop is about ten times faster. The two are cross-checked in tests; programs this loop
does not model (VLIW op_index) go through pyelftools' decoder.
"""

from __future__ import annotations

import posixpath
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from tbpipe.pipeline.symbols.elf import load_dwarf, read_section


@dataclass
class _Sequence:
    start: int
    end: int  # exclusive: the DW_LNE_end_sequence address
    addresses: list[int]
    files: list[int]
    lines: list[int]


class _UnitRows:
    """The decoded rows of one compile unit: sequences sorted by start address."""

    def __init__(self, sequences: list[_Sequence], paths: dict[int, str | None]):
        sequences.sort(key=lambda s: s.start)
        self.sequences = sequences
        self.starts = [s.start for s in sequences]
        self.paths = paths

    def row(self, address: int) -> tuple[str | None, int] | None:
        index = bisect_right(self.starts, address) - 1
        # Sequences can nest in broken inputs; look back a little for one that ends later.
        for candidate in range(index, max(index - 4, -1), -1):
            sequence = self.sequences[candidate]
            if sequence.start <= address < sequence.end:
                # The last row at or below the address (of several at the same address, the
                # last one, as llvm-symbolizer does).
                at = bisect_right(sequence.addresses, address) - 1
                if at < 0:
                    return None
                return self.paths.get(sequence.files[at]), sequence.lines[at]
        return None


class LineTable:
    """Line-table lookups for one debug file, loading compile units lazily."""

    def __init__(self, path: str):
        self._path = path
        self._dwarf: Any = None
        self._ranges_loaded = False
        self._range_starts: list[int] = []
        self._ranges: list[tuple[int, int, int]] = []  # (start, end, cu_offset), sorted
        self._units: dict[int, _UnitRows | None] = {}
        self._line_data: bytes = b""

    def _load_dwarf(self) -> Any:
        # Decompressing .debug_info and friends is the expensive part: only done once a CU's
        # line program is really needed (padding needs .debug_aranges alone).
        if self._dwarf is None:
            self._dwarf = load_dwarf(self._path)
            self._line_data = self._dwarf.debug_line_sec.stream.getvalue()
        return self._dwarf

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
        found = self.unit_range(address)
        if found is None:
            return None
        cu_offset = found[2]
        if cu_offset not in self._units:
            self._units[cu_offset] = self._decode_unit(cu_offset)
        unit = self._units[cu_offset]
        return unit.row(address) if unit is not None else None

    def _decode_unit(self, cu_offset: int) -> _UnitRows | None:
        dwarf = self._load_dwarf()
        try:
            cu = dwarf.get_CU_at(cu_offset)
            program = dwarf.line_program_for_CU(cu)
        except Exception:
            return None
        if program is None:
            return None
        header = program.header
        paths = _file_paths(cu, header)
        try:
            if header.get("maximum_operations_per_instruction", 1) != 1:
                sequences = _sequences_from_pyelftools(program)
            else:
                sequences = decode_sequences(
                    self._line_data,
                    program.program_start_offset,
                    program.program_end_offset,
                    header,
                    little_endian=dwarf.config.little_endian,
                )
        except Exception:
            return None
        return _UnitRows(sequences, paths)


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


def _file_paths(cu: Any, header: Any) -> dict[int, str | None]:
    """File index -> path, joined and normalized the way symbolic reports paths."""
    version = header["version"]
    directories = [_text(d) for d in header["include_directory"]]
    try:
        top = cu.get_top_DIE()
        comp_dir = _text(top.attributes["DW_AT_comp_dir"].value) if "DW_AT_comp_dir" in top.attributes else ""
    except Exception:
        comp_dir = ""
    paths: dict[int, str | None] = {}
    for position, entry in enumerate(header["file_entry"]):
        name = _text(entry.name)
        dir_index = entry.dir_index
        if version >= 5:
            index = position  # DWARF 5 numbers files and directories from 0
            directory = directories[dir_index] if dir_index < len(directories) else ""
        else:
            index = position + 1
            directory = directories[dir_index - 1] if 0 < dir_index <= len(directories) else ""
        # A relative directory (even DWARF 5's entry 0) is relative to DW_AT_comp_dir, as
        # llvm-symbolizer and symbolic resolve it; join() drops comp_dir for absolute ones.
        joined = posixpath.join(comp_dir, directory, name)
        paths[index] = posixpath.normpath(joined) if joined else None
    return paths


def decode_sequences(data: bytes, start: int, end: int, header: Any, *, little_endian: bool = True) -> list[_Sequence]:
    """Rows of one line program (bytes data[start:end]) as address-sorted sequences.

    The LEB128 reads are written out inline in each opcode branch on purpose: a
    helper call per operand costs more than the decode itself in this loop,
    which runs once per line-table byte.
    """
    opcode_base = header["opcode_base"]
    line_base = header["line_base"]
    line_range = header["line_range"]
    min_length = header["minimum_instruction_length"]
    standard_lengths = list(header["standard_opcode_lengths"])
    if line_range == 0:
        raise ValueError("line_range is 0")
    const_add = ((255 - opcode_base) // line_range) * min_length
    order = "little" if little_endian else "big"

    sequences: list[_Sequence] = []
    addresses: list[int] = []
    files: list[int] = []
    lines: list[int] = []
    address, file, line = 0, 1, 1
    pos = start
    while pos < end:
        op = data[pos]
        pos += 1
        if op >= opcode_base:
            adjusted = op - opcode_base
            address += (adjusted // line_range) * min_length
            line += line_base + adjusted % line_range
            addresses.append(address)
            files.append(file)
            lines.append(line)
        elif op == 0:
            length = 0
            shift = 0
            while True:
                byte = data[pos]
                pos += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            if length == 0:
                continue
            sub = data[pos]
            if sub == 1:  # DW_LNE_end_sequence
                if addresses:
                    sequences.append(_Sequence(addresses[0], address, addresses, files, lines))
                addresses, files, lines = [], [], []
                address, file, line = 0, 1, 1
            elif sub == 2:  # DW_LNE_set_address
                address = int.from_bytes(data[pos + 1 : pos + length], order)
            pos += length
        elif op == 1:  # DW_LNS_copy
            addresses.append(address)
            files.append(file)
            lines.append(line)
        elif op == 2:  # DW_LNS_advance_pc
            value = 0
            shift = 0
            while True:
                byte = data[pos]
                pos += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            address += value * min_length
        elif op == 3:  # DW_LNS_advance_line (signed)
            value = 0
            shift = 0
            while True:
                byte = data[pos]
                pos += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            if byte & 0x40:
                value -= 1 << shift
            line += value
        elif op == 4:  # DW_LNS_set_file
            value = 0
            shift = 0
            while True:
                byte = data[pos]
                pos += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            file = value
        elif op == 8:  # DW_LNS_const_add_pc
            address += const_add
        elif op == 9:  # DW_LNS_fixed_advance_pc
            address += int.from_bytes(data[pos : pos + 2], order)
            pos += 2
        else:
            # set_column, negate_stmt, basic_block, prologue_end, epilogue_begin, set_isa and
            # unknown standard opcodes: skip their ULEB operands.
            for _ in range(standard_lengths[op - 1] if op - 1 < len(standard_lengths) else 0):
                while data[pos] >= 0x80:
                    pos += 1
                pos += 1
    return sequences


def _sequences_from_pyelftools(program: Any) -> list[_Sequence]:
    sequences: list[_Sequence] = []
    addresses: list[int] = []
    files: list[int] = []
    lines: list[int] = []
    for entry in program.get_entries():
        state = entry.state
        if state is None:
            continue
        if state.end_sequence:
            if addresses:
                sequences.append(_Sequence(addresses[0], state.address, addresses, files, lines))
            addresses, files, lines = [], [], []
            continue
        addresses.append(state.address)
        files.append(state.file)
        lines.append(state.line)
    return sequences
