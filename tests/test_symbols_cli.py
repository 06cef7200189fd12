"""`tbpipe addr2line` against binutils' addr2line, and `tbpipe debuginfo scan/find`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from symbols_data.testlib import (
    LIBC,
    function_addresses,
    have_tools,
    random_code_addresses,
    stripped_with_debuglink,
)

_MISSING = have_tools("addr2line", "gcc", "g++", "objcopy", "strip")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)


def tbpipe_command() -> list[str]:
    beside = Path(sys.executable).with_name("tbpipe")
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-c", "from tbpipe.pipeline.cli import main; main()"]


def tbpipe(*args: str | Path, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        tbpipe_command() + [str(a) for a in args], input=stdin, capture_output=True, text=True, timeout=120
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def binutils(*args: str | Path, stdin: str | None = None) -> str:
    out = subprocess.run(["addr2line", *map(str, args)], input=stdin, capture_output=True, text=True, check=True).stdout
    # GCC's line tables carry discriminators, which binutils prints and SymCache does not keep.
    return re.sub(r" \(discriminator \d+\)", "", out)


@pytest.mark.parametrize("flags", ["-a", "-f", "-i", "-afi", "-afip", "-fs", "-afiCp", "-p", "-ai"])
def test_output_is_the_same_as_binutils(libs, tmp_path, flags):
    addresses = [f"{a:#x}" for a in function_addresses(libs.c_lib, skip_cold=True)[::3]] + ["0x99999999"]
    ours = tbpipe("addr2line", "--cache-dir", tmp_path, "-e", libs.c_lib, flags, *addresses).stdout
    assert ours == binutils("-e", libs.c_lib, flags, *addresses)


def _pairs(output: str) -> list[list[tuple[str, str]]]:
    """`-afi` output -> per address, its (function, file:line) pairs."""
    blocks: list[list[tuple[str, str]]] = []
    lines = output.splitlines()
    index = 0
    while index < len(lines):
        assert re.fullmatch(r"0x[0-9a-f]{16}", lines[index]), lines[index]
        index += 1
        pairs = []
        while index < len(lines) and not re.fullmatch(r"0x[0-9a-f]{16}", lines[index]):
            pairs.append((lines[index], lines[index + 1]))
            index += 2
        blocks.append(pairs)
    return blocks


def test_cpp_output_matches_binutils_files_and_llvm_names(libs, tmp_path):
    from tbpipe.pipeline.symbols import demangle

    assert demangle.available(), "tbpipe._native does not import: names stay mangled"
    addresses = function_addresses(libs.cxx_lib, skip_cold=True)[::2]
    stdin = "".join(f"{a:#x}\n" for a in addresses)
    ours = _pairs(tbpipe("addr2line", "--cache-dir", tmp_path, "-e", libs.cxx_lib, "-afiC", stdin=stdin).stdout)
    expected = _pairs(binutils("-e", libs.cxx_lib, "-afiC", stdin=stdin))
    # Chains, files and lines as binutils prints them...
    assert [[location for _name, location in block] for block in ours] == [
        [location for _name, location in block] for block in expected
    ]
    # ...function names as llvm-symbolizer gives them: binutils 2.40 names a static inline
    # function of a C++ namespace (tbx::fold) after the function it is inlined into.
    llvm = subprocess.run(
        ["llvm-symbolizer", f"--obj={libs.cxx_lib}", "-fiC"], input=stdin, capture_output=True, text=True, check=True
    ).stdout
    llvm_names = [name for chunk in llvm.strip().split("\n\n") for name in chunk.splitlines()[0::2]]
    our_names = [name for block in ours for name, _location in block]
    assert len(our_names) == len(llvm_names)
    for mine, theirs in zip(our_names, llvm_names):
        # llvm 14's demangler gives up on a few libstdc++ names that __cxa_demangle handles.
        assert mine == theirs or (theirs.startswith("_Z") and not mine.startswith("_Z")), (mine, theirs)
    names = {name for block in ours for name, _location in block}
    assert {"tbx::Accumulator<long>::add(long)", "fold"} <= names


def test_stripped_binary_finds_its_debug_file(libs, tmp_path):
    module = stripped_with_debuglink(libs, tmp_path / "lib")
    shutil.copy(libs.c_debug, tmp_path / "lib" / "libtbinline.debug")
    addresses = [f"{a:#x}" for a in function_addresses(libs.c_lib, skip_cold=True)[::2]]
    ours = tbpipe("addr2line", "--cache-dir", tmp_path / "store", "-e", module, "-afi", *addresses).stdout
    assert ours == binutils("-e", libs.c_lib, "-afi", *addresses)
    # And by build-ID alone, from the store (the module file is not needed any more).
    by_id = tbpipe(
        "addr2line", "--cache-dir", tmp_path / "store", "--build-id", libs.c_build_id, "-afi", *addresses
    ).stdout
    assert by_id == ours


def test_addresses_on_stdin_and_odd_input(libs, tmp_path):
    first = function_addresses(libs.c_lib, skip_cold=True)[0]
    # ("+10" is binutils' symbol+offset form, with an empty symbol: not supported.)
    odd = ["zz", "-10", "0x", "0xg", "0x_1", "ffffffffffffffffff", "10000000000000000", "  12 junk", "\t0X1f"]
    stdin = f"{first:#x}\n\n{first:x}\n" + "\n".join(odd) + f"\n  0X{first:X}  \n{first:#x}"  # no newline at the end
    ours = tbpipe("addr2line", "--cache-dir", tmp_path, "-e", libs.c_lib, "-af", stdin=stdin).stdout
    assert ours == binutils("-e", libs.c_lib, "-af", stdin=stdin)


def test_module_path_that_is_not_utf8(libs, tmp_path):
    """A path Python can only hold with surrogates: reasons and output keep working."""
    folder = os.path.join(os.fsencode(tmp_path), b"d\xff")
    os.mkdir(folder)
    module = os.path.join(folder, b"lib.so")
    shutil.copy(libs.c_lib, module)
    first = function_addresses(libs.c_lib, skip_cold=True)[0]
    command = tbpipe_command() + ["addr2line", "--cache-dir", str(tmp_path / "store"), "-e"]
    for extra in ([], ["--json"]):
        result = subprocess.run(
            [os.fsencode(a) for a in command] + [module, b"-f", *map(str.encode, extra), b"0xffffffff", b"%#x" % first],
            capture_output=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        if not extra:
            expected = subprocess.run(
                ["addr2line", "-e", module, "-f", "0xffffffff", b"%#x" % first], capture_output=True, check=True
            ).stdout
            assert result.stdout == expected.replace(b" (discriminator 1)", b"")
        else:
            outside, inside = [json.loads(line) for line in result.stdout.splitlines()]
            assert "outside every executable segment" in outside["reason"] and inside["frames"]


def test_answers_each_line_as_it_arrives(libs, tmp_path):
    # Tools keep a pipe open and wait for each answer before sending the next address.
    address = f"{function_addresses(libs.c_lib, skip_cold=True)[0]:#x}\n"
    process = subprocess.Popen(
        tbpipe_command() + ["addr2line", "--cache-dir", str(tmp_path), "-e", str(libs.c_lib), "-f"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        expected = binutils("-e", libs.c_lib, "-f", address.strip()).splitlines()
        for _ in range(3):
            process.stdin.write(address)
            process.stdin.flush()
            assert [process.stdout.readline().rstrip("\n") for _ in expected] == expected
    finally:
        process.stdin.close()
        process.wait(timeout=60)
    assert process.returncode == 0


def test_json_output(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)
    deep = next(a for a in addresses if "(inlined by)" in binutils("-e", libs.c_lib, "-fip", f"{a:#x}"))
    out = tbpipe("addr2line", "--cache-dir", tmp_path, "-e", libs.c_lib, "--json", f"{deep:#x}", "0x99999999").stdout
    first, missing = [json.loads(line) for line in out.splitlines()]
    assert first["address"] == f"{deep:#x}" and len(first["frames"]) >= 2
    assert [f["inlined"] for f in first["frames"]] == [True] * (len(first["frames"]) - 1) + [False]
    assert first["frames"][0]["file"].endswith((".c", ".h")) and first["reason"] is None
    assert missing["frames"] == [] and "outside every executable segment" in missing["reason"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["-e", "/nonexistent/libx.so", "0x1"], "no such file"),
        (["--build-id", "not-hex", "0x1"], "invalid build-ID"),
        (["-e", "/etc/hostname", "0x1"], "not an ELF file"),
    ],
)
def test_errors_are_one_line(tmp_path, args, message):
    result = tbpipe("addr2line", "--cache-dir", tmp_path, *args, check=False)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unknown_build_id_prints_unknowns(tmp_path):
    out = tbpipe("addr2line", "--cache-dir", tmp_path, "--build-id", "ab" * 20, "-f", "0x10", "0x20").stdout
    assert out == "??\n??:0\n??\n??:0\n"


def test_debuginfo_scan_and_find(libs, tmp_path):
    debug_dir = tmp_path / "debug"
    (debug_dir / "nested").mkdir(parents=True)
    shutil.copy(libs.c_debug, debug_dir / "nested" / "a.debug")
    os.symlink(debug_dir, debug_dir / "nested" / "loop")
    scanned = json.loads(tbpipe("debuginfo", "scan", "--cache-dir", tmp_path / "store", "--json", debug_dir).stdout)
    assert scanned[0]["elf_files"] == 1 and scanned[0]["opened"] == 1
    assert any("loop" in problem for problem in scanned[0]["problems"])
    again = json.loads(tbpipe("debuginfo", "scan", "--cache-dir", tmp_path / "store", "--json", debug_dir).stdout)
    assert again[0]["opened"] == 0

    found = json.loads(
        tbpipe(
            "debuginfo", "find", libs.c_build_id, "--cache-dir", tmp_path / "store", "--debug-dir", debug_dir, "--json"
        ).stdout
    )
    assert found["quality"] == "dwarf" and found["via"] == "debug-dir"
    assert found["file"] == str(debug_dir / "nested" / "a.debug")

    text = tbpipe("debuginfo", "find", "ef" * 20, "--cache-dir", tmp_path / "store", "--debug-root", tmp_path).stdout
    assert "none: no debug info for build-ID efefefefefef" in text
    assert f"{tmp_path}/.build-id/ef/{'ef' * 19}.debug: no such file" in text


@pytest.mark.skipif(not LIBC.exists(), reason="no /lib/x86_64-linux-gnu/libc.so.6")
@pytest.mark.parametrize("flags", ["-afiC", "-afip"])
def test_warm_run_prints_what_the_cold_run_printed(tmp_path, flags):
    # The warm run formats the whole stored table at once (a different code path).
    stdin = "".join(f"{a:#x}\n" for a in random_code_addresses(LIBC, 3000, seed=21))
    cold = tbpipe("addr2line", "--cache-dir", tmp_path, "-e", LIBC, flags, stdin=stdin).stdout
    warm = tbpipe("addr2line", "--cache-dir", tmp_path, "-e", LIBC, flags, stdin=stdin).stdout
    assert cold == warm and cold.count("\n") >= 3000
