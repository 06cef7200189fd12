"""Resolving new addresses of one build-ID: SymCache first, then the symbol table and the DWARF
line table for what SymCache leaves open.

- The outermost (physical) frame is named from the ELF symbol table: SymCache names a function
  split by GCC into hot and `.cold` parts after whichever part starts lower, so an address in
  `foo` would come back as `foo.cold`. The symbol table says which part the address is in.
- An address SymCache gives no line for (code without a DWARF function, alignment padding
  between functions) gets the row of the DWARF line table (`lines.LineTable`).
- Addresses outside every PT_LOAD segment, or in a module without usable debug info, come back
  unsymbolized with the reason.

The per-address work (SymCache lookups, symbol-table naming, the columns of the result) runs in
the extension (`symcache.SymCacheReader`); what is left here is the rare cases, one by one.
The output is a `ResultChunk` keyed by lookup address, with raw (mangled) names.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence

from tbpipe.pipeline.symbols.columns import ResultChunk
from tbpipe.pipeline.symbols.elf import SymbolTable, file_identity, read_symbol_table
from tbpipe.pipeline.symbols.lines import LineTable
from tbpipe.pipeline.symbols.model import ElfFileError, ModuleStatus, Quality, short_build_id
from tbpipe.pipeline.symbols.symcache import StringTable, SymCacheReader

# Functions are aligned to at most 64 bytes by GCC/clang (-falign-functions); leave room for
# page-aligned hand-written assembly without scanning far.
_MAX_PADDING = 4096


class _Builder(ResultChunk):
    """A ResultChunk being filled, whose ids index a string table that outlives it (a
    SymCacheReader or a StringTable: anything with `intern` and `strings`)."""

    def __init__(self, table: SymCacheReader | StringTable):
        super().__init__()
        self.table = table

    def extend(self, *columns: bytes) -> None:
        """Append columns as the extension returns them (bytes in the arrays' typecodes, in
        field order: keys, counts, reasons, functions, files, lines, inlined)."""
        targets = (self.keys, self.counts, self.reasons, self.functions, self.files, self.lines, self.inlined)
        for column, data in zip(targets, columns, strict=True):
            column.frombytes(data)

    def single(self, key: int, function: int, file: int, line: int, reason: str | None) -> None:
        self.keys.append(key)
        self.counts.append(1)
        self.reasons.append(self.table.intern(reason))
        self.functions.append(function)
        self.files.append(file)
        self.lines.append(line)
        self.inlined.append(0)

    def nothing(self, key: int, reason: str) -> None:
        self.keys.append(key)
        self.counts.append(0)
        self.reasons.append(self.table.intern(reason))

    def chunk(self) -> ResultChunk:
        """The chunk, with only the strings it uses (the table is shared across calls). The id
        columns are renumbered in place: call once."""
        from tbpipe import _native

        used = _native.compact_string_ids(self.functions, self.files, self.reasons)
        table = self.table.strings
        return ResultChunk(
            self.keys,
            self.counts,
            self.reasons,
            self.functions,
            self.files,
            self.lines,
            self.inlined,
            [table[i] for i in used],
        )


# Symbol tables and line tables read ahead of need, by (path, identity): see `prefetch`.
_prefetched: dict[tuple, tuple[SymbolTable | None, LineTable | None]] = {}
_prefetch_lock = threading.Lock()


def prefetch(path: str, dwarf: bool) -> threading.Thread:
    """Read `path`'s symbol table (and, with `dwarf`, index its line table) in a thread.

    Meant for the time a SymCache build of the same file takes: symbolic releases the GIL
    while it builds, so on a second core this costs no wall time. A resolver for that file
    takes what is ready when it is made; anything that fails here is simply redone there.
    """

    def work() -> None:
        identity = file_identity(path)
        if identity is None:
            return
        # Whatever goes wrong here (a damaged file: pyelftools raises many types) is met again,
        # and reported, where the resolver reads the file itself.
        try:
            symtab = read_symbol_table(path)
        except Exception:
            return
        lines = None
        if dwarf:
            lines = LineTable(path)
            try:
                lines.build_index()
            except Exception:
                lines = None
        with _prefetch_lock:
            if len(_prefetched) >= 8:
                _prefetched.clear()
            _prefetched[identity] = (symtab, lines)

    thread = threading.Thread(target=work, name="tbpipe-prefetch", daemon=True)
    thread.start()
    return thread


def _take_prefetched(identity: tuple | None) -> tuple[SymbolTable | None, LineTable | None] | None:
    if identity is None:
        return None
    with _prefetch_lock:
        return _prefetched.pop(identity, None)


class ModuleResolver:
    """Resolves addresses of one build-ID in this process (the SymCache is already built)."""

    def __init__(self, status: ModuleStatus, symcache: bytes | None, debug_identity: tuple | None = None):
        self.status = status
        self._reader = SymCacheReader(symcache) if symcache is not None else None
        self.strings: SymCacheReader | StringTable = self._reader if self._reader is not None else StringTable()
        self._expected_identity = tuple(debug_identity) if debug_identity else None
        self._symtab: SymbolTable | None = None
        self._symtab_loaded = False
        self._lines: LineTable | None = None
        self._lines_loaded = False
        self._lines_problem: str | None = None
        # Only executable segments hold code: SymCache would stretch a size-less symbol such as
        # _fini over .rodata and beyond, and binutils/llvm say "??" there.
        ranges = sorted((vaddr, vaddr + memsz) for vaddr, memsz, flags in status.segments if memsz > 0 and flags & 1)
        if self._reader is not None:
            self._reader.set_code_ranges(ranges)
        self._symbols_given = False
        # Threads for the SymCache lookups of big batches (the symbolizer sets its job count).
        self.threads = 1
        if status.debug_file and self._debug_file_ok():
            ready = _take_prefetched(file_identity(status.debug_file))
            if ready is not None:
                self._symtab, self._symtab_loaded = ready[0], True
                if ready[1] is not None and status.quality is Quality.DWARF:
                    self._lines, self._lines_loaded = ready[1], True

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

    def _give_symbols(self) -> None:
        """Hand the symbol table to the extension (once), which names outermost frames by it."""
        if not self._symbols_given:
            self._symbols_given = True
            table = self.symtab()
            if table is not None:
                self._reader.set_symbols(table.starts, table.ends, table.name)

    def resolve(self, keys: Sequence[int]) -> tuple[ResultChunk, list[int]]:
        """Frames for lookup addresses (already pc-1 for return addresses), and the addresses
        whose answer depended on a file that is gone (not worth storing)."""
        status = self.status
        out = _Builder(self.strings)
        incomplete: list[int] = []
        try:
            batch = array("Q", keys)
        except OverflowError:
            raise ValueError(f"lookup address out of range: {min(keys)} .. {max(keys)}") from None
        if status.quality is Quality.NONE or self._reader is None:
            for key in batch:
                out.nothing(key, status.reason)
        elif batch:
            self._resolve_looked_up(batch, out, incomplete)
        return out.chunk(), incomplete

    def _resolve_looked_up(self, keys: array, out: _Builder, incomplete: list[int]) -> None:
        status = self.status
        short = short_build_id(status.build_id)
        dwarf = status.quality is Quality.DWARF
        intern = self.strings.intern
        reason = -1 if dwarf else intern(f"symbols only: no DWARF for build-ID {short}")
        self._give_symbols()
        symbol_id = self._reader.symbol_id  # the function symbol containing an address (-1: none)

        base_entry, base_frame = len(out.keys), len(out.functions)
        *columns, without_line, outside, empty = self._reader.resolve(keys, reason, self.threads)
        out.extend(*columns)
        if dwarf:
            # A single frame without a line: code without a DWARF function; the line table may
            # still place it.
            no_line = intern("no line information for this address")
            for entry, position in without_line:
                entry += base_entry
                key = out.keys[entry]
                row = self._row(key)
                if row is not None and row[1]:
                    out.files[base_frame + position] = intern(row[0])
                    out.lines[base_frame + position] = row[1]
                elif self._lines_problem:
                    incomplete.append(key)
                    out.reasons[entry] = intern(f"no line information (line table unavailable: {self._lines_problem})")
                else:
                    out.reasons[entry] = no_line

        module = status.module_path or status.debug_file or short
        for key in outside:
            out.nothing(key, f"address {key:#x} is outside every executable segment of {module}")

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
