"""The persistent symbol store and the bulk paths: built once ever, reused, damage-tolerant,
parallel results equal to serial ones, and the Arrow table equal to the frame lists."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from symbols_data.testlib import LIBC, function_addresses, have_tools, random_code_addresses

from tbpipe.pipeline.progress import DelayedProgress
from tbpipe.pipeline.symbols import ModuleRef, Quality, Symbolizer, arrow_schema
from tbpipe.pipeline.symbols.columns import KnownTable, ResultChunk
from tbpipe.pipeline.symbols.elf import read_build_id
from tbpipe.pipeline.symbols.model import ElfFileError

_MISSING = have_tools("gcc", "g++", "objcopy", "strip")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)


def store_files(root, pattern):
    return sorted(p for p in (root / "symbols-v1").rglob(pattern))


def test_symcache_is_built_once_and_results_are_kept(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    first = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[]).symbolize_module(ref, addresses)
    (symcache,) = store_files(tmp_path, "symcache.zst")
    built_at = symcache.stat().st_mtime_ns
    assert store_files(tmp_path, "known-*.seg")

    # A new process-worth of state: the stored status and results answer, even when the module
    # file is gone (an old run symbolized on another machine).
    moved = tmp_path / "gone.so"
    second = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[])
    assert second.symbolize_module(ModuleRef(libs.c_build_id, str(moved)), addresses) == first
    assert symcache.stat().st_mtime_ns == built_at
    assert second.module_status(libs.c_build_id).quality is Quality.DWARF


def test_new_addresses_use_the_stored_symcache(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    everything = Symbolizer(cache_dir=tmp_path / "a", jobs=1, debug_roots=[]).symbolize_module(ref, addresses)
    half = Symbolizer(cache_dir=tmp_path / "b", jobs=1, debug_roots=[])
    half.symbolize_module(ref, addresses[::2])
    later = Symbolizer(cache_dir=tmp_path / "b", jobs=1, debug_roots=[])
    assert later.symbolize_module(ref, addresses) == everything


def test_module_build_id_is_remembered_while_the_file_is_unchanged(libs, tmp_path):
    import shutil

    module = tmp_path / "libmodule.so"
    shutil.copy(libs.c_lib, module)
    symbolizer = Symbolizer(cache_dir=tmp_path / "store", jobs=1, debug_roots=[])
    assert symbolizer.build_id_of(str(module)) == libs.c_build_id == read_build_id(str(module))
    (memo,) = (tmp_path / "store" / "modules").glob("*.json")

    # Replaced by another build at the same path: the memo no longer matches, the file is read.
    shutil.copy(libs.other_lib, module)
    other = read_build_id(str(libs.other_lib))
    assert other != libs.c_build_id
    assert Symbolizer(cache_dir=tmp_path / "store", jobs=1).build_id_of(str(module)) == other

    # A damaged memo is as good as none.
    memo.write_text("{not json")
    assert Symbolizer(cache_dir=tmp_path / "store", jobs=1).build_id_of(str(module)) == other
    # A file that is gone is an error, whatever was remembered.
    module.unlink()
    with pytest.raises(ElfFileError):
        symbolizer.build_id_of(str(module))


def test_damaged_store_files_are_redone(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    expected = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[]).symbolize_module(ref, addresses)
    for segment in store_files(tmp_path, "known-*.seg"):
        segment.write_bytes(b"garbage")
    (symcache,) = store_files(tmp_path, "symcache.zst")
    symcache.write_bytes(b"\x28\xb5\x2f\xfd garbage")
    (status,) = store_files(tmp_path, "status.json")
    status.write_text("{not json")
    again = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[])
    assert again.symbolize_module(ref, addresses) == expected

    # A SymCache damaged after its status was written is rebuilt on first use.
    (symcache,) = store_files(tmp_path, "symcache.zst")
    symcache.write_bytes(b"\x28\xb5\x2f\xfd garbage")
    for segment in store_files(tmp_path, "known-*.seg"):
        segment.unlink()
    third = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[])
    assert third.symbolize_module(ref, addresses) == expected


def test_many_segments_are_compacted(libs, tmp_path):
    addresses = function_addresses(libs.c_lib)
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    counts = []
    for index in range(20):
        Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[]).symbolize_module(ref, addresses[index::20])
        counts.append(len(store_files(tmp_path, "known-*.seg")))
    # Each run adds a segment; loading more than 16 merges them into one.
    assert counts[:17] == list(range(1, 18)) and counts[17] == 2
    everything = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[]).symbolize_module(ref, addresses)
    fresh = Symbolizer(cache_dir=tmp_path / "fresh", jobs=1, debug_roots=[]).symbolize_module(ref, addresses)
    assert everything == fresh


def test_two_processes_filling_one_store(libs, tmp_path):
    code = (
        "import sys\n"
        "from tbpipe.pipeline.symbols import Symbolizer, ModuleRef\n"
        "from symbols_data.testlib import function_addresses\n"
        "from pathlib import Path\n"
        f"ref = ModuleRef({libs.c_build_id!r}, {str(libs.c_lib)!r})\n"
        "frames = Symbolizer(cache_dir=sys.argv[1], jobs=1, debug_roots=[]).symbolize_module(ref, function_addresses(Path(ref.path)))\n"
        "print(sum(len(f) for f in frames))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    children = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(3)
    ]
    outputs = {child.communicate(timeout=120)[0] for child in children}
    assert all(child.returncode == 0 for child in children)
    assert len(outputs) == 1
    assert len(store_files(tmp_path, "symcache.zst")) == 1


def test_symbolize_many_in_worker_processes_equals_serial(libs, tmp_path):
    modules = {
        ModuleRef(libs.c_build_id, str(libs.c_lib)): (function_addresses(libs.c_lib), None),
        ModuleRef(libs.cxx_build_id, str(libs.cxx_lib)): (function_addresses(libs.cxx_lib), None),
    }
    if LIBC.exists():
        addresses = random_code_addresses(LIBC, 2000, seed=5)
        modules[ModuleRef(read_build_id(str(LIBC)), str(LIBC))] = (addresses, [False] * len(addresses))
    serial = Symbolizer(cache_dir=tmp_path / "serial", jobs=1).symbolize_many(modules)
    parallel_symbolizer = Symbolizer(cache_dir=tmp_path / "parallel", jobs=2, min_parallel_addresses=1)
    try:
        parallel = parallel_symbolizer.symbolize_many(modules)
    finally:
        parallel_symbolizer.close()
    assert parallel == serial


def test_arrow_table_equals_frame_lists(libs, tmp_path):
    addresses = function_addresses(libs.c_lib) + [0x7FFF_FFFF_0000]
    exact = [i % 2 == 0 for i in range(len(addresses))]
    addresses[1], exact[1] = 0, False  # a return address of 0: invalid
    ref = ModuleRef(libs.c_build_id, str(libs.c_lib))
    symbolizer = Symbolizer(cache_dir=tmp_path, jobs=1, debug_roots=[])
    lists = symbolizer.symbolize_module(ref, addresses, exact)
    table = symbolizer.symbolize_arrow({ref: (np.asarray(addresses, dtype=np.uint64), np.asarray(exact))})
    assert table.schema.names == arrow_schema().names
    plain = symbolizer.symbolize_arrow({ref: (addresses, exact)}, dictionary=False)
    assert plain.schema == arrow_schema()
    rows = plain.to_pylist()
    cursor = 0
    for frames in lists:
        for depth, frame in enumerate(frames):
            row = rows[cursor]
            cursor += 1
            assert row["depth"] == depth
            assert (row["function"], row["file"], row["line"], row["inlined"], row["reason"]) == (
                frame.function,
                frame.file,
                frame.line,
                frame.inlined,
                frame.reason,
            )
    assert cursor == len(rows)
    assert [r["address"] for r in rows if r["depth"] == 0] == addresses
    assert table.cast(arrow_schema()).equals(plain)


def test_threaded_lookups_equal_one_thread_and_python_api(libs):
    """The extension's SymCache lookups on several threads give exactly what one thread gives,
    and what symbolic's own Python API says, frame by frame."""
    from array import array

    from symbolic.symcache import SymCache

    from tbpipe.pipeline.symbols.symcache import SymCacheReader, build_symcache

    data, _features = build_symcache(str(libs.cxx_lib), None)
    keys = array("Q", random_code_addresses(str(libs.cxx_lib), 20_000, seed=5))
    one, several = SymCacheReader(data), SymCacheReader(data)
    columns_one = one.resolve(keys, -1, 1)
    columns_several = several.resolve(keys, -1, 4)
    assert columns_one[:7] == columns_several[:7] and columns_one[7:] == columns_several[7:]
    assert one.strings == several.strings

    reference = SymCache.from_bytes(data)
    for key, frames in zip(keys[::97], one.lookup_many(keys[::97])):
        expected = [(f.symbol or None, f.full_path or None, f.line) for f in reference.lookup(key)]
        assert frames == expected, hex(key)


def test_symbolic_abi_mismatch_is_refused():
    from symbolic._lowlevel import ffi
    from symbolic.symcache import SymCache

    from tbpipe import _native
    from tbpipe.pipeline.symbols.symcache import _abi_layout

    layout = _abi_layout(ffi)
    layout["line"] += 4
    with pytest.raises(ValueError, match="C ABI"):
        _native.SymCacheLookup(SymCache, 1, 1, 1, 1, layout)


def test_result_chunk_round_trip():
    chunk = ResultChunk.from_resolved(
        [
            (0x10, [("f", "a.c", 3, True), ("g", "a.c", 9, False)], None),
            (0x20, [], "no debug info"),
            (0x30, [("ünïcode::名前", None, 0, False)], "symbols only"),
        ]
    )
    again = ResultChunk.from_bytes(chunk.to_bytes())
    table = KnownTable()
    table.add(again)
    assert table.frames_of(table.position[0x10]) == [("f", "a.c", 3, True), ("g", "a.c", 9, False)]
    assert table.frames_of(table.position[0x20]) == [] and table.reason_of(table.position[0x20]) == "no debug info"
    assert table.frames_of(table.position[0x30]) == [("ünïcode::名前", None, 0, False)]
    with pytest.raises(ValueError):
        ResultChunk.from_bytes(chunk.to_bytes()[:-7])


def test_progress_bar_runs(capsys):
    with DelayedProgress(enabled=True, show_after=0.0) as progress:
        progress.add("work", 3)
        for _ in range(3):
            progress.advance("work")
    assert capsys.readouterr().out == ""  # the bar went to stderr
