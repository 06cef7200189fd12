"""Native unwinder and module registry, checked against real binaries.

The test libraries in tests/native_testlib/ are built here with the system g++
into pytest's temporary directory and loaded with ctypes. Their innermost
function records glibc backtrace() and then calls back into Python, which walks
with tbpipe._native_test._unwind_pcs(); the frames inside the test libraries must be
exactly the ones backtrace() saw. Build-IDs are checked against `readelf -n`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tbpipe import _native
from tbpipe import _native_test as native  # the unwinder's own diagnostics (a copy of the core)

TESTLIB_SRC = Path(__file__).parent / "native_testlib"
X86_64 = platform.machine() in ("x86_64", "AMD64")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF/glibc only")
x86_64_only = pytest.mark.skipif(not X86_64, reason="DWARF CFI walk is x86-64 only")

CALLBACK = ctypes.CFUNCTYPE(None)

VARIANTS = {
    "O2": ["-O2", "-fomit-frame-pointer"],
    "O0": ["-O0", "-fno-omit-frame-pointer"],
}


# --------------------------------------------------------------------------
# Building and loading the test libraries


def _gxx(args: list[str]) -> None:
    if shutil.which("g++") is None:
        pytest.skip("needs the system g++ to build the test libraries")
    proc = subprocess.run(["g++", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"g++ {' '.join(args)} failed:\n{proc.stderr}")


def _build_chain(out_dir: Path, variant: str) -> Path:
    """libtbpipe_chain_<variant>.so and the libtbpipe_leaf_<variant>.so it needs.

    Each variant gets its own file names: the loader matches DT_NEEDED entries
    by name, so two variants sharing a leaf name would share one leaf.
    """
    flags = VARIANTS[variant]
    common = ["-shared", "-fPIC", "-g", "-Wl,--build-id", *flags]
    leaf = out_dir / f"libtbpipe_leaf_{variant}.so"
    chain = out_dir / f"libtbpipe_chain_{variant}.so"
    _gxx([*common, "-o", str(leaf), str(TESTLIB_SRC / "leaf.cpp")])
    _gxx(
        [
            *common,
            "-pthread",
            "-o",
            str(chain),
            str(TESTLIB_SRC / "chain.cpp"),
            f"-L{out_dir}",
            f"-l:{leaf.name}",
            "-Wl,-rpath,$ORIGIN",
        ]
    )
    return chain


def _build_late(out_dir: Path, name: str, variant: int) -> Path:
    lib = out_dir / name
    _gxx(
        [
            "-shared",
            "-fPIC",
            "-O2",
            "-Wl,--build-id",
            f"-DLATE_VARIANT={variant}",
            "-o",
            str(lib),
            str(TESTLIB_SRC / "late.cpp"),
        ]
    )
    return lib


class ChainLib:
    """A loaded chain library with its symbols' runtime ranges."""

    def __init__(self, path: Path):
        self.path = path
        self.leaf_path = path.with_name(path.name.replace("chain", "leaf"))
        self.dll = ctypes.CDLL(str(path))
        self.dll.chain_run.argtypes = [ctypes.c_int, CALLBACK]
        self.dll.chain_run.restype = ctypes.c_int
        self.dll.chain_thread_run.argtypes = [ctypes.c_int, CALLBACK]
        self.dll.chain_thread_run.restype = ctypes.c_int
        self.dll.chain_signal_run.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self.dll.chain_signal_run.restype = ctypes.c_int
        for name in ("chain_nocfi_call", "chain_bad_cfa_call", "chain_r10_cfa_call"):
            getattr(self.dll, name).argtypes = [CALLBACK]
            getattr(self.dll, name).restype = None
        self._symbols = _symbol_table(path)

    def backtrace(self) -> list[int]:
        n = ctypes.c_int.in_dll(self.dll, "chain_bt_n").value
        return [p or 0 for p in (ctypes.c_void_p * 1024).in_dll(self.dll, "chain_bt")[:n]]

    def symbol_range(self, name: str) -> tuple[int, int]:
        value, size = self._symbols[name]
        bias = _module_by_path(self.path)["load_bias"]
        return bias + value, bias + value + size

    def in_symbol(self, pc: int, name: str) -> bool:
        lo, hi = self.symbol_range(name)
        return lo <= pc < hi


def _symbol_table(path: Path) -> dict[str, tuple[int, int]]:
    out = subprocess.run(["nm", "-S", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            table[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    return table


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("native_testlib")


@pytest.fixture(scope="session")
def chain_libs(build_dir):
    """Builds each variant once: rebuilding a loaded library's file in place
    would change code under the running process."""
    loaded: dict[str, ChainLib] = {}

    def get(variant: str) -> ChainLib:
        if variant not in loaded:
            loaded[variant] = ChainLib(_build_chain(build_dir, variant))
        return loaded[variant]

    return get


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def chain(request, chain_libs) -> ChainLib:
    return chain_libs(request.param)


@pytest.fixture(scope="session")
def chain_o2(chain_libs) -> ChainLib:
    return chain_libs("O2")


# --------------------------------------------------------------------------
# Reading walks


MARKER = _native.NATIVE_FRAME_MARKER
EVAL = _native.NATIVE_FRAME_EVAL_LOOP
EXACT = _native.NATIVE_FRAME_EXACT_PC
BY_FP = _native.NATIVE_FRAME_BY_FRAME_POINTER
STOP = {name[len("STOP_") :].lower(): getattr(_native, name) for name in dir(_native) if name.startswith("STOP_")}


def _modules_by_index() -> dict[int, dict]:
    return {m["index"]: m for m in native._modules()}


def _module_by_path(path: Path) -> dict:
    real = os.path.realpath(path)

    def matching() -> list[dict]:
        return [m for m in native._modules() if m["path"] and os.path.realpath(m["path"]) == real]

    # The registry learns of a library when a walk first meets it; a test that looks it up before
    # any walk through it (test order is random) asks for the refresh itself.
    matches = matching()
    if not matches:
        native._refresh_modules()
        matches = matching()
    assert matches, f"{path} not in the module registry"
    return matches[-1]


def _indices_of(*paths: Path) -> set[int]:
    reals = {os.path.realpath(p) for p in paths}
    return {m["index"] for m in native._modules() if m["path"] and os.path.realpath(m["path"]) in reals}


def _in_modules(pc: int, indices: set[int]) -> bool:
    mods = _modules_by_index()
    return any(lo <= pc < hi for i in indices for lo, hi in mods[i]["exec_ranges"])


def _stop_reason(frames) -> str | None:
    if frames and frames[-1][2] & MARKER:
        names = {v: k for k, v in STOP.items()}
        return names[frames[-1][0]]
    return None


def _real_frames(frames):
    return [f for f in frames if not f[2] & MARKER]


def _readelf_build_id(path: Path | str) -> str:
    out = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True, check=True).stdout
    match = re.search(r"Build ID:\s*([0-9a-fA-F]+)", out)
    assert match, f"no build-ID note in {path}"
    return match.group(1).lower()


def _walk_via(call) -> list[tuple[int, int, int]]:
    """Runs call(cb) where cb is a ctypes callback that walks the stack."""
    walks = []

    @CALLBACK
    def cb():
        walks.append(native._unwind_pcs())

    call(cb)
    assert len(walks) == 1
    return walks[0]


def _assert_outermost(frames) -> None:
    """The walk reached the thread's first frame: no marker, ends in libc or the
    program itself (_start / clone3)."""
    assert _stop_reason(frames) is None, f"walk stopped early: {_stop_reason(frames)}"
    path = _modules_by_index()[frames[-1][1]]["path"]
    assert "/libc.so" in path or os.path.realpath(path) == os.path.realpath(sys.executable), path


def _assert_matches_backtrace(lib: ChainLib, frames, bt: list[int]) -> list[int]:
    """Our frames inside the test libraries equal backtrace()'s, in order.

    backtrace() ran in chain_innermost, our walk in a callback it made later:
    both first entries are in chain_innermost (different call sites); every
    caller return address after it must be identical.
    """
    test_libs = _indices_of(lib.path, lib.leaf_path)
    ours = [pc for pc, mod, flags in frames if mod in test_libs]
    theirs = [pc for pc in bt if _in_modules(pc, test_libs)]
    assert len(theirs) >= 4, theirs
    assert lib.in_symbol(ours[0], "chain_innermost")
    assert lib.in_symbol(theirs[0], "chain_innermost")
    assert [hex(p) for p in ours[1:]] == [hex(p) for p in theirs[1:]]
    return ours


# --------------------------------------------------------------------------
# Module registry


def test_main_program_and_vdso_are_registered():
    mods = native._modules()
    main = mods[0]
    assert os.path.realpath(main["path"]) == os.path.realpath(sys.executable)
    assert main["build_id"] == _readelf_build_id(main["path"])
    assert any(m["path"] == "linux-vdso.so.1" for m in mods)
    for position, m in enumerate(mods):
        assert m["index"] == position
        for lo, hi in m["exec_ranges"]:
            assert m["image"][0] <= lo < hi <= m["image"][1]


def test_libc_build_id_matches_readelf():
    libc = [m for m in native._modules() if re.search(r"/libc\.so\.6$", m["path"])]
    assert libc, "libc.so.6 not registered"
    for m in libc:
        assert m["build_id"] == _readelf_build_id(m["path"])
    system_libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if system_libc.exists() and X86_64:
        assert any(os.path.realpath(m["path"]) == os.path.realpath(system_libc) for m in libc)
        assert libc[0]["build_id"] == _readelf_build_id(system_libc)


def test_eval_ranges_cover_the_eval_loop():
    addr = ctypes.cast(ctypes.pythonapi._PyEval_EvalFrameDefault, ctypes.c_void_p).value
    index = native._module_for_pc(addr)
    assert index >= 0
    mod = _modules_by_index()[index]
    assert any(lo <= addr < hi for lo, hi in mod["eval_ranges"])
    # Only that module has eval ranges, and they lie in its executable ranges.
    for m in native._modules():
        if m["index"] != index:
            assert m["eval_ranges"] == []
    for lo, hi in mod["eval_ranges"]:
        assert any(elo <= lo and hi <= ehi for elo, ehi in mod["exec_ranges"])


# --------------------------------------------------------------------------
# Recipes against binutils' own CFI interpreter


def _readelf_cfi_rows(path: str):
    """Rows of `readelf -wF` (the CFA table binutils computes) for every FDE."""
    # Exit status 1 only reports unrelated debug sections it could not read.
    out = subprocess.run(["readelf", "-wF", path], capture_output=True, text=True).stdout
    columns = None
    fde_end = 0
    for line in out.splitlines():
        if " FDE " in line or " CIE " in line:
            fde = re.search(r" FDE .*pc=[0-9a-f]+\.\.([0-9a-f]+)", line)
            fde_end = int(fde.group(1), 16) if fde else 0
            columns = None
            continue
        if line.startswith("   LOC"):
            columns = line.split() if fde_end else None
            continue
        parts = line.split()
        if columns and len(parts) == len(columns) and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            # readelf also prints a row for an advance that reaches the FDE's
            # end; that address belongs to the next FDE.
            if int(parts[0], 16) < fde_end:
                yield dict(zip(columns, parts))


def _recipe_agrees(row: dict, recipe: dict) -> bool:
    cfa, ra, rbp = row["CFA"], row["ra"], row.get("rbp", "s")
    reg_cfa = re.fullmatch(r"(rsp|rbp)\+(-?\d+)", cfa)
    if reg_cfa:
        if (recipe["cfa_rule"], recipe["cfa_off"]) != (reg_cfa.group(1) + "+k", int(reg_cfa.group(2))):
            return False
    elif cfa == "exp":
        return recipe["cfa_rule"] in ("*(rsp+k)", "*(rbp+k)", "plt", "unsupported")
    else:  # CFA in another register: no recipe form
        return recipe["cfa_rule"] == "unsupported"
    if ra.startswith("c"):
        ok = (recipe["ra_rule"], recipe["ra_off"]) == ("cfa+k", int(ra[1:]))
    elif ra == "u":
        ok = recipe["ra_rule"] == "undefined"
    else:
        ok = recipe["cfa_rule"] == "unsupported"
    if rbp.startswith("c"):
        ok &= (recipe["rbp_rule"], recipe["rbp_off"]) == ("cfa+k", int(rbp[1:]))
    elif rbp == "s":
        ok &= recipe["rbp_rule"] == "same"
    elif rbp == "u":  # readelf prints "u" also for a register not saved yet
        ok &= recipe["rbp_rule"] in ("same", "lost")
    else:
        ok &= recipe["rbp_rule"] in ("rsp+k", "rbp+k", "cfa+k", "val cfa+k", "lost")
    return ok


@x86_64_only
def test_recipes_agree_with_readelf_on_every_cfi_row(chain):
    native._refresh_modules()  # the chain library may not have been walked through yet
    eval_module = next(m for m in native._modules() if m["eval_ranges"])
    libc = next(m for m in native._modules() if m["path"].endswith("/libc.so.6"))
    paths = [libc["path"], eval_module["path"], str(chain.path), str(chain.leaf_path)]
    for path in paths:
        bias = _module_by_path(Path(path))["load_bias"]
        rows = mismatches = 0
        for row in _readelf_cfi_rows(path):
            recipe = native._recipe_for_pc(bias + int(row["LOC"], 16))
            assert recipe is not None, (path, row)
            rows += 1
            if not _recipe_agrees(row, recipe):
                mismatches += 1
                print("mismatch", path, row, recipe)
        assert rows > 0, path
        assert mismatches == 0, f"{mismatches} of {rows} rows of {path} disagree with readelf"


@x86_64_only
def test_an_fde_ends_before_its_end_address():
    """An FDE covers [pc_begin, pc_end): where padding follows a function rather than the next
    function's FDE, its last byte has the function's recipe and its end address none."""
    native._refresh_modules()
    libc = next(m for m in native._modules() if m["path"].endswith("/libc.so.6"))
    listing = subprocess.run(["readelf", "-wf", libc["path"]], capture_output=True, text=True).stdout
    ranges = [(int(lo, 16), int(hi, 16)) for lo, hi in re.findall(r" FDE .*pc=([0-9a-f]+)\.\.([0-9a-f]+)", listing)]
    ends = [hi for _lo, hi in ranges[:400] if not any(lo <= hi < other_hi for lo, other_hi in ranges)]
    assert len(ends) > 10
    for end in ends:
        assert native._recipe_for_pc(libc["load_bias"] + end - 1)["cfa_rule"] != "no-info", hex(end)
        assert native._recipe_for_pc(libc["load_bias"] + end)["cfa_rule"] == "no-info", hex(end)


@x86_64_only
def test_damaged_cfi_is_refused_without_faulting(chain_o2):
    """The parser only reads inside the module's readable segments, whatever the
    bytes say: feed it a copy of real CFI with bytes flipped, words overwritten
    and the segment cut short (a fault here would kill the test process)."""
    native._refresh_modules()
    mod = _module_by_path(chain_o2.path)
    hdr = mod["eh_frame_hdr"]
    lo, hi = next((lo, hi) for lo, hi in mod["readable_ranges"] if lo <= hdr < hi)
    data = ctypes.string_at(lo, hi - lo)
    hdr_off = hdr - lo
    funcs = [
        chain_o2.symbol_range(name)
        for name in ("chain_innermost", "chain_realigned", "chain_rec_a", "chain_signal_run")
    ]
    pcs = [start + (end - start) // 2 for start, end in funcs]
    for pc in pcs:  # an intact copy compiles exactly as the loaded library does
        assert native._recipe_in_buffer(data, hdr_off, pc - lo) == native._recipe_for_pc(pc)

    rng = random.Random(20240517)
    cfi_end = min(len(data), hdr_off + 4096)  # .eh_frame_hdr, then .eh_frame
    outcomes = set()
    for trial in range(4000):
        buf = bytearray(data)
        if trial % 3 == 0:
            for _ in range(rng.randint(1, 6)):
                buf[rng.randrange(hdr_off, cfi_end)] = rng.randrange(256)
        elif trial % 3 == 1:
            at = rng.randrange(hdr_off, cfi_end - 4)
            buf[at : at + 4] = rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0, 1, rng.randrange(1 << 32)]).to_bytes(
                4, "little"
            )
        else:
            del buf[rng.randrange(hdr_off, cfi_end) :]
        pc = rng.choice(pcs)
        recipe = native._recipe_in_buffer(bytes(buf), hdr_off, pc - lo)
        outcomes.add(recipe["cfa_rule"])
    assert {"no-info", "rsp+k"} <= outcomes


# --------------------------------------------------------------------------
# Walks from Python


def test_walk_from_python_reaches_outermost_frame():
    frames = native._unwind_pcs()
    _assert_outermost(frames)
    assert any(flags & EVAL for _, _, flags in frames)
    own = native._module_for_pc(native._unwind_c_entry())
    assert frames[0][1] != own
    unskipped = native._unwind_pcs(skip_own_module=False)
    assert unskipped[0][1] == own
    assert unskipped[0][2] & EXACT
    assert len(unskipped) > len(frames)


def test_skip_until_eval_starts_at_the_eval_loop():
    frames = native._unwind_pcs(skip_until_eval=True)
    assert frames[0][2] & EVAL
    full = native._unwind_pcs()
    # Same outer part of the stack (the call sites inside this test differ).
    assert [f[0] for f in frames[-3:]] == [f[0] for f in full[-3:]]


def test_no_refresh_on_each_gather():
    native._unwind_pcs()
    generation = native._module_generation()
    for _ in range(50):
        native._unwind_pcs()
    assert native._module_generation() == generation


def test_walk_on_python_thread_reaches_outermost_frame():
    results = []
    thread = threading.Thread(target=lambda: results.append(native._unwind_pcs()))
    thread.start()
    thread.join()
    frames = results[0]
    _assert_outermost(frames)
    assert any(flags & EVAL for _, _, flags in frames)


# --------------------------------------------------------------------------
# Walks through the test libraries


@x86_64_only
def test_chain_matches_glibc_backtrace(chain):
    frames = _walk_via(lambda cb: chain.dll.chain_run(3, cb))
    ours = _assert_matches_backtrace(chain, frames, chain.backtrace())
    # 3 x (rec_a, rec_b, leaf_bounce, rec_c) + rec_a + realigned + innermost + chain_run
    assert len(ours) == 16
    leaf = _indices_of(chain.leaf_path)
    assert sum(1 for _, mod, _ in frames if mod in leaf) == 3

    # Past the libraries: ctypes/libffi, the interpreter, up to _start.
    test_libs = _indices_of(chain.path, chain.leaf_path)
    last_lib = max(i for i, f in enumerate(frames) if f[1] in test_libs)
    outer = frames[last_lib + 1 :]
    assert any(f[2] & EVAL for f in outer)
    assert any(f[2] & EVAL for f in frames[:last_lib])  # the Python callback
    _assert_outermost(frames)
    for pc, mod, flags in _real_frames(frames):
        assert mod == native._module_for_pc(pc if flags & EXACT else pc - 1)


@x86_64_only
def test_realigned_frame_uses_the_deref_cfa_rule(chain_o2):
    frames = _walk_via(lambda cb: chain_o2.dll.chain_run(0, cb))
    realigned = [pc for pc, _, _ in frames if chain_o2.in_symbol(pc, "chain_realigned")]
    assert len(realigned) == 1
    recipe = native._recipe_for_pc(realigned[0] - 1)
    assert recipe["cfa_rule"] == "*(rbp+k)", recipe
    assert recipe["rbp_rule"] == "rbp+k", recipe


@x86_64_only
def test_plt_entries_compile_to_the_plt_rule(chain_o2):
    sections = subprocess.run(["readelf", "-SW", str(chain_o2.path)], capture_output=True, text=True, check=True).stdout
    match = re.search(r"\]\s+\.plt\s+PROGBITS\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)", sections)
    if not match or int(match.group(2), 16) < 32:
        pytest.skip("no lazy .plt in this toolchain's output")
    plt = _module_by_path(chain_o2.path)["load_bias"] + int(match.group(1), 16)
    entry = plt + 16  # first PLT entry after PLT0
    recipes = [native._recipe_for_pc(entry + k) for k in range(16)]
    if recipes[0]["cfa_rule"] != "plt":
        pytest.skip(f"linker's .plt CFI is not the expression form: {recipes[0]}")
    threshold = recipes[0]["plt_threshold"]
    assert 6 <= threshold <= 15
    assert all(r["cfa_rule"] == "plt" and r["cfa_off"] == 8 for r in recipes)


@x86_64_only
def test_native_thread_reaches_outermost_frame(chain_o2):
    frames = _walk_via(lambda cb: chain_o2.dll.chain_thread_run(2, cb))
    _assert_matches_backtrace(chain_o2, frames, chain_o2.backtrace())
    _assert_outermost(frames)
    assert any(flags & EVAL for _, _, flags in frames)
    # No Python frames below the thread's entry: the last eval frame is above
    # the chain library.
    test_libs = _indices_of(chain_o2.path, chain_o2.leaf_path)
    first_lib = min(i for i, f in enumerate(frames) if f[1] in test_libs)
    assert not any(f[2] & EVAL for f in frames[first_lib:])


@x86_64_only
def test_walk_through_signal_frame(chain_o2):
    n = chain_o2.dll.chain_signal_run(2, native._unwind_c_entry())
    assert n > 0
    pcs = (ctypes.c_size_t * 512).in_dll(chain_o2.dll, "sig_pcs")
    mods = (ctypes.c_int32 * 512).in_dll(chain_o2.dll, "sig_modules")
    flags = (ctypes.c_uint32 * 512).in_dll(chain_o2.dll, "sig_flags")
    frames = [(pcs[i], mods[i], flags[i]) for i in range(n)]
    bt_n = ctypes.c_int.in_dll(chain_o2.dll, "sig_bt_n").value
    bt = [p or 0 for p in (ctypes.c_void_p * 1024).in_dll(chain_o2.dll, "sig_bt")[:bt_n]]

    _assert_outermost(frames)
    # The frame interrupted by the signal has an exact PC, and the frame before
    # it is the signal trampoline (CIE augmentation 'S').
    exact = [i for i, f in enumerate(frames) if f[2] & EXACT and i > 0]
    assert len(exact) == 1, frames
    trampoline = frames[exact[0] - 1]
    assert native._recipe_for_pc(trampoline[0] - 1)["signal_frame"]

    # Both lists start in the handler; after it, the chain frames must agree.
    test_libs = _indices_of(chain_o2.path, chain_o2.leaf_path)
    ours = [pc for pc, mod, _ in frames if mod in test_libs]
    theirs = [pc for pc in bt if _in_modules(pc, test_libs)]
    assert chain_o2.in_symbol(ours[0], "chain_signal_handler")
    assert chain_o2.in_symbol(theirs[0], "chain_signal_handler")
    assert [hex(p) for p in ours[1:]] == [hex(p) for p in theirs[1:]]
    assert chain_o2.in_symbol(ours[1], "chain_innermost")


@x86_64_only
def test_depth_limit_marker(chain_o2):
    frames = _walk_via(lambda cb: chain_o2.dll.chain_run(200, cb))
    assert len(frames) == _native.MAX_NATIVE_FRAMES
    assert _stop_reason(frames) == "depth_limit"


@x86_64_only
def test_frame_pointer_fallback_without_cfi(chain_o2):
    frames = _walk_via(chain_o2.dll.chain_nocfi_call)
    at = [i for i, f in enumerate(frames) if chain_o2.in_symbol(f[0], "chain_nocfi_call")]
    assert len(at) == 1
    assert native._recipe_for_pc(frames[at[0]][0] - 1)["cfa_rule"] == "no-info"
    caller = frames[at[0] + 1]
    assert caller[2] & BY_FP
    assert native._recipe_for_pc(caller[0] - 1) is not None  # back in known code (libffi)
    _assert_outermost(frames)


@x86_64_only
def test_cfa_outside_the_stack_stops_with_bad_stack_read(chain_o2):
    frames = _walk_via(chain_o2.dll.chain_bad_cfa_call)
    assert _stop_reason(frames) == "bad_stack_read"
    assert chain_o2.in_symbol(frames[-2][0], "chain_bad_cfa_call")


def test_stack_reads_lie_in_the_bounds_whole_and_aligned():
    """The unwinder loads a stack word only when it is aligned and all of it lies in [lo, hi): the
    last readable word starts at hi - 8 (on the main thread the page past the top may be unmapped)."""
    words = (ctypes.c_uint64 * 8)(*(0x0101010101010101 * (i + 1) for i in range(8)))
    base = ctypes.addressof(words)
    assert base % 8 == 0
    lo, hi = base + 16, base + 48  # words 2 to 5; the words around them are readable too
    assert native._stack_read(lo, hi, lo) == words[2]
    assert native._stack_read(lo, hi, hi - 8) == words[5]
    for refused in (lo - 8, lo + 4, hi - 7, hi - 4, hi - 1, hi, hi + 8):
        assert native._stack_read(lo, hi, refused) is None, refused - base
    # An unaligned top: the word that crosses it is refused.
    assert native._stack_read(lo, hi + 4, hi - 8) == words[5]
    assert native._stack_read(lo, hi + 4, hi) is None

    # Bounds no buffer has (the rule alone, nothing read): no wrap-around below 8 or at the top.
    top = 2**64
    for hi in range(8):
        assert not any(native._stack_read_allowed(0, hi, addr) for addr in (0, 8, top - 8)), hi
    assert native._stack_read_allowed(0, 8, 0) and not native._stack_read_allowed(0, 8, 8)
    assert native._stack_read_allowed(top - 64, top - 8, top - 16)
    assert not native._stack_read_allowed(top - 64, top - 8, top - 8)
    assert native._stack_read_allowed(top - 64, top - 1, top - 16)
    assert not native._stack_read_allowed(top - 64, top - 1, top - 8)


@x86_64_only
def test_cfa_in_untracked_register_stops_with_unsupported_rule(chain_o2):
    frames = _walk_via(chain_o2.dll.chain_r10_cfa_call)
    assert _stop_reason(frames) == "unsupported_rule"
    assert chain_o2.in_symbol(frames[-2][0], "chain_r10_cfa_call")


@x86_64_only
def test_pc_outside_every_module_stops_with_unknown_pc():
    # A call from anonymous executable memory, as JIT-compiled code would make.
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError, AttributeError) as exc:
        pytest.skip(f"cannot map executable memory: {exc}")
    # sub $8,%rsp; call *%rdi; add $8,%rsp; ret
    page.write(bytes.fromhex("4883ec08ffd74883c408c3"))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    jit = ctypes.CFUNCTYPE(None, CALLBACK)(addr)
    native._refresh_modules()
    generation = native._module_generation()
    frames = _walk_via(jit)
    assert _stop_reason(frames) == "unknown_pc"
    assert frames[-2][1] == -1 and addr <= frames[-2][0] < addr + 16
    assert native._module_generation() == generation  # the refresh found nothing new
    del jit


# --------------------------------------------------------------------------
# Libraries loaded after the first walk


@x86_64_only
def test_library_loaded_after_first_walk_is_found(build_dir):
    native._unwind_pcs()
    lib_path = _build_late(build_dir, "libtbpipe_late_found.so", 1)
    generation = native._module_generation()
    dll = ctypes.CDLL(str(lib_path))
    dll.late_call.argtypes = [CALLBACK]
    frames = _walk_via(dll.late_call)

    index = _module_by_path(lib_path)["index"]
    in_late = [f for f in frames if f[1] == index]
    assert len(in_late) == 1
    mod = _modules_by_index()[index]
    assert mod["build_id"] == _readelf_build_id(lib_path)
    assert native._module_generation() > generation
    _assert_outermost(frames)


@x86_64_only
def test_reloaded_address_gets_a_new_module_index(build_dir):
    import _ctypes

    first = _build_late(build_dir, "libtbpipe_late_a.so", 2)
    second = _build_late(build_dir, "libtbpipe_late_b.so", 3)
    assert _readelf_build_id(first) != _readelf_build_id(second)

    dll = ctypes.CDLL(str(first))
    dll.late_call.argtypes = [CALLBACK]
    _walk_via(dll.late_call)
    index_a = _module_by_path(first)["index"]
    _ctypes.dlclose(dll._handle)
    del dll

    dll = ctypes.CDLL(str(second))
    dll.late_call.argtypes = [CALLBACK]
    # A PC inside a stale module's range does not trigger a refresh by itself;
    # whoever loads code explicitly asks for one.
    native._refresh_modules()
    frames = _walk_via(dll.late_call)
    index_b = _module_by_path(second)["index"]
    assert index_b != index_a
    assert [f for f in frames if f[1] == index_b]
    assert not [f for f in frames if f[1] == index_a]
    assert _modules_by_index()[index_b]["build_id"] == _readelf_build_id(second)
    assert _modules_by_index()[index_a]["build_id"] == _readelf_build_id(first)


# --------------------------------------------------------------------------
# A python executable with the interpreter linked in statically


def _static_python(out_dir: Path) -> Path:
    import sysconfig

    cfg = sysconfig.get_config_var
    archive = Path(cfg("LIBPL") or "") / (cfg("LIBRARY") or "")
    if not archive.name.endswith(".a") or not archive.is_file():
        pytest.skip("this interpreter ships no static libpython archive")
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = out_dir / "static_python"
    libs = " ".join(cfg(k) or "" for k in ("LIBS", "MODLIBS", "LOCALMODLIBS", "SYSLIBS")).split()
    cmd = [
        cc,
        "-O1",
        f"-I{sysconfig.get_paths()['include']}",
        str(TESTLIB_SRC / "static_python.c"),
        str(archive),
        *libs,
        "-lm",
        "-lpthread",
        "-Xlinker",
        "-export-dynamic",
        "-o",
        str(exe),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    # The archive and a compiler are here: a link that fails is a broken test program or build
    # flags, not something missing from the machine.
    assert proc.returncode == 0, f"cannot link a static python: {proc.stderr[-2000:]}"
    return exe


def test_static_python_executable(build_dir):
    import json
    import site

    exe = _static_python(build_dir)
    # The child gets this process's import path, site dirs included so that
    # .pth files (editable installs) are honoured.
    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    snippet = f"""
import json, site, sys
for d in {site_dirs!r}:
    site.addsitedir(d)
sys.path[:0] = {sys.path!r}
from tbpipe import _native_test as n
mods = n._modules()
print(json.dumps({{"modules": mods, "frames": n._unwind_pcs()}}))
"""
    env = dict(os.environ, PYTHONHOME=sys.base_prefix)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(exe), "-c", snippet], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    mods, frames = result["modules"], result["frames"]
    main = mods[0]
    assert os.path.realpath(main["path"]) == os.path.realpath(exe)
    assert main["eval_ranges"], "eval loop not found in the static executable"
    assert not any(m["eval_ranges"] for m in mods[1:])
    assert not any("libpython" in m["path"] for m in mods)
    assert any(flags & EVAL and mod == 0 for _, mod, flags in frames)
    assert not frames[-1][2] & MARKER, frames[-1]
