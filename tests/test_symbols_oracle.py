"""Symbolization against llvm-symbolizer as the oracle, on real binaries.

glibc (stripped libc.so.6, DWARF from /usr/lib/debug/.build-id), libpython 3.11 (DWARF 5) and
libraries built here with -O2 -g (inline chains, header-inlined code, a .cold split, C++),
also with zlib- and zstd-compressed debug sections. Inline chains, files and lines must agree
on >= 99.9% of random addresses (the full measurement, 100k addresses, is bench/symbolize.py).
"""

from __future__ import annotations

import os

import pytest
from symbols_data.testlib import (
    DATA,
    LIBC,
    LIBPYTHON,
    agreement,
    function_addresses,
    have_tools,
    llvm_chains,
    our_chains,
    random_code_addresses,
)
from symbols_data.testlib import run as run_tool

from tbpipe.pipeline.symbols import ModuleRef, Quality, Symbolizer
from tbpipe.pipeline.symbols import demangle as demangling
from tbpipe.pipeline.symbols.elf import executable_ranges, inspect_elf, read_build_id

_MISSING = have_tools("llvm-symbolizer", "gcc", "g++", "objcopy", "strip")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)


def fresh_symbolizer(tmp_path, **kwargs) -> Symbolizer:
    kwargs.setdefault("debug_roots", [])
    return Symbolizer(cache_dir=tmp_path / "store", jobs=1, **kwargs)


def test_test_library_matches_llvm_everywhere(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)
    symbolizer = fresh_symbolizer(tmp_path)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    results = symbolizer.symbolize_module(ref, addresses)
    share, different = agreement(llvm_chains(libs.c_lib, addresses), our_chains(results))
    assert share == 1.0, different[:3]
    # The library really has what the test is about: a 3-deep chain, header code, a .cold part.
    functions = {f.function for frames in results for f in frames}
    assert {"tb_mix", "tb_leaf", "tb_middle", "tb_outer", "tb_second"} <= functions
    assert any(f.file.endswith("mix.h") for frames in results for f in frames if f.file)
    assert max(len(frames) for frames in results) >= 3
    assert symbolizer.module_status(libs.c_build_id).quality is Quality.DWARF


@pytest.mark.parametrize(
    "flags", [["-gdwarf-4"], ["-gdwarf-5", "-ffunction-sections"], ["-gdwarf-4", "-gno-as-loc-support"]]
)
def test_other_dwarf_layouts(tmp_path, flags):
    """DWARF 4 file tables (1-based, no directory 0), one line sequence per function, and line
    tables written by GCC itself instead of the assembler."""
    module = tmp_path / "libvariant.so"
    run_tool(
        "gcc",
        "-O2",
        "-g",
        *flags,
        "-shared",
        "-fPIC",
        "-Wl,--build-id=sha1",
        f"-I{DATA}",
        "-o",
        module,
        DATA / "inlines.c",
    )
    # Every byte of the executable segment: padding between functions and PLT stubs too.
    addresses = sorted(
        {a for start, end in executable_ranges(inspect_elf(str(module)).segments) for a in range(start, end)}
    )
    ref = ModuleRef(read_build_id(str(module)), str(module))
    results = fresh_symbolizer(tmp_path).symbolize_module(ref, addresses)
    share, different = agreement(llvm_chains(module, addresses), our_chains(results))
    assert share == 1.0, different[:3]


@pytest.mark.parametrize("compression", ["zlib", "zstd"])
def test_compressed_debug_sections(libs, tmp_path, compression):
    module = libs.c_zlib if compression == "zlib" else libs.c_zstd
    if module is None:
        pytest.skip(libs.zstd_problem)
    addresses = function_addresses(libs.c_lib)
    results = fresh_symbolizer(tmp_path).symbolize_module(ModuleRef(libs.c_build_id, str(module)), addresses)
    # llvm-symbolizer 14 cannot read zstd sections: the oracle reads the uncompressed library.
    share, different = agreement(llvm_chains(libs.c_lib, addresses), our_chains(results))
    assert share == 1.0, different[:3]


def test_cpp_names_match_llvm_and_are_demangled(libs, tmp_path):
    addresses = function_addresses(libs.cxx_lib)
    symbolizer = fresh_symbolizer(tmp_path)
    ref = ModuleRef(libs.cxx_build_id, str(libs.cxx_lib))
    # Mangled against mangled: llvm 14's demangler gives up on some libstdc++ names that
    # __cxa_demangle handles, so the chains are compared before demangling.
    raw = symbolizer.symbolize_module(ref, addresses, demangle=False)
    share, different = agreement(llvm_chains(libs.cxx_lib, addresses, demangle=False), our_chains(raw))
    assert share == 1.0, different[:3]
    assert demangling.available(), "tbpipe._native does not import: names stay mangled"
    names = {f.function for frames in symbolizer.symbolize_module(ref, addresses) for f in frames}
    assert "tbx::entry(std::vector<long, std::allocator<long> > const&, int)" in names
    assert "tbx::Accumulator<long>::add(long)" in names
    assert not any(name and name.startswith("_Z") for name in names)


def test_return_addresses_are_looked_up_one_byte_earlier(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)[1:]
    symbolizer = fresh_symbolizer(tmp_path)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    as_return = symbolizer.symbolize_module(ref, addresses, [False] * len(addresses))
    at_call = symbolizer.symbolize_module(ref, [a - 1 for a in addresses], [True] * len(addresses))
    assert as_return == at_call
    mixed = symbolizer.symbolize_module(ref, addresses[:2], [True, False])
    assert mixed == [symbolizer.symbolize_module(ref, addresses[:1])[0], at_call[1]]


@pytest.mark.skipif(not LIBC.exists(), reason="no /lib/x86_64-linux-gnu/libc.so.6")
def test_glibc_through_its_build_id_debug_file(tmp_path):
    build_id = read_build_id(str(LIBC))
    debug_file = f"/usr/lib/debug/.build-id/{build_id[:2]}/{build_id[2:]}.debug"
    if not os.path.exists(debug_file):
        pytest.skip("libc6-dbg is not installed")
    symbolizer = Symbolizer(cache_dir=tmp_path / "store", jobs=1)
    ref = ModuleRef(build_id, str(LIBC))
    status = symbolizer.module_status(build_id, str(LIBC))
    assert status.quality is Quality.DWARF and status.found_via == "build-id-dir" and status.debug_file == debug_file
    addresses = random_code_addresses(LIBC, 3000, seed=11)
    results = symbolizer.symbolize_module(ref, addresses)
    share, different = agreement(llvm_chains(debug_file, addresses), our_chains(results))
    assert share >= 0.999, different[:5]


@pytest.mark.skipif(not LIBPYTHON.exists(), reason="no pyenv CPython 3.11.7 libpython")
def test_libpython_dwarf5_including_functions_without_a_dwarf_entry(tmp_path):
    symbolizer = Symbolizer(cache_dir=tmp_path / "store", jobs=1, debug_roots=[])
    build_id = read_build_id(str(LIBPYTHON))
    ref = ModuleRef(build_id, str(LIBPYTHON))
    addresses = random_code_addresses(LIBPYTHON, 3000, seed=12)
    results = symbolizer.symbolize_module(ref, addresses)
    expected = llvm_chains(LIBPYTHON, addresses)
    share, different = agreement(expected, our_chains(results))
    assert share >= 0.999, different[:5]
    # PyObject_Call has no DW_TAG_subprogram (SymCache alone gives it no line); its file:line
    # must come from the line table, as llvm-symbolizer reports it.
    from tbpipe.pipeline.symbols.elf import read_symbol_table

    table = read_symbol_table(str(LIBPYTHON))
    start = next(s for s, name in ((s, table._name(i)) for i, s in enumerate(table._starts)) if name == "PyObject_Call")
    probe = [start + 4, start + 8]
    (first, second) = symbolizer.symbolize_module(ref, probe)
    assert first[0].function == "PyObject_Call" and first[0].file.endswith("Objects/call.c") and first[0].line
    assert our_chains([first, second]) == llvm_chains(LIBPYTHON, probe)
