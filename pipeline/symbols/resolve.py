"""Resolving new addresses of one build-ID: SymCache first, then the symbol table and the DWARF
line table for what SymCache leaves open.

- The outermost (physical) frame is named from the ELF symbol table: SymCache names a function
  split by GCC into hot and `.cold` parts after whichever part starts lower, so an address in
  `foo` would come back as `foo.cold`. The symbol table says which part the address is in.
- An address SymCache gives no line for (code without a DWARF function, padding between
  functions) gets the exact row of the DWARF line table (`lines.LineTable`).
- Addresses outside every PT_LOAD segment, or in a module without usable debug info, come back
  unsymbolized with the reason.

A resolved address is (lookup address, frames, reason) with raw (mangled) names; see `columns`.
"""

from __future__ import annotations

import os

from tbpipe.pipeline.symbols.columns import Resolved
from tbpipe.pipeline.symbols.elf import SymbolTable, read_symbol_table
from tbpipe.pipeline.symbols.lines import LineTable
from tbpipe.pipeline.symbols.model import ElfFileError, ModuleStatus, Quality, short_build_id
from tbpipe.pipeline.symbols.symcache import SymCacheReader

_MAX_ADDRESS = (1 << 64) - 1


def file_identity(path: str) -> tuple[str, int, int, int, int] | None:
    """(path, size, mtime_ns, inode, device) of a file, None when it cannot be stat'ed."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (path, info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)


class ModuleResolver:
    """Resolves addresses of one build-ID in this process (the SymCache is already built)."""

    def __init__(self, status: ModuleStatus, symcache: bytes | None, debug_identity: tuple | None = None):
        self.status = status
        self._reader = SymCacheReader(symcache) if symcache is not None else None
        self._expected_identity = tuple(debug_identity) if debug_identity else None
        self._symtab: SymbolTable | None = None
        self._symtab_loaded = False
        self._lines: LineTable | None = None
        self._lines_loaded = False
        self._lines_problem: str | None = None
        self._ranges = [(vaddr, vaddr + memsz) for vaddr, memsz, _flags in status.segments if memsz > 0]
        # Entries whose answer depended on a file that was not there: not worth keeping.
        self.incomplete: set[int] = set()

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

    # ---- resolution

    def _outside(self, address: int) -> bool:
        if not self._ranges:
            return False
        return not any(start <= address < end for start, end in self._ranges)

    def resolve(self, keys: list[int]) -> list[Resolved]:
        """Frames for each lookup address (already pc-1 for return addresses)."""
        status = self.status
        module = status.module_path or status.debug_file or short_build_id(status.build_id)
        out: list[Resolved] = []
        todo: list[int] = []
        for key in keys:
            if key < 0 or key > _MAX_ADDRESS:
                out.append((key, [], f"invalid address {key:#x}" if key >= 0 else "invalid address (negative)"))
            elif self._outside(key):
                out.append((key, [], f"address {key:#x} is outside every loadable segment of {module}"))
            elif status.quality is Quality.NONE or self._reader is None:
                out.append((key, [], status.reason))
            else:
                out.append(None)
                todo.append(key)
        if not todo:
            return out
        looked_up = iter(self._resolve_known_module(todo))
        return [entry if entry is not None else next(looked_up) for entry in out]

    def _resolve_known_module(self, keys: list[int]) -> list[Resolved]:
        status = self.status
        short = short_build_id(status.build_id)
        dwarf = status.quality is Quality.DWARF
        symtab = self.symtab()
        results = []
        for key, frames in zip(keys, self._reader.lookup_many(keys)):
            reason = None
            if frames:
                if symtab is not None:
                    named = symtab.lookup(key)
                    if named is not None:
                        name, line = named[0], frames[-1]
                        frames[-1] = (name, line[1], line[2])
                if dwarf and len(frames) == 1 and not frames[0][2]:
                    row = self._row(key)
                    if row is not None and row[1]:
                        frames[0] = (frames[0][0], row[0], row[1])
                    elif self._lines_problem:
                        self.incomplete.add(key)
                        reason = f"no line information (line table unavailable: {self._lines_problem})"
                    else:
                        reason = "no line information for this address"
                elif not dwarf:
                    reason = f"symbols only: no DWARF for build-ID {short}"
                last = len(frames) - 1
                results.append(
                    (key, [(name, path, line, index < last) for index, (name, path, line) in enumerate(frames)], reason)
                )
                continue
            # Nothing in the SymCache: padding between functions, code with line rows only, or
            # a symbol symbolic skipped.
            named = symtab.lookup(key) if symtab is not None else None
            row = self._row(key) if dwarf else None
            if row is not None and row[1]:
                function = named[0] if named else None
                why = None if named else "not inside any function (padding?); file:line from the line table"
                results.append((key, [(function, row[0], row[1], False)], why))
            elif named is not None:
                why = "no line information for this address" if dwarf else f"symbols only: no DWARF for build-ID {short}"
                results.append((key, [(named[0], None, 0, False)], why))
            else:
                if dwarf and self._lines_problem:
                    self.incomplete.add(key)
                where = status.debug_file or status.module_path or short
                kind = "function or line-table row" if dwarf else "function symbol"
                results.append((key, [], f"no {kind} covers {key:#x} in {where}"))
        return results
