"""Builds the test libraries (once per test session) and wraps llvm-symbolizer as the oracle."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from support.addresses import sample_code_addresses

DATA = Path(__file__).resolve().parent
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
LIBPYTHON = Path(os.path.expanduser("~/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0"))


@dataclass(frozen=True)
class Libs:
    root: Path
    c_lib: Path  # -O2 -g, unstripped
    c_build_id: str
    c_debug: Path  # objcopy --only-keep-debug
    c_stripped: Path  # strip --strip-all (keeps .dynsym), no debuglink
    c_zlib: Path  # debug sections zlib-compressed
    c_zstd: Path | None  # None when the local objcopy cannot write zstd
    zstd_problem: str
    cxx_lib: Path
    cxx_build_id: str
    other_lib: Path  # the same source built differently: another build-ID
    other_debug: Path


def run(*command: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], cwd=cwd, check=True, capture_output=True, text=True)


def build_id_of(path: Path) -> str:
    from tbpipe.pipeline.symbols.elf import read_build_id

    found = read_build_id(str(path))
    assert found, f"{path} has no build-ID"
    return found


@functools.cache
def build_libs(root: str) -> Libs:
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    c_lib = base / "libtbinline.so"
    common = ["-O2", "-g", "-shared", "-fPIC", "-Wl,--build-id=sha1", f"-I{DATA}"]
    run("gcc", *common, "-o", c_lib, DATA / "inlines.c")
    other_lib = base / "libtbinline-other.so"
    run("gcc", *common, "-DTB_OTHER_BUILD", "-fno-inline-small-functions", "-o", other_lib, DATA / "inlines.c")
    cxx_lib = base / "libtbcxx.so"
    run("g++", *common, "-o", cxx_lib, DATA / "cxx.cpp")

    c_debug = base / "libtbinline.debug"
    run("objcopy", "--only-keep-debug", c_lib, c_debug)
    other_debug = base / "libtbinline-other.debug"
    run("objcopy", "--only-keep-debug", other_lib, other_debug)
    c_stripped = base / "stripped" / "libtbinline.so"
    c_stripped.parent.mkdir()
    run("strip", "--strip-all", "-o", c_stripped, c_lib)

    c_zlib = base / "zlib" / "libtbinline.so"
    c_zlib.parent.mkdir()
    run("objcopy", "--compress-debug-sections=zlib", c_lib, c_zlib)
    c_zstd: Path | None = base / "zstd" / "libtbinline.so"
    c_zstd.parent.mkdir()
    zstd_problem = ""
    try:
        run("objcopy", "--compress-debug-sections=zstd", c_lib, c_zstd)
    except subprocess.CalledProcessError as error:
        zstd_problem = f"objcopy cannot write zstd-compressed sections: {error.stderr.strip()}"
        c_zstd = None
    return Libs(
        root=base,
        c_lib=c_lib,
        c_build_id=build_id_of(c_lib),
        c_debug=c_debug,
        c_stripped=c_stripped,
        c_zlib=c_zlib,
        c_zstd=c_zstd,
        zstd_problem=zstd_problem,
        cxx_lib=cxx_lib,
        cxx_build_id=build_id_of(cxx_lib),
        other_lib=other_lib,
        other_debug=other_debug,
    )


def stripped_with_debuglink(libs: Libs, directory: Path) -> Path:
    """A stripped copy of the C library in `directory` whose .gnu_debuglink names libtbinline.debug."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "libtbinline.so"
    # objcopy computes the CRC from the debug file it is given and records only its name.
    run("objcopy", f"--add-gnu-debuglink={libs.c_debug}", libs.c_stripped, target)
    return target


def function_addresses(path: Path, skip_cold: bool = False) -> list[int]:
    """Every byte address inside the FUNC symbols of .symtab (the test libraries are small).

    `skip_cold` leaves out GCC's `foo.cold` parts, which binutils names `foo` (after its DWARF
    entry) and llvm-symbolizer and tbpipe name `foo.cold` (after the symbol table)."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as stream:
        elf = ELFFile(stream)
        symtab = elf.get_section_by_name(".symtab")
        out = set()
        for symbol in symtab.iter_symbols():
            if skip_cold and ".cold" in symbol.name:
                continue
            if symbol["st_info"]["type"] == "STT_FUNC" and symbol["st_size"] and symbol["st_shndx"] != "SHN_UNDEF":
                out.update(range(symbol["st_value"], symbol["st_value"] + symbol["st_size"]))
    return sorted(out)


# Uniform over the executable PT_LOAD segments, reproducible by seed.
random_code_addresses = sample_code_addresses


Chain = list[tuple[str | None, str | None, int | None]]


def llvm_chains(obj: Path, addresses: list[int], demangle: bool = True) -> list[Chain]:
    """llvm-symbolizer's inline chains: (function, normalized file, line) innermost first."""
    flags = ["--output-style=JSON", "-fi"] + (["-C"] if demangle else ["--no-demangle"])
    result = subprocess.run(
        ["llvm-symbolizer", f"--obj={obj}", *flags],
        input="".join(f"{a:#x}\n" for a in addresses),
        capture_output=True,
        text=True,
        check=True,
    )
    chains = []
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        chain = []
        for symbol in json.loads(line)["Symbol"]:
            function = symbol["FunctionName"] or None
            has_line = bool(symbol["Line"])
            file = os.path.normpath(symbol["FileName"]) if has_line and symbol["FileName"] else None
            chain.append((function, file, symbol["Line"] or None))
        if chain == [(None, None, None)]:
            chain = []
        chains.append(chain)
    assert len(chains) == len(addresses)
    return chains


def our_chains(results) -> list[Chain]:
    out = []
    for frames in results:
        chain = [
            (f.function, f.file if f.line else None, f.line)
            for f in frames
            if not (f.function is None and f.file is None)
        ]
        out.append(chain)
    return out


def agreement(expected: list[Chain], got: list[Chain]) -> tuple[float, list]:
    """Share of addresses with the same chain (functions, files, lines); the differing ones.

    A comparison of nothing is no agreement: results missing for some addresses, or an oracle
    that named no address at all, fail here instead of scoring 1.0."""
    assert len(got) == len(expected), f"{len(got)} results for {len(expected)} addresses"
    assert any(expected), f"the oracle symbolized none of the {len(expected)} addresses: nothing to compare"
    different = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    return 1 - len(different) / len(expected), different


def have_tools(*tools: str) -> str:
    """'' when all tools exist, else what is missing (for pytest.skip)."""
    missing = [t for t in tools if shutil.which(t) is None]
    return f"missing tools: {', '.join(missing)}" if missing else ""
