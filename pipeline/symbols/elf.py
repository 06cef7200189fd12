"""ELF inspection with pyelftools: build-ID notes, `.gnu_debuglink`, program headers, symbol tables,
and the DWARF sections (decompressed, zlib or zstd) that the line-table fallback reads.

Everything here treats files as untrusted: a missing, truncated or corrupt file raises
`ElfFileError` with a one-line message, never anything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import struct
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from tbpipe.pipeline.errors import first_line
from tbpipe.pipeline.symbols.model import ElfFileError

ELF_MAGIC = b"\x7fELF"

# Section flag / compression constants from the ELF gABI.
_SHF_COMPRESSED = 0x800
_ELFCOMPRESS_ZLIB = 1
_ELFCOMPRESS_ZSTD = 2
_PF_X = 1

# Symbol types functions are named by.
_STT_FUNC = 2
_STT_GNU_IFUNC = 10


@dataclass
class ElfFacts:
    """What the locator needs to know about one ELF file."""

    path: str
    build_id: str | None
    has_dwarf: bool  # a non-empty .debug_info (possibly compressed)
    has_symtab: bool  # .symtab with function symbols
    has_dynsym: bool  # .dynsym with function symbols
    debuglink: tuple[str, int] | None  # (.gnu_debuglink file name, CRC32)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # PT_LOAD (vaddr, memsz, p_flags)
    size: int = 0
    mtime_ns: int = 0
    inode: int = 0
    device: int = 0

    @property
    def has_symbols(self) -> bool:
        return self.has_symtab or self.has_dynsym

    @property
    def identity(self) -> tuple[str, int, int, int, int]:
        """Changes whenever the file is replaced or rewritten."""
        return (self.path, self.size, self.mtime_ns, self.inode, self.device)


def elf_facts_to_json(facts: ElfFacts) -> dict:
    """`facts` as JSON values (for the store's memo)."""
    return dataclasses.asdict(facts)


def elf_facts_from_json(value: dict) -> ElfFacts:
    """`elf_facts_to_json`'s inverse; TypeError/ValueError/KeyError on anything else."""
    facts = ElfFacts(**value)
    facts.debuglink = (str(facts.debuglink[0]), int(facts.debuglink[1])) if facts.debuglink else None
    facts.segments = [(int(a), int(b), int(c)) for a, b, c in facts.segments]
    return facts


def _open_elf(path: str) -> tuple[BinaryIO, Any]:
    # Imported lazily: pyelftools costs ~50 ms to import and warm paths never need it.
    from elftools.elf.elffile import ELFFile

    try:
        stream = open(path, "rb")
    except FileNotFoundError:
        raise ElfFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ElfFileError(f"{path}: is a directory") from None
    except PermissionError:
        raise ElfFileError(f"{path}: permission denied") from None
    except OSError as error:  # ELOOP from symlink loops, EIO, ...
        raise ElfFileError(f"{path}: cannot open ({error.strerror or error})") from None
    try:
        magic = stream.read(4)
        if magic != ELF_MAGIC:
            raise ElfFileError(f"{path}: not an ELF file" if magic else f"{path}: empty file")
        stream.seek(0)
        return stream, ELFFile(stream)
    except ElfFileError:
        stream.close()
        raise
    except Exception as error:  # pyelftools raises many types on corrupt input
        stream.close()
        raise ElfFileError(f"{path}: corrupt or truncated ELF ({first_line(error, 160)})") from None


@contextlib.contextmanager
def _reading(path: str, problem: str) -> Iterator[tuple[BinaryIO, Any]]:
    """`path` opened with pyelftools, closed afterwards; whatever goes wrong while it is read
    (pyelftools raises many types on corrupt input) becomes one ElfFileError:
    "<path>: <problem> (<first line of the error>)"."""
    stream, elf = _open_elf(path)
    try:
        yield stream, elf
    except ElfFileError:
        raise
    except Exception as error:
        raise ElfFileError(f"{path}: {problem} ({first_line(error, 160)})") from None
    finally:
        stream.close()


def _iter_build_id_notes(elf: Any) -> Iterator[str]:
    # PT_NOTE first: a handful of program headers parse much faster than every section header
    # (pyelftools decodes each through `construct`); files without PT_NOTE (relocatable
    # objects) still name the note in a section.
    for segment in elf.iter_segments():
        if segment["p_type"] == "PT_NOTE":
            for note in segment.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                    yield str(note["n_desc"]).lower()
    for section in elf.iter_sections():
        if section["sh_type"] == "SHT_NOTE":
            for note in section.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                    yield str(note["n_desc"]).lower()


def _symbol_entry(elf: Any) -> struct.Struct:
    # Elf64_Sym: name, info, other, shndx, value, size; Elf32_Sym: name, value, size, info, other, shndx.
    endian = "<" if elf.little_endian else ">"
    return struct.Struct(endian + ("IBBHQQ" if elf.elfclass == 64 else "IIIBBH"))


def _has_function_symbols(stream: BinaryIO, elf: Any, section: Any) -> bool:
    """Whether a symbol table defines a function (read raw: pyelftools' per-symbol objects
    cost ~60 us each, and a table may have to be read to its end)."""
    if section is None or section["sh_type"] == "SHT_NOBITS" or section["sh_size"] == 0:
        return False
    entry = _symbol_entry(elf)
    is64 = elf.elfclass == 64
    try:
        stream.seek(section["sh_offset"])
        remaining = section["sh_size"] - section["sh_size"] % entry.size
        while remaining > 0:
            raw = stream.read(min(remaining, entry.size * 4096))
            if len(raw) < entry.size:
                return False  # truncated: as good as no table
            remaining -= len(raw)
            for fields in entry.iter_unpack(raw[: len(raw) - len(raw) % entry.size]):
                info, shndx = (fields[1], fields[3]) if is64 else (fields[3], fields[5])
                kind = info & 0xF
                if (kind == _STT_FUNC or kind == _STT_GNU_IFUNC) and shndx != 0:
                    return True
    except (OSError, ValueError):
        return False
    return False


def _has_dwarf(elf: Any) -> bool:
    for name in (".debug_info", ".zdebug_info"):
        section = elf.get_section_by_name(name)
        if section is not None and section["sh_type"] != "SHT_NOBITS" and section["sh_size"] > 0:
            return True
    return False


def _debuglink(elf: Any) -> tuple[str, int] | None:
    section = elf.get_section_by_name(".gnu_debuglink")
    if section is None or section["sh_type"] == "SHT_NOBITS":
        return None
    data = section.data()
    end = data.find(b"\0")
    if end <= 0:
        return None
    # The CRC follows the NUL-terminated name, padded to a 4-byte boundary.
    crc_at = (end + 4) & ~3
    if crc_at + 4 > len(data):
        return None
    fmt = "<I" if elf.little_endian else ">I"
    (crc,) = struct.unpack_from(fmt, data, crc_at)
    name = os.fsdecode(data[:end])
    if "/" in name or name in (".", ".."):
        return None  # a debuglink is a bare file name; anything else would escape the search dirs
    return name, crc


def inspect_elf(path: str) -> ElfFacts:
    """Build-ID, debug sections, symbol tables, debuglink and PT_LOAD segments of `path`."""
    with _reading(path, "corrupt or truncated ELF") as (stream, elf):
        st = os.fstat(stream.fileno())
        build_ids = list(_iter_build_id_notes(elf))
        segments = [
            (int(seg["p_vaddr"]), int(seg["p_memsz"]), int(seg["p_flags"]))
            for seg in elf.iter_segments()
            if seg["p_type"] == "PT_LOAD"
        ]
        return ElfFacts(
            path=path,
            build_id=build_ids[0] if build_ids else None,
            has_dwarf=_has_dwarf(elf),
            has_symtab=_has_function_symbols(stream, elf, elf.get_section_by_name(".symtab")),
            has_dynsym=_has_function_symbols(stream, elf, elf.get_section_by_name(".dynsym")),
            debuglink=_debuglink(elf),
            segments=segments,
            size=st.st_size,
            mtime_ns=st.st_mtime_ns,
            inode=st.st_ino,
            device=st.st_dev,
        )


def file_identity(path: str) -> tuple[str, int, int, int, int] | None:
    """(path, size, mtime_ns, inode, device) of a file, None when it cannot be stat'ed."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (path, info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)


def read_build_id(path: str) -> str | None:
    """Only the build-ID (None when the file has no note); `ElfFileError` on a bad file."""
    with _reading(path, "corrupt or truncated ELF") as (_stream, elf):
        return next(_iter_build_id_notes(elf), None)


def file_crc32(path: str) -> int:
    """CRC32 of the whole file, as `.gnu_debuglink` records it; `OSError` passes through."""
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------
# Symbol tables


class SymbolTable:
    """Function symbols of one file, for naming the outermost frame of an address (the extension
    searches `starts`/`ends` and asks `name` for the symbols it hits).

    Entries are read straight from the .symtab/.dynsym bytes (pyelftools locates the sections;
    decoding 10^5..10^6 symbols through its per-symbol objects would take seconds) into compact
    arrays; names are read from the file only when asked for (libtorch_cpu's .strtab alone is
    76 MB). Aliases at the same (start, size) collapse to one name: .symtab over .dynsym, and
    within a table the last one, which is the name llvm-symbolizer reports (binutils' choice
    depends on DWARF names too). In glibc that is e.g. `getaddrinfo`, not `__GI_getaddrinfo`.
    """

    def __init__(self, path: str, starts: array, ends: array, names: array, strtabs: list[tuple[int, int]]):
        self._path = path
        self._starts = starts
        self._ends = ends
        self._names = names  # name offset * 2 + table
        self._strtabs = strtabs  # (file offset, size) per table
        self._cache: dict[int, str] = {}
        self._stream: BinaryIO | None = None

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def starts(self) -> array:
        """Start address of each function symbol, ascending ('Q' array)."""
        return self._starts

    @property
    def ends(self) -> array:
        """End address (exclusive) of each function symbol ('Q' array)."""
        return self._ends

    def name(self, index: int) -> str:
        """Name of symbol `index` ("" when it cannot be read)."""
        return self._name(index)

    def _read_name(self, table: int, offset: int) -> str:
        base, size = self._strtabs[table]
        if self._stream is None:
            self._stream = open(self._path, "rb")
        chunk = b""
        position = base + offset
        limit = base + size
        while position < limit:
            piece = os.pread(self._stream.fileno(), min(256, limit - position), position)
            if not piece:
                break
            end = piece.find(b"\0")
            if end >= 0:
                chunk += piece[:end]
                break
            chunk += piece
            position += len(piece)
        return chunk.decode("utf-8", "replace")

    def _name(self, index: int) -> str:
        name = self._cache.get(index)
        if name is None:
            packed = self._names[index]
            try:
                name = self._read_name(packed & 1, packed >> 1)
            except OSError:
                name = ""
            self._cache[index] = name
        return name

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __del__(self) -> None:
        self.close()


def read_symbol_table(path: str) -> SymbolTable | None:
    """Function symbols from .symtab and .dynsym of `path`, or None when it has neither."""
    with _reading(path, "corrupt symbol table") as (stream, elf):
        return _read_symbol_table(path, stream, elf)


def _read_symbol_table(path: str, stream: BinaryIO, elf: Any) -> SymbolTable | None:
    is64 = elf.elfclass == 64
    entry = _symbol_entry(elf)
    # (start << 32 | size) -> name offset * 2 + table: ints, not tuples, to stay small for
    # libraries with half a million symbols.
    best: dict[int, int] = {}
    strtabs: list[tuple[int, int]] = []
    file_size = os.fstat(stream.fileno()).st_size
    for section_name in (".symtab", ".dynsym"):
        section = elf.get_section_by_name(section_name)
        if section is None or section["sh_type"] == "SHT_NOBITS" or section["sh_size"] == 0:
            continue
        link = elf.get_section(section["sh_link"])
        if link is None or link["sh_type"] == "SHT_NOBITS":
            continue
        if section["sh_offset"] + section["sh_size"] > file_size or link["sh_offset"] + link["sh_size"] > file_size:
            raise ValueError(f"{section_name} extends past the end of the file")
        table = len(strtabs)
        strtabs.append((link["sh_offset"], link["sh_size"]))
        stream.seek(section["sh_offset"])
        raw = stream.read(section["sh_size"] - section["sh_size"] % entry.size)
        for fields in entry.iter_unpack(raw):
            if is64:
                name, info, _other, shndx, value, size = fields
            else:
                name, value, size, info, _other, shndx = fields
            kind = info & 0xF
            if (kind != _STT_FUNC and kind != _STT_GNU_IFUNC) or shndx == 0 or size == 0 or name == 0:
                continue
            key = (value << 32) | (size & 0xFFFFFFFF)
            previous = best.get(key)
            if previous is None or previous & 1 == table:
                best[key] = (name << 1) | table
        del raw
    if not best:
        return None
    keys = sorted(best)
    starts = array("Q", [key >> 32 for key in keys])
    ends = array("Q", [(key >> 32) + (key & 0xFFFFFFFF) for key in keys])
    names = array("Q", [best[key] for key in keys])
    return SymbolTable(path, starts, ends, names, strtabs)


# --------------------------------------------------------------------------------------------
# DWARF sections for the line-table fallback


_DWARF_SECTIONS = (
    ".debug_info",
    ".debug_abbrev",
    ".debug_str",
    ".debug_line",
    ".debug_line_str",
    ".debug_aranges",
    ".debug_ranges",
    ".debug_rnglists",
    ".debug_addr",
    ".debug_str_offsets",
)


def _section_bytes(stream: BinaryIO, elf: Any, section: Any) -> bytes:
    stream.seek(section["sh_offset"])
    raw = stream.read(section["sh_size"])
    if len(raw) != section["sh_size"]:
        raise ValueError(f"section {section.name} is truncated")
    if section["sh_flags"] & _SHF_COMPRESSED:
        endian = "<" if elf.little_endian else ">"
        if elf.elfclass == 64:
            ch_type, _reserved, ch_size, _align = struct.unpack_from(endian + "IIQQ", raw)
            payload = raw[24:]
        else:
            ch_type, ch_size, _align = struct.unpack_from(endian + "III", raw)
            payload = raw[12:]
        if ch_type == _ELFCOMPRESS_ZLIB:
            data = zlib.decompress(payload)
        elif ch_type == _ELFCOMPRESS_ZSTD:
            import zstandard

            data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=ch_size)
        else:
            raise ValueError(f"section {section.name}: unknown compression type {ch_type}")
        if len(data) != ch_size:
            raise ValueError(f"section {section.name}: decompressed to {len(data)} bytes, header says {ch_size}")
        return data
    if section.name.startswith(".zdebug") and raw[:4] == b"ZLIB":
        return zlib.decompress(raw[12:])  # legacy GNU compression: "ZLIB" + 8-byte big-endian size
    return raw


def _section_data(stream: BinaryIO, elf: Any, name: str) -> bytes | None:
    """A section's bytes by name (or its legacy .zdebug twin), decompressed; None when the file
    has no such section or only a NOBITS placeholder (a stripped file's debug sections)."""
    section = elf.get_section_by_name(name) or elf.get_section_by_name(".z" + name[1:])
    if section is None or section["sh_type"] == "SHT_NOBITS":
        return None
    return _section_bytes(stream, elf, section)


def read_section(path: str, name: str) -> bytes | None:
    """One section's bytes, decompressed; None when the file has no such section (or NOBITS)."""
    return read_sections(path, (name,))[0][name]


def read_sections(path: str, names: Iterable[str]) -> tuple[dict[str, bytes | None], bool]:
    """Sections by name, decompressed (None for those the file lacks or has as NOBITS), and
    whether the file is little-endian."""
    found: dict[str, bytes | None] = {}
    with _reading(path, "unreadable section") as (stream, elf):
        for name in names:
            try:
                found[name] = _section_data(stream, elf, name)
            except Exception as error:
                raise ElfFileError(f"{path}: unreadable section {name} ({first_line(error, 160)})") from None
        return found, elf.little_endian


def load_dwarf(path: str) -> Any:
    """A pyelftools DWARFInfo over the line-table-related sections, decompressed (zlib or zstd).

    pyelftools itself reads zlib-compressed sections but not zstd ones (binutils >= 2.40 and
    recent distributions write zstd), so the sections are read and decompressed here.
    """
    import inspect  # ~9 ms to import: only this rarely used path needs it

    from elftools.dwarf.dwarfinfo import DebugSectionDescriptor, DwarfConfig, DWARFInfo

    with _reading(path, "unreadable DWARF") as (stream, elf):
        sections: dict[str, Any] = {}
        for name in _DWARF_SECTIONS:
            data = _section_data(stream, elf, name)
            sections[name] = (
                None
                if data is None
                else DebugSectionDescriptor(
                    stream=io.BytesIO(data), name=name, global_offset=0, size=len(data), address=0
                )
            )
        if sections[".debug_info"] is None or sections[".debug_line"] is None:
            raise ElfFileError(f"{path}: no DWARF line tables")
        arguments = {
            "debug_info_sec": sections[".debug_info"],
            "debug_aranges_sec": sections[".debug_aranges"],
            "debug_abbrev_sec": sections[".debug_abbrev"],
            "debug_str_sec": sections[".debug_str"],
            "debug_ranges_sec": sections[".debug_ranges"],
            "debug_line_sec": sections[".debug_line"],
            "debug_addr_sec": sections[".debug_addr"],
            "debug_str_offsets_sec": sections[".debug_str_offsets"],
            "debug_line_str_sec": sections[".debug_line_str"],
            "debug_rnglists_sec": sections[".debug_rnglists"],
        }
        # The constructor grew parameters across pyelftools releases; pass None for the
        # sections this reader never needs, whatever this release calls them.
        for name in inspect.signature(DWARFInfo.__init__).parameters:
            if name.endswith("_sec"):
                arguments.setdefault(name, None)
        config = DwarfConfig(
            little_endian=elf.little_endian,
            default_address_size=elf.elfclass // 8,
            machine_arch=elf.get_machine_arch(),
        )
        return DWARFInfo(config=config, **arguments)


def executable_ranges(segments: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(start, end) of the executable PT_LOAD segments."""
    return [(vaddr, vaddr + memsz) for vaddr, memsz, flags in segments if flags & _PF_X]
