"""Finding debug info by build-ID, every way it can be laid out, and every way it can be wrong.

A file whose build-ID (or debuglink CRC) does not match must never be used; broken files,
symlink loops, missing modules, garbage build-IDs and addresses outside the module end in an
unsymbolized frame with its reason, never in an exception or a wrong answer.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from symbols_data.testlib import (
    DATA,
    LIBPYTHON,
    function_addresses,
    have_tools,
    llvm_chains,
    our_chains,
    run,
    stripped_with_debuglink,
)

from tbpipe.pipeline.symbols import DebugDirIndex, ModuleRef, Quality, Symbolizer
from tbpipe.pipeline.symbols.elf import read_section
from tbpipe.pipeline.symbols.lines import line_index, read_aranges

_MISSING = have_tools("llvm-symbolizer", "gcc", "objcopy", "strip")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)


@pytest.fixture(scope="session")
def reference(libs):
    """llvm-symbolizer's chains for every function address of the unstripped C library."""
    addresses = function_addresses(libs.c_lib)
    return addresses, llvm_chains(libs.c_lib, addresses)


def symbolizer_for(tmp_path, **kwargs) -> Symbolizer:
    kwargs.setdefault("debug_roots", [])
    return Symbolizer(cache_dir=tmp_path / "store", jobs=1, **kwargs)


def assert_full_dwarf(symbolizer: Symbolizer, module, libs, reference, via: str) -> None:
    addresses, expected = reference
    ref = ModuleRef(libs.c_build_id, str(module))
    status = symbolizer.module_status(libs.c_build_id, str(module))
    assert status.quality is Quality.DWARF, status.describe()
    assert status.found_via == via, status.describe()
    assert our_chains(symbolizer.symbolize_module(ref, addresses)) == expected


# ---------------------------------------------------------------- each place, in isolation


def test_debuglink_beside_the_module(libs, reference, tmp_path):
    module = stripped_with_debuglink(libs, tmp_path / "lib")
    shutil.copy(libs.c_debug, tmp_path / "lib" / "libtbinline.debug")
    assert_full_dwarf(symbolizer_for(tmp_path), module, libs, reference, "debuglink")


def test_debuglink_in_dot_debug(libs, reference, tmp_path):
    module = stripped_with_debuglink(libs, tmp_path / "lib")
    (tmp_path / "lib" / ".debug").mkdir()
    shutil.copy(libs.c_debug, tmp_path / "lib" / ".debug" / "libtbinline.debug")
    assert_full_dwarf(symbolizer_for(tmp_path), module, libs, reference, "debuglink")


def test_debuglink_under_a_debug_root(libs, reference, tmp_path):
    module = stripped_with_debuglink(libs, tmp_path / "lib")
    mirrored = tmp_path / "root" / str(tmp_path / "lib").lstrip("/")
    mirrored.mkdir(parents=True)
    shutil.copy(libs.c_debug, mirrored / "libtbinline.debug")
    symbolizer = symbolizer_for(tmp_path, debug_roots=[tmp_path / "root"])
    assert_full_dwarf(symbolizer, module, libs, reference, "debuglink")


def test_build_id_tree_under_a_debug_root(libs, reference, tmp_path):
    target = tmp_path / "root" / ".build-id" / libs.c_build_id[:2] / f"{libs.c_build_id[2:]}.debug"
    target.parent.mkdir(parents=True)
    shutil.copy(libs.c_debug, target)
    symbolizer = symbolizer_for(tmp_path, debug_roots=[tmp_path / "root"])
    assert_full_dwarf(symbolizer, libs.c_stripped, libs, reference, "build-id-dir")


def test_debuginfod_client_cache(libs, reference, tmp_path, monkeypatch):
    cache = tmp_path / "debuginfod"
    (cache / libs.c_build_id).mkdir(parents=True)
    shutil.copy(libs.c_debug, cache / libs.c_build_id / "debuginfo")
    monkeypatch.setenv("DEBUGINFOD_CACHE_PATH", str(cache))
    assert_full_dwarf(symbolizer_for(tmp_path), libs.c_stripped, libs, reference, "debuginfod-cache")


def test_debuginfod_cache_under_xdg_cache_home(libs, reference, tmp_path, monkeypatch):
    monkeypatch.delenv("DEBUGINFOD_CACHE_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    target = tmp_path / "xdg" / "debuginfod_client" / libs.c_build_id / "debuginfo"
    target.parent.mkdir(parents=True)
    shutil.copy(libs.c_debug, target)
    assert_full_dwarf(symbolizer_for(tmp_path), libs.c_stripped, libs, reference, "debuginfod-cache")


def test_debug_dir_indexed_recursively_with_broken_entries(libs, reference, tmp_path):
    debug_dir = tmp_path / "debug"
    nested = debug_dir / "a" / "b"
    nested.mkdir(parents=True)
    shutil.copy(libs.c_debug, nested / "renamed-anything.dbg")
    # What the walk must survive: a symlink loop, a dangling link, non-ELF and truncated ELF
    # files, and a debug file of another build (never to be used).
    os.symlink(debug_dir, debug_dir / "a" / "loop")
    os.symlink(tmp_path / "nowhere", debug_dir / "dangling")
    (debug_dir / "notes.txt").write_text("not an ELF file")
    (debug_dir / "truncated.debug").write_bytes(libs.c_debug.read_bytes()[:200])
    shutil.copy(libs.other_debug, debug_dir / "other.debug")
    symbolizer = symbolizer_for(tmp_path, debug_dirs=[debug_dir])
    assert_full_dwarf(symbolizer, libs.c_stripped, libs, reference, "debug-dir")
    report = symbolizer.locator.indexes()[0].report
    assert any("loop" in problem for problem in report.problems)
    assert any("truncated" in problem for problem in report.problems)

    # The index is kept: a second scan reads no file again, until one changes.
    index = DebugDirIndex(str(debug_dir), symbolizer.store.debug_dir_index_path(str(debug_dir)))
    assert len(index.lookup(libs.c_build_id)) == 1
    assert index.refresh().opened == 0
    shutil.copy(libs.c_debug, debug_dir / "second-copy.debug")
    assert index.refresh().opened == 1
    assert len(index.lookup(libs.c_build_id)) == 2


def test_debuglink_target_without_a_build_id_note_is_accepted_on_its_crc(libs, reference, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    debug = lib / "nobuildid.debug"
    run("objcopy", "--remove-section=.note.gnu.build-id", libs.c_debug, debug)
    module = lib / "libtbinline.so"
    run("objcopy", f"--add-gnu-debuglink={debug}", libs.c_stripped, module)
    assert_full_dwarf(symbolizer_for(tmp_path), module, libs, reference, "debuglink")
    # The same file is not enough where only the build-ID vouches for it.
    target = tmp_path / "root" / ".build-id" / libs.c_build_id[:2] / f"{libs.c_build_id[2:]}.debug"
    target.parent.mkdir(parents=True)
    shutil.copy(debug, target)
    status = symbolizer_for(tmp_path / "other", debug_roots=[tmp_path / "root"]).module_status(
        libs.c_build_id, str(libs.c_stripped)
    )
    assert status.quality is Quality.SYMBOLS
    assert any("has no build-ID note" in place for place in status.looked_in)


def test_debug_dir_comes_first(libs, tmp_path):
    (tmp_path / "debug").mkdir()
    shutil.copy(libs.c_debug, tmp_path / "debug" / "x.debug")
    module = stripped_with_debuglink(libs, tmp_path / "lib")
    shutil.copy(libs.c_debug, tmp_path / "lib" / "libtbinline.debug")
    symbolizer = symbolizer_for(tmp_path, debug_dirs=[tmp_path / "debug"])
    assert symbolizer.module_status(libs.c_build_id, str(module)).found_via == "debug-dir"


def test_unstripped_module_is_its_own_debug_file(libs, reference, tmp_path):
    assert_full_dwarf(symbolizer_for(tmp_path), libs.c_lib, libs, reference, "module")


def test_module_without_build_id(tmp_path):
    module = tmp_path / "libnobuildid.so"
    run("gcc", "-O2", "-g", "-shared", "-fPIC", "-Wl,--build-id=none", f"-I{DATA}", "-o", module, DATA / "inlines.c")
    addresses = function_addresses(module)
    results = symbolizer_for(tmp_path).symbolize_module(ModuleRef("", str(module)), addresses)
    assert our_chains(results) == llvm_chains(module, addresses)


# ---------------------------------------------------------------- wrong files are never used


def test_build_id_mismatch_is_never_used(libs, tmp_path):
    # The other build's debug file sits exactly where this build-ID's file should be.
    target = tmp_path / "root" / ".build-id" / libs.c_build_id[:2] / f"{libs.c_build_id[2:]}.debug"
    target.parent.mkdir(parents=True)
    shutil.copy(libs.other_debug, target)
    symbolizer = symbolizer_for(tmp_path, debug_roots=[tmp_path / "root"])
    status = symbolizer.module_status(libs.c_build_id, str(libs.c_stripped))
    assert status.quality is Quality.SYMBOLS, status.describe()
    assert any("build-ID mismatch" in place for place in status.looked_in)
    frames = symbolizer.symbolize_module(
        ModuleRef(libs.c_build_id, str(libs.c_stripped)), function_addresses(libs.c_lib)
    )
    # .dynsym still names the exported functions, but no file or line can come from anywhere.
    assert all(f.file is None and f.line is None for chain in frames for f in chain)
    assert any(chain[0].function == "tb_outer" for chain in frames)
    assert all(chain[0].reason for chain in frames)


def test_debuglink_crc_mismatch_is_never_used(libs, tmp_path):
    module = stripped_with_debuglink(libs, tmp_path / "lib")
    shutil.copy(libs.other_debug, tmp_path / "lib" / "libtbinline.debug")
    status = symbolizer_for(tmp_path).module_status(libs.c_build_id, str(module))
    assert status.quality is Quality.SYMBOLS
    assert any("CRC32" in place for place in status.looked_in), status.looked_in


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "directory"])
def test_damaged_debug_file_is_skipped_with_a_reason(libs, tmp_path, damage):
    target = tmp_path / "root" / ".build-id" / libs.c_build_id[:2] / f"{libs.c_build_id[2:]}.debug"
    target.parent.mkdir(parents=True)
    data = libs.c_debug.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 3])
    elif damage == "garbage":
        target.write_bytes(b"\x7fELF" + os.urandom(4096))
    elif damage == "empty":
        target.write_bytes(b"")
    else:
        target.mkdir()
    symbolizer = symbolizer_for(tmp_path, debug_roots=[tmp_path / "root"])
    status = symbolizer.module_status(libs.c_build_id, str(libs.c_stripped))
    assert status.quality is Quality.SYMBOLS, status.describe()
    assert any(str(target) in place for place in status.looked_in)
    frames = symbolizer.symbolize_module(
        ModuleRef(libs.c_build_id, str(libs.c_stripped)), function_addresses(libs.c_lib)[:5]
    )
    assert all(chain[0].line is None for chain in frames)


def test_symlink_loop_in_place_of_the_debug_file(libs, tmp_path):
    target = tmp_path / "root" / ".build-id" / libs.c_build_id[:2] / f"{libs.c_build_id[2:]}.debug"
    target.parent.mkdir(parents=True)
    os.symlink(target, target)
    status = symbolizer_for(tmp_path, debug_roots=[tmp_path / "root"]).module_status(
        libs.c_build_id, str(libs.c_stripped)
    )
    assert status.quality is Quality.SYMBOLS
    assert any(str(target) in place for place in status.looked_in)


@pytest.mark.parametrize("kind", ["missing", "truncated", "not-elf"])
def test_bad_module_file_gives_unsymbolized_frames(libs, tmp_path, kind):
    module = tmp_path / "libbroken.so"
    if kind == "truncated":
        module.write_bytes(libs.c_stripped.read_bytes()[:100])
    elif kind == "not-elf":
        module.write_text("#!/bin/sh\n")
    build_id = "ab" * 20
    symbolizer = symbolizer_for(tmp_path)
    (frames,) = symbolizer.symbolize_module(ModuleRef(build_id, str(module)), [0x1000])
    assert frames[0].function is None
    assert "no debug info for build-ID abababababab" in frames[0].reason
    assert str(module) in frames[0].reason


def test_garbage_build_id(tmp_path):
    symbolizer = symbolizer_for(tmp_path)
    for garbage in ["xyz", "", "abc", "ab" * 100, "0x"]:
        ref = ModuleRef(garbage, None)
        (frames,) = symbolizer.symbolize_module(ref, [0x1234])
        assert frames[0].function is None and frames[0].reason, garbage
    assert symbolizer.module_status("not hex").quality is Quality.NONE
    assert "invalid build-ID" in symbolizer.module_status("not hex").reason


def test_address_outside_every_segment(libs, tmp_path):
    symbolizer = symbolizer_for(tmp_path)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    inside = function_addresses(libs.c_lib)[0]
    (outside, good) = symbolizer.symbolize_module(ref, [0x7FFF_FFFF_0000, inside])
    assert outside[0].function is None and "outside every executable segment" in outside[0].reason
    assert good[0].function is not None
    (zero_return,) = symbolizer.symbolize_module(ref, [0], [False])
    assert zero_return[0].function is None and "invalid address" in zero_return[0].reason


def test_no_debug_info_anywhere(libs, tmp_path):
    module = tmp_path / "lib" / "libtbinline.so"
    module.parent.mkdir()
    run("strip", "--strip-all", "-o", module, libs.c_lib)
    unknown = "cd" * 20  # a build-ID nobody has: the module file does not match it either
    symbolizer = symbolizer_for(tmp_path)
    status = symbolizer.module_status(unknown, str(module))
    assert status.quality is Quality.NONE
    assert "no debug info for build-ID cdcdcdcdcdcd" in status.reason
    assert "build-ID mismatch" in status.reason


# ---------------------------------------------------------------- better debug info later


def test_better_debug_info_appearing_later_upgrades_the_store(libs, reference, tmp_path):
    addresses, expected = reference
    ref = ModuleRef(libs.c_build_id, str(libs.c_stripped))
    first = symbolizer_for(tmp_path)
    before = first.symbolize_module(ref, addresses)
    assert first.module_status(libs.c_build_id).quality is Quality.SYMBOLS
    assert all(f.line is None for chain in before for f in chain)

    (tmp_path / "debug").mkdir()
    shutil.copy(libs.c_debug, tmp_path / "debug" / "late.debug")
    later = symbolizer_for(tmp_path, debug_dirs=[tmp_path / "debug"])
    after = later.symbolize_module(ref, addresses)
    status = later.module_status(libs.c_build_id)
    assert status.quality is Quality.DWARF and status.upgraded_from is Quality.SYMBOLS
    assert later.upgraded_build_ids() == {libs.c_build_id}
    assert our_chains(after) == expected

    # Once DWARF is in the store, losing the debug file does not make results worse.
    shutil.rmtree(tmp_path / "debug")
    again = symbolizer_for(tmp_path)
    assert our_chains(again.symbolize_module(ref, addresses)) == expected
    assert again.upgraded_build_ids() == set()


# ---------------------------------------------------------------- the DWARF readers themselves


def test_aranges_reader_matches_pyelftools(libs):
    from elftools.elf.elffile import ELFFile

    for path in [libs.c_lib, libs.c_zlib, libs.cxx_lib]:
        mine = sorted(read_aranges(read_section(str(path), ".debug_aranges")))
        with open(path, "rb") as stream:
            entries = ELFFile(stream).get_dwarf_info().get_aranges().entries
            theirs = sorted((e.begin_addr, e.begin_addr + e.length, e.info_offset) for e in entries if e.length)
        assert mine == theirs


def _pyelftools_rows(path: str, max_units: int | None = None, include_zero: bool = False) -> tuple[list, list]:
    """(unit file names per unit, [(address, file index, line)] of the last row at each address
    of every sequence), as pyelftools decodes the line programs."""
    from elftools.elf.elffile import ELFFile

    files_by_unit, rows = [], []
    with open(path, "rb") as stream:
        dwarf = ELFFile(stream).get_dwarf_info()
        for number, cu in enumerate(dwarf.iter_CUs()):
            if max_units is not None and number >= max_units:
                break
            program = dwarf.line_program_for_CU(cu)
            files_by_unit.append([entry.name.decode() for entry in program.header["file_entry"]])
            sequence: dict[int, tuple[int, int]] = {}
            for entry in program.get_entries():
                state = entry.state
                if state is None:
                    continue
                if state.end_sequence:
                    # Sequences of discarded code sit at 0; a row at the end address covers nothing.
                    if sequence and (include_zero or min(sequence) > 0):
                        rows.extend((a, file, line) for a, (file, line) in sequence.items() if a < state.address)
                    sequence = {}
                else:
                    sequence[state.address] = (state.file, state.line)
    return files_by_unit, rows


@pytest.mark.parametrize("which", ["c_lib", "cxx_lib", "c_zlib", "libpython"])
def test_line_table_index_matches_pyelftools(libs, which):

    if which == "libpython":
        if not LIBPYTHON.exists():
            pytest.skip("no pyenv CPython 3.11.7 libpython (the oracle tests need it too)")
        path = str(LIBPYTHON)  # DWARF 5, a real library: its first units (pyelftools is slow)
        files_by_unit, rows = _pyelftools_rows(path, max_units=6)
    else:
        path = str(getattr(libs, which))
        files_by_unit, rows = _pyelftools_rows(path)
    index = line_index(path)
    assert index.problem == ""
    assert rows and index.sequence_count > 0
    for unit, names in enumerate(files_by_unit):
        assert [name for name, _directory in index.unit(unit)[3]] == names
    wrong = []
    for address, file, line in rows:
        found = index.row(address)
        if found is None or found[1:] != (file, line):
            wrong.append((hex(address), found, (file, line)))
    assert not wrong[:10], f"{len(wrong)} of {len(rows)} rows differ"


def test_line_table_index_survives_damage(libs):
    """Truncated or garbled .debug_line: no crash, a reason, and what is intact still answers."""
    import random

    from tbpipe import _native
    from tbpipe.pipeline.symbols.elf import read_sections

    sections, little = read_sections(str(libs.c_lib), (".debug_line", ".debug_line_str", ".debug_str"))
    data = sections[".debug_line"]
    strings = (sections[".debug_line_str"] or b"", sections[".debug_str"] or b"")
    whole = _native.LineTable(data, *strings, little)
    whole.build()
    # The undamaged section answers as pyelftools decodes it: the baseline the damage is measured by.
    _files, rows = _pyelftools_rows(str(libs.c_lib))
    assert whole.problem == "" and rows
    assert [whole.row(address)[1:] for address, _file, _line in rows] == [(file, line) for _a, file, line in rows]
    answers = {probe: whole.row(probe) for probe in range(0, max(address for address, _f, _l in rows) + 0x100)}
    for cut in (1, 5, 11, len(data) // 3, len(data) - 1):
        damaged = _native.LineTable(data[:cut], *strings, little)
        damaged.build()
        assert damaged.problem, cut
        # The whole unit, then a truncated copy of it: the intact unit still answers, as before.
        partly = _native.LineTable(data + data[:cut], *strings, little)
        partly.build()
        assert f"unit at {len(data)}" in partly.problem, (cut, partly.problem)
        assert {probe: partly.row(probe) for probe in answers} == answers, cut
    generator = random.Random(7)
    for _ in range(300):
        garbled = bytearray(data)
        for _flip in range(generator.randint(1, 8)):
            garbled[generator.randrange(len(garbled))] = generator.randrange(256)
        table = _native.LineTable(bytes(garbled), *strings, little)
        table.build()
        for probe in range(0, 0x4000, 97):
            table.row(probe)  # any answer or None: it must not crash


def test_line_table_ignores_code_the_linker_discarded(tmp_path):
    """--gc-sections leaves the discarded function's line program at address 0: it must not answer
    for the low addresses of the linked module."""

    source = tmp_path / "gc.c"
    source.write_text(
        '__attribute__((visibility("hidden"))) int tb_discarded(int x) {\n'
        "  int total = 0;\n"
        "  for (int i = 0; i < x; ++i) total += i * x;\n"
        "  return total;\n"
        "}\n"
        "int tb_kept(int x) { return x * 3 + 1; }\n"
    )
    library = tmp_path / "libgc.so"
    run("gcc", "-O1", "-g", "-shared", "-fPIC", "-ffunction-sections", "-Wl,--gc-sections", "-o", library, source)
    _files, rows = _pyelftools_rows(str(library), include_zero=True)
    assert any(address < 0x10 for address, _file, _line in rows), "no discarded sequence at 0: nothing tested"
    index = line_index(str(library))
    assert all(index.row(address) is None for address in range(0, 0x20))
    kept = [(address, line) for address, _file, line in rows if address >= 0x1000]
    assert kept and all(index.row(address)[2] == line for address, line in kept)


def test_line_table_refuses_impossible_entry_counts():
    """A DWARF 5 header that claims 2**62 directories described by no formats: refused at once
    (reading it naively would grow a table forever without consuming a byte)."""
    import struct

    from tbpipe import _native

    after_length = bytearray()
    after_length += struct.pack("<HBB", 5, 8, 0)  # version, address size, segment selector size
    header = bytearray()
    header += bytes([1, 1, 1, (-5) & 0xFF, 14, 13])  # min length, max ops, is_stmt, line base/range, opcode base
    header += bytes([0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1])  # standard opcode lengths
    header += bytes([0]) + bytes([0x80] * 8 + [0x40])  # directory formats: none; count: 2**62
    header += bytes([0, 0])  # file formats: none; count: 0
    after_length += struct.pack("<I", len(header)) + header
    unit = struct.pack("<I", len(after_length)) + bytes(after_length)
    table = _native.LineTable(unit, b"", b"", True)
    table.build()
    assert "impossible" in table.problem
    assert table.sequence_count == 0 and table.row(0x1000) is None


def test_objcopy_zstd_support_is_reported(libs):
    # Not a skip: the note says whether the zstd test above really ran here.
    if libs.c_zstd is None:
        pytest.skip(libs.zstd_problem)
    out = subprocess.run(["readelf", "-S", "-W", str(libs.c_zstd)], capture_output=True, text=True).stdout
    assert ".debug_info" in out


def test_what_the_search_read_is_remembered_while_files_are_unchanged(libs, reference, tmp_path, monkeypatch):
    """The search runs again for a module without DWARF at every ingest; what it read of each ELF file
    (sections, build-ID, a debuglink target's CRC) comes from the store until the file changes."""
    from tbpipe.pipeline.symbols import debuginfo

    module = stripped_with_debuglink(libs, tmp_path / "lib")
    debug_file = tmp_path / "lib" / "libtbinline.debug"
    shutil.copy(libs.other_debug, debug_file)  # the wrong file: its CRC does not match
    reads: list[str] = []
    inspect, crc = debuginfo.inspect_elf, debuginfo.file_crc32
    monkeypatch.setattr(debuginfo, "inspect_elf", lambda path: reads.append(path) or inspect(path))
    monkeypatch.setattr(debuginfo, "file_crc32", lambda path: reads.append(f"crc {path}") or crc(path))

    def status_now():
        reads.clear()
        return symbolizer_for(tmp_path).module_status(libs.c_build_id, str(module))

    assert status_now().quality is Quality.SYMBOLS
    assert str(module) in reads and f"crc {debug_file}" in reads
    second = status_now()  # a new process: the store's status says symbols only, so it looks again
    assert second.quality is Quality.SYMBOLS and any("CRC32" in place for place in second.looked_in)
    assert reads == []
    shutil.copy(libs.c_debug, debug_file)  # the right debug file now, at the same path
    assert_full_dwarf(symbolizer_for(tmp_path), module, libs, reference, "debuglink")
    assert status_now().quality is Quality.DWARF
