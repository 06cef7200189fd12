"""Resolving new addresses of one build-ID: SymCache first, then the symbol table and the DWARF
line table for what SymCache leaves open.

- The outermost (physical) frame is named from the ELF symbol table: SymCache names a function
  split by GCC into hot and `.cold` parts after whichever part starts lower, so an address in
  `foo` would come back as `foo.cold`. The symbol table says which part the address is in.
- An address SymCache gives no line for (code without a DWARF function, alignment padding
  between functions) gets the row of the DWARF line table (`lines.LineTable`).
- Addresses outside every PT_LOAD segment, or in a module without usable debug info, come back
  unsymbolized with the reason.

The output is a `ResultChunk` keyed by lookup address, with raw (mangled) names.
"""

from __future__ import annotations

import os
from bisect import bisect_right

from tbpipe.pipeline.symbols.columns import ResultChunk
from tbpipe.pipeline.symbols.elf import SymbolTable, read_symbol_table
from tbpipe.pipeline.symbols.lines import LineTable
from tbpipe.pipeline.symbols.model import ElfFileError, ModuleStatus, Quality, short_build_id
from tbpipe.pipeline.symbols.symcache import StringTable, SymCacheReader

_MAX_ADDRESS = (1 << 64) - 1
# Functions are aligned to at most 64 bytes by GCC/clang (-falign-functions); leave room for
# page-aligned hand-written assembly without scanning far.
_MAX_PADDING = 4096
# inline flags of a chain of n frames: all but the outermost are inlined
_INLINED = [[]] + [[1] * (n - 1) + [0] for n in range(1, 257)]


def file_identity(path: str) -> tuple[str, int, int, int, int] | None:
    """(path, size, mtime_ns, inode, device) of a file, None when it cannot be stat'ed."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (path, info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)


class _Builder:
    """Accumulates entries of a ResultChunk whose ids index one StringTable."""

    def __init__(self, strings: StringTable):
        self.strings = strings
        self.keys: list[int] = []
        self.counts: list[int] = []
        self.reasons: list[int] = []
        self.functions: list[int] = []
        self.files: list[int] = []
        self.lines: list[int] = []
        self.inlined: list[int] = []

    def single(self, key: int, function: int, file: int, line: int, reason: str | None) -> None:
        self.keys.append(key)
        self.counts.append(1)
        self.reasons.append(self.strings.intern(reason))
        self.functions.append(function)
        self.files.append(file)
        self.lines.append(line)
        self.inlined.append(0)

    def nothing(self, key: int, reason: str) -> None:
        self.keys.append(key)
        self.counts.append(0)
        self.reasons.append(self.strings.intern(reason))

    def chunk(self) -> ResultChunk:
        """The chunk, with only the strings it uses (the table is shared across calls)."""
        used = sorted({*self.functions, *self.files, *self.reasons} - {-1})
        remap = {old: new for new, old in enumerate(used)}
        remap[-1] = -1
        table = self.strings.strings
        chunk = ResultChunk()
        chunk.strings = [table[i] for i in used]
        chunk.keys.extend(self.keys)
        chunk.counts.extend(self.counts)
        chunk.reasons.extend([remap[r] for r in self.reasons])
        chunk.functions.extend([remap[f] for f in self.functions])
        chunk.files.extend([remap[f] for f in self.files])
        chunk.lines.extend(self.lines)
        chunk.inlined.extend(self.inlined)
        return chunk


class ModuleResolver:
    """Resolves addresses of one build-ID in this process (the SymCache is already built)."""

    def __init__(self, status: ModuleStatus, symcache: bytes | None, debug_identity: tuple | None = None):
        self.status = status
        self.strings = StringTable()
        self._reader = SymCacheReader(symcache, self.strings) if symcache is not None else None
        self._expected_identity = tuple(debug_identity) if debug_identity else None
        self._symtab: SymbolTable | None = None
        self._symtab_loaded = False
        self._lines: LineTable | None = None
        self._lines_loaded = False
        self._lines_problem: str | None = None
        # Only executable segments hold code: SymCache would stretch a size-less symbol such as
        # _fini over .rodata and beyond, and binutils/llvm say "??" there.
        ranges = sorted((vaddr, vaddr + memsz) for vaddr, memsz, flags in status.segments if memsz > 0 and flags & 1)
        self._range_starts = [start for start, _end in ranges]
        self._ranges = ranges

    def preload(self) -> None:
        """Load the symbol table now (done lazily otherwise)."""
        self.symtab()

    # ---- the files beside the SymCache, checked to be the ones the SymCache came from

    def _debug_file_ok(self) -> bool:
        path = self.status.debug_file
        if not path:
            return False
        identity = file_identity(path)
        if identity is None:
            return False
        return self._expected_identity is None or identity == self._expected_identity

    def symtab(self) -> SymbolTable | None:
        if not self._symtab_loaded:
            self._symtab_loaded = True
            if self._debug_file_ok():
                try:
                    self._symtab = read_symbol_table(self.status.debug_file)
                except ElfFileError:
                    self._symtab = None
        return self._symtab

    def lines(self) -> LineTable | None:
        if not self._lines_loaded:
            self._lines_loaded = True
            if self.status.quality is Quality.DWARF:
                if self._debug_file_ok():
                    self._lines = LineTable(self.status.debug_file)
                else:
                    self._lines_problem = f"{self.status.debug_file} changed or is gone"
        return self._lines

    def _row(self, address: int) -> tuple[str | None, int] | None:
        table = self.lines()
        if table is None:
            return None
        try:
            return table.row(address)
        except ElfFileError as error:
            self._lines = None
            self._lines_problem = str(error)
            return None

    def _padding_row(self, address: int) -> tuple[str | None, int] | None:
        """The line-table row covering an address in the padding after a function.

        The assembler emits rows only where instructions start, and alignment padding has
        none: the row of a function's last instruction runs on until the next function's first
        row, within the same line sequence. A sequence is one compile unit's contiguous
        section contribution, which is exactly a .debug_aranges range, so the row is the one of
        the closest lower address with code, if that address lies in the same CU range.
        Decoding the CU's whole line program would give the same answer; for random
        addresses it would mean decoding every CU of the library (seconds for libpython).
        """
        table = self.lines()
        if table is None:
            return None
        try:
            found = table.unit_range(address)
        except ElfFileError as error:
            self._lines, self._lines_problem = None, str(error)
            return None
        if found is None:
            return None
        strings = self.strings.strings
        lowest = max(found[0], address - _MAX_PADDING)
        probe = address - 1
        while probe >= lowest:
            batch = list(range(probe, max(lowest, probe - 15) - 1, -1))
            counts, _functions, files, lines = self._reader.lookup_flat(batch)
            pos = 0
            for candidate, count in zip(batch, counts):
                if count:
                    if not lines[pos] and count == 1:
                        return self._row(candidate)  # code without a DWARF function: its own row
                    return (strings[files[pos]] if files[pos] >= 0 else None, lines[pos]) if lines[pos] else None
            probe = batch[-1] - 1
        return None

    # ---- resolution

    def _outside(self, address: int) -> bool:
        if not self._ranges:
            return False
        index = bisect_right(self._range_starts, address) - 1
        return index < 0 or address >= self._ranges[index][1]

    def _symbol_id(self, address: int) -> int:
        """String id of the function symbol containing `address`, -1 when none does."""
        named = self._symtab.lookup(address) if self._symtab is not None else None
        if named is None:
            return -1
        return self.strings.intern(named[0])

    def resolve(self, keys: list[int]) -> tuple[ResultChunk, list[int]]:
        """Frames for lookup addresses (already pc-1 for return addresses), and the addresses
        whose answer depended on a file that is gone (not worth storing)."""
        status = self.status
        out = _Builder(self.strings)
        incomplete: list[int] = []
        todo: list[int] = []
        module = status.module_path or status.debug_file or short_build_id(status.build_id)
        for key in keys:
            if key < 0 or key > _MAX_ADDRESS:
                raise ValueError(f"lookup address out of range: {key}")
            if status.quality is Quality.NONE or self._reader is None:
                out.nothing(key, status.reason)
            elif self._outside(key):
                out.nothing(key, f"address {key:#x} is outside every executable segment of {module}")
            else:
                todo.append(key)
        if todo:
            self._resolve_looked_up(todo, out, incomplete)
        return out.chunk(), incomplete

    def _resolve_looked_up(self, keys: list[int], out: _Builder, incomplete: list[int]) -> None:
        status = self.status
        short = short_build_id(status.build_id)
        dwarf = status.quality is Quality.DWARF
        intern = self.strings.intern
        symbols_only = None if dwarf else intern(f"symbols only: no DWARF for build-ID {short}")
        no_line = intern("no line information for this address")
        self.symtab()
        has_symtab = self._symtab is not None
        symbol_id = self._symbol_id

        counts, functions, files, lines = self._reader.lookup_flat(keys)
        empty: list[int] = []
        without_line: list[tuple[int, int, int]] = []  # (entry, frame position, key)
        out_keys, out_counts, out_reasons, out_inlined = out.keys, out.counts, out.reasons, out.inlined
        pos = 0
        for key, count in zip(keys, counts):
            if not count:
                empty.append(key)
                continue
            last = pos + count - 1
            if has_symtab:
                named = symbol_id(key)
                if named >= 0:
                    functions[last] = named
            if dwarf:
                if count == 1 and not lines[pos]:
                    without_line.append((len(out_keys), pos, key))
                out_reasons.append(-1)
            else:
                out_reasons.append(symbols_only)
            out_keys.append(key)
            out_counts.append(count)
            out_inlined.extend(_INLINED[count] if count < len(_INLINED) else [1] * (count - 1) + [0])
            pos += count
        out.functions.extend(functions)
        out.files.extend(files)
        out.lines.extend(lines)

        base = len(out.functions) - len(functions)
        for entry, position, key in without_line:
            row = self._row(key)
            if row is not None and row[1]:
                out.files[base + position] = intern(row[0])
                out.lines[base + position] = row[1]
            elif self._lines_problem:
                incomplete.append(key)
                out_reasons[entry] = intern(f"no line information (line table unavailable: {self._lines_problem})")
            else:
                out_reasons[entry] = no_line

        where = status.debug_file or status.module_path or short
        for key in empty:
            # Padding between functions, or a symbol symbolic skipped.
            named = symbol_id(key)
            row = (self._row(key) if named >= 0 else self._padding_row(key)) if dwarf else None
            if row is not None and row[1]:
                why = (
                    None if named >= 0 else "not inside any function (alignment padding); file:line from the line table"
                )
                out.single(key, named, intern(row[0]), row[1], why)
            elif named >= 0:
                why = (
                    "no line information for this address" if dwarf else f"symbols only: no DWARF for build-ID {short}"
                )
                out.single(key, named, -1, 0, why)
            else:
                if dwarf and self._lines_problem:
                    incomplete.append(key)
                kind = "function or line-table row" if dwarf else "function symbol"
                out.nothing(key, f"no {kind} covers {key:#x} in {where}")
