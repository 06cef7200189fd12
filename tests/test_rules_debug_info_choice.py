"""Which debug-info candidate wins (pipeline/symbols/debuginfo.py) and how the outcome is said: the
first candidate with DWARF, else the first with symbol tables, else none; build-IDs as the store keys
them and as messages abbreviate them; a module's status kept and read back unchanged."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import threading
import time
import zlib

import pytest

from tbpipe.pipeline.symbols.debuginfo import Candidate, DebugInfoLocator, Located, _Search
from tbpipe.pipeline.symbols.debuginfod import DebuginfodClient
from tbpipe.pipeline.symbols.dirindex import DebugDirIndex
from tbpipe.pipeline.symbols.elf import ElfFacts, inspect_elf
from tbpipe.pipeline.symbols.model import (
    BadBuildIdError,
    ElfFileError,
    ModuleStatus,
    Quality,
    normalize_build_id,
    short_build_id,
)
from tbpipe.pipeline.symbols.store import SymbolStore

BUILD_ID = "ab" * 20


def candidate(path: str, dwarf: bool = False, symtab: bool = False, dynsym: bool = False) -> Candidate:
    facts = ElfFacts(
        path=path, build_id=BUILD_ID, has_dwarf=dwarf, has_symtab=symtab, has_dynsym=dynsym, debuglink=None
    )
    return Candidate(path=path, via="debug-dir", facts=facts)


def test_a_candidates_quality_is_dwarf_else_either_symbol_table_else_none() -> None:
    assert candidate("a", dwarf=True).quality is Quality.DWARF
    assert candidate("a", symtab=True).quality is Quality.SYMBOLS
    assert candidate("a", dynsym=True).quality is Quality.SYMBOLS
    assert candidate("a").quality is Quality.NONE
    assert [q.rank for q in (Quality.NONE, Quality.SYMBOLS, Quality.DWARF)] == [0, 1, 2]


def test_the_first_dwarf_candidate_wins_and_ends_the_search() -> None:
    search = _Search(BUILD_ID, None)
    assert search.offer(candidate("symbols", symtab=True)) is False
    assert search.offer(candidate("nothing")) is False
    assert search.offer(candidate("dwarf", dwarf=True)) is True
    located = search.finish()
    assert (located.chosen.path, located.quality) == ("dwarf", Quality.DWARF)


def test_without_dwarf_the_first_candidate_with_symbols_wins() -> None:
    search = _Search(BUILD_ID, "/lib/m.so")
    for offered in (candidate("none"), candidate("first", dynsym=True), candidate("second", symtab=True)):
        assert search.offer(offered) is False
    assert search.done is False
    assert search.finish().chosen.path == "first"
    empty = _Search(BUILD_ID, None)
    empty.offer(candidate("none"))
    assert empty.finish().chosen is None and empty.finish().quality is Quality.NONE


def test_the_reason_says_where_dwarf_came_from_or_where_it_was_looked_for() -> None:
    dwarf = Located(BUILD_ID, candidate("/dbg/m.debug", dwarf=True), ["a: no such file"])
    assert dwarf.reason() == "DWARF from /dbg/m.debug (via debug-dir)"
    symbols = Located(BUILD_ID, candidate("/lib/m.so", symtab=True), ["a: no such file", "b: symbols only"])
    assert symbols.reason() == (
        "symbols only for build-ID abababababab…: no DWARF found (looked in: a: no such file; b: symbols only)"
    )
    assert Located(BUILD_ID, None).reason() == "no debug info for build-ID abababababab… (looked in: nowhere)"
    assert Located(BUILD_ID, candidate("x")).reason() == "no debug info for build-ID abababababab… (looked in: nowhere)"


def test_short_build_ids_are_kept_whole_up_to_sixteen_digits() -> None:
    assert short_build_id("0123456789abcdef") == "0123456789abcdef"
    assert short_build_id("0123456789abcdef0") == "0123456789ab…"


@pytest.mark.parametrize(("given", "normal"), [(" 0xABCD ", "abcd"), ("ab" * 64, "ab" * 64), ("0X12cd", "12cd")])
def test_build_ids_are_lower_case_hex_without_0x(given, normal) -> None:
    assert normalize_build_id(given) == normal


@pytest.mark.parametrize("given", ["abc", "ab", "xyzw", "", "0x", "ab cd"])
def test_a_build_id_that_cannot_be_one_is_refused_naming_it(given) -> None:
    with pytest.raises(BadBuildIdError, match=f"invalid build-ID {given!r}: expected 4..128 hex digits"):
        normalize_build_id(given)


def test_long_garbage_build_ids_are_shortened_in_the_message_and_non_text_is_named() -> None:
    with pytest.raises(BadBuildIdError) as raised:
        normalize_build_id("z" * 81)
    assert f"'{'z' * 77}...'" in str(raised.value)
    with pytest.raises(BadBuildIdError, match=f"invalid build-ID '{'z' * 80}': "):  # 80 kept whole
        normalize_build_id("z" * 80)
    with pytest.raises(BadBuildIdError, match="expected 4..128 hex digits"):
        normalize_build_id("ab" * 65)
    with pytest.raises(BadBuildIdError, match="build-ID must be a hex string, not int"):
        normalize_build_id(12)


def test_a_module_status_reads_back_as_it_was_kept() -> None:
    status = ModuleStatus(
        build_id=BUILD_ID,
        quality=Quality.SYMBOLS,
        reason="symbols only",
        debug_file="/lib/m.so",
        found_via="module",
        module_path="/lib/m.so",
        looked_in=["a", "b"],
        source_key="k",
        debug_identity=["/lib/m.so", 1, 2, 3, 4],
        segments=[(0, 4096, 5), (8192, 16, 6)],
        upgraded_from=Quality.NONE,
        checked_at=12.5,
    )
    assert ModuleStatus.from_json(status.to_json()) == status
    assert status.describe() == f"{BUILD_ID}: symbols: symbols only"
    bare = ModuleStatus.from_json({"build_id": BUILD_ID, "quality": "none"})
    assert bare == ModuleStatus(BUILD_ID, Quality.NONE, "")
    assert bare.to_json()["debug_identity"] is None and bare.to_json()["upgraded_from"] is None


# ------------------------------------------------------------------ the debuginfod client cache's step


@pytest.fixture(scope="module")
def elf(tmp_path_factory):
    """A tiny shared object with DWARF, its stripped copy (dynamic symbols only) and their build-ID."""
    folder = tmp_path_factory.mktemp("elf")
    (folder / "m.c").write_text("int tb_answer(int x) { return x + 42; }\n")
    full, stripped = folder / "m.so", folder / "m-stripped.so"
    subprocess.run(["gcc", "-g", "-shared", "-fPIC", "-Wl,--build-id=sha1", "-o", full, folder / "m.c"], check=True)
    subprocess.run(["strip", "--strip-all", "-o", stripped, full], check=True)
    return full, stripped, inspect_elf(str(full)).build_id


def cache_file(cache, build_id: str, kind: str, source=None, age_s: float | None = None) -> str:
    """`<cache>/<id>/<kind>`: a copy of `source`, or an empty file (a negative entry) `age_s` old."""
    path = cache / build_id / kind
    path.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        path.write_bytes(b"")
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    else:
        shutil.copy(source, path)
    return str(path)


def locator(cache, client=None) -> DebugInfoLocator:
    return DebugInfoLocator(debug_roots=[], debuginfod_cache=str(cache), debuginfod=client)


def test_the_cache_debuginfo_with_dwarf_is_chosen_before_the_module(elf, tmp_path) -> None:
    full, stripped, build_id = elf
    path = cache_file(tmp_path, build_id, "debuginfo", full)
    located = locator(tmp_path).locate(build_id, str(stripped))
    assert (located.chosen.path, located.chosen.via, located.quality) == (path, "debuginfod-cache", Quality.DWARF)
    assert located.looked_in == [f"{path}: DWARF"]
    assert located.module is None  # the search ended before the module's own file


def test_a_negative_entry_is_said_with_its_age_and_the_module_still_searched(elf, tmp_path) -> None:
    _full, stripped, build_id = elf
    path = cache_file(tmp_path, build_id, "debuginfo", age_s=300)
    located = locator(tmp_path).locate(build_id, str(stripped))
    assert located.looked_in[0] == f"{path}: negative cache entry (the servers had none 300 s ago)"
    assert located.looked_in[1:] == [f"module file {stripped}: symbols only"]
    assert (located.chosen.path, located.chosen.via, located.quality) == (str(stripped), "module", Quality.SYMBOLS)
    assert located.module.build_id == build_id


def test_with_servers_to_ask_a_negative_entry_is_the_servers_step_to_say(elf, tmp_path) -> None:
    _full, stripped, build_id = elf
    path = cache_file(tmp_path, build_id, "debuginfo", age_s=300)
    client = DebuginfodClient([], str(tmp_path), progress=False)
    located = locator(tmp_path, client).locate(build_id, str(stripped))
    assert not any(line.startswith(path) for line in located.looked_in)
    assert any(f"negative cache entry {path}" in line for line in located.looked_in)
    assert located.chosen.path == str(stripped)


def test_a_missing_module_is_looked_for_as_the_caches_executable(elf, tmp_path) -> None:
    _full, stripped, build_id = elf
    gone = str(tmp_path / "gone.so")
    executable = cache_file(tmp_path, build_id, "executable", stripped)
    located = locator(tmp_path).locate(build_id, gone)
    debuginfo = os.path.join(str(tmp_path), build_id, "debuginfo")
    assert located.looked_in == [
        f"{debuginfo}: no such file",
        f"module file {gone}: no such file",
        f"executable {executable}: symbols only",
    ]
    assert (located.chosen.path, located.chosen.via) == (executable, "debuginfod-cache")
    assert located.module.build_id == build_id
    # Without a module path at all, the same.
    assert locator(tmp_path).locate(build_id).chosen.path == executable


def test_the_caches_executable_is_not_looked_for_while_the_module_is_there_or_when_absent(elf, tmp_path) -> None:
    _full, stripped, build_id = elf
    cache_file(tmp_path, build_id, "executable", stripped)
    located = locator(tmp_path).locate(build_id, str(stripped))
    assert located.looked_in[1:] == [f"module file {stripped}: symbols only"]
    assert located.chosen.via == "module"
    empty = tmp_path / "empty"
    gone = str(tmp_path / "gone.so")
    located = locator(empty).locate(build_id, gone)
    assert located.looked_in == [f"{empty / build_id / 'debuginfo'}: no such file", f"module file {gone}: no such file"]
    assert located.chosen is None and located.module is None


def test_a_negative_entry_for_the_executable_is_said_too(elf, tmp_path) -> None:
    _full, _stripped, build_id = elf
    path = cache_file(tmp_path, build_id, "executable", age_s=7)
    located = locator(tmp_path).locate(build_id, None)
    assert located.looked_in[-1] == f"{path}: negative cache entry (the servers had none 7 s ago)"
    assert located.chosen is None


def test_locate_is_locate_many_of_one(elf, tmp_path) -> None:
    _full, stripped, build_id = elf
    one = locator(tmp_path).locate(build_id, str(stripped))
    (many,) = locator(tmp_path).locate_many([(build_id, str(stripped))])
    assert one == many and one.chosen.path == str(stripped)


# ------------------------------------------------------------------ the --debug-dir index


def test_the_index_finds_elf_files_recursively_dwarf_first_then_symbols_then_by_path(elf, tmp_path) -> None:
    full, stripped, build_id = elf
    (tmp_path / "a" / "b").mkdir(parents=True)
    shutil.copy(stripped, tmp_path / "a" / "0-stripped.so")
    shutil.copy(full, tmp_path / "a" / "b" / "z-full.so")
    shutil.copy(full, tmp_path / "y-full.so")
    (tmp_path / "notes.txt").write_text("not an ELF file")
    (tmp_path / "bad.so").write_bytes(b"\x7fELF" + b"\0" * 12)
    index = DebugDirIndex(tmp_path, None)
    report = index.refresh()
    assert [entry.path for entry in index.lookup(build_id)] == [
        str(tmp_path / "a" / "b" / "z-full.so"),
        str(tmp_path / "y-full.so"),
        str(tmp_path / "a" / "0-stripped.so"),
    ]
    assert [(e.has_dwarf, e.has_symbols, e.build_id) for e in index.lookup(build_id)] == [
        (True, True, build_id),
        (True, True, build_id),
        (False, True, build_id),
    ]
    assert (report.files, report.elf_files, report.opened, len(index)) == (5, 3, 5, 3)
    assert len(report.problems) == 1 and report.problems[0].startswith(str(tmp_path / "bad.so"))
    assert index.lookup("cd" * 20) == []


def test_a_refresh_opens_only_new_or_changed_files_and_the_kept_index_is_read_back(elf, tmp_path) -> None:
    full, stripped, build_id = elf
    folder, kept = tmp_path / "dbg", tmp_path / "index.json"
    folder.mkdir()
    shutil.copy(full, folder / "m.so")
    shutil.copy(stripped, folder / "s.so")
    assert DebugDirIndex(folder, kept).refresh().opened == 2
    again = DebugDirIndex(folder, kept)
    assert len(again) == 2  # read back before any refresh
    shutil.copy(full, folder / "s.so")  # changed: now with DWARF
    report = again.refresh()
    assert (report.files, report.opened, report.elf_files) == (2, 1, 2)
    assert [e.has_dwarf for e in again.lookup(build_id)] == [True, True]
    (folder / "m.so").unlink()
    assert [e.path for e in again.lookup(build_id)] == [str(folder / "m.so"), str(folder / "s.so")]
    again.refresh()  # a refresh forgets the removed file
    assert [e.path for e in again.lookup(build_id)] == [str(folder / "s.so")]
    # An index kept for another folder, or of another version, is not read.
    other = tmp_path / "other"
    other.mkdir()
    assert len(DebugDirIndex(other, kept)) == 0
    kept.write_text(kept.read_text().replace('"version": 1', '"version": 2'))
    assert len(DebugDirIndex(folder, kept)) == 0
    kept.write_text("{not json")
    assert len(DebugDirIndex(folder, kept)) == 0


def test_symlink_loops_dangling_links_and_a_missing_folder_are_reported(elf, tmp_path) -> None:
    full, _stripped, build_id = elf
    (tmp_path / "sub").mkdir()
    shutil.copy(full, tmp_path / "sub" / "m.so")
    (tmp_path / "sub" / "up").symlink_to(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    index = DebugDirIndex(tmp_path, None)
    report = index.refresh()
    assert sorted(report.problems) == [
        f"{tmp_path / 'dangling'}: No such file or directory",
        f"{tmp_path / 'sub' / 'up'}: symlink loop (directory already indexed)",
    ]
    assert (report.files, report.elf_files) == (1, 1)
    assert len(index.lookup(build_id)) == 1
    missing = DebugDirIndex(tmp_path / "nothing", None)
    report = missing.refresh()
    assert report.problems == [f"{tmp_path / 'nothing'}: No such file or directory"]
    assert len(missing) == 0


# ------------------------------------------------------------------ the servers' step


@pytest.fixture
def server(tmp_path):
    """An HTTP server with debuginfod's layout (`/buildid/<id>/<kind>`) over a folder; its URL and folder."""
    folder = tmp_path / "served"
    folder.mkdir()
    handler = functools.partial(QuietHandler, directory=str(folder))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}", folder
        httpd.shutdown()
        thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def served(folder, build_id: str, kind: str, source) -> None:
    (folder / "buildid" / build_id).mkdir(parents=True, exist_ok=True)
    shutil.copy(source, folder / "buildid" / build_id / kind)


def test_the_servers_are_asked_last_for_debuginfo_and_their_dwarf_wins(elf, server, tmp_path) -> None:
    full, stripped, build_id = elf
    url, folder = server
    served(folder, build_id, "debuginfo", full)
    cache = tmp_path / "cache"
    client = DebuginfodClient([url], str(cache), progress=False)
    located = locator(cache, client).locate(build_id, str(stripped))
    path = str(cache / build_id / "debuginfo")
    assert (located.chosen.path, located.chosen.via, located.quality) == (path, f"debuginfod {url}", Quality.DWARF)
    assert located.looked_in[:2] == [f"{path}: no such file", f"module file {stripped}: symbols only"]
    assert located.looked_in[2].startswith(f"debuginfod {url}: 200, ")
    assert located.looked_in[3:] == [f"{path}: DWARF"]
    assert located.module.build_id == build_id


def test_the_executable_is_asked_for_only_where_the_module_is_missing_and_nothing_else_was_found(
    elf, server, tmp_path
) -> None:
    _full, stripped, build_id = elf
    url, folder = server
    served(folder, build_id, "executable", stripped)
    cache = tmp_path / "cache"
    client = DebuginfodClient([url], str(cache), progress=False)
    gone = str(tmp_path / "gone.so")
    present, missing = locator(cache, client).locate_many([(build_id, str(stripped)), (build_id, gone)])
    assert present.chosen.path == str(stripped) and not any("(executable)" in line for line in present.looked_in)
    executable = str(cache / build_id / "executable")
    assert missing.looked_in[-2].startswith(f"debuginfod {url} (executable): 200, ")
    assert missing.looked_in[-1] == f"executable {executable}: symbols only"
    assert (missing.chosen.path, missing.chosen.via, missing.quality) == (
        executable,
        f"debuginfod {url}",
        Quality.SYMBOLS,
    )
    assert missing.module.build_id == build_id
    # A server without the file: 404 for both, no file, nothing chosen.
    other = "cd" * 20
    (located,) = locator(cache, client).locate_many([(other, gone)])
    assert [line.split(": ")[1].split(" in ")[0] for line in located.looked_in[-2:]] == ["404 not found"] * 2
    assert located.looked_in[-1].startswith(f"debuginfod {url} (executable): ")
    assert located.chosen is None and located.module is None


# ------------------------------------------------------------------ the local places, in order


def sh(*command) -> None:
    subprocess.run([str(part) for part in command], check=True)


@pytest.fixture(scope="module")
def linked(elf, tmp_path_factory):
    """Debug files and modules that name them by `.gnu_debuglink`: {name: path}."""
    full, _stripped, _build_id = elf
    folder = tmp_path_factory.mktemp("linked")
    out = {"debug": folder / "m.debug", "module": folder / "lib" / "m.so"}
    (folder / "lib").mkdir()
    sh("objcopy", "--only-keep-debug", full, out["debug"])
    sh("objcopy", "--strip-debug", f"--add-gnu-debuglink={out['debug']}", full, out["module"])
    # A debug file without a build-ID note, and a module whose debuglink names it.
    (folder / "bare").mkdir()
    out["bare_debug"] = folder / "bare" / "m.debug"
    sh("objcopy", "--remove-section=.note.gnu.build-id", out["debug"], out["bare_debug"])
    out["bare_module"] = folder / "bare" / "m.so"
    sh("objcopy", "--strip-debug", f"--add-gnu-debuglink={out['bare_debug']}", full, out["bare_module"])
    # Another build of the same name (another build-ID), and a module whose debuglink names it.
    (folder / "other.c").write_text("int tb_answer(int x) { return x + 43; }\n")
    other = folder / "other.so"
    sh("gcc", "-g", "-shared", "-fPIC", "-Wl,--build-id=sha1", "-o", other, folder / "other.c")
    (folder / "other").mkdir()
    out["other_debug"] = folder / "other" / "m.debug"
    sh("objcopy", "--only-keep-debug", other, out["other_debug"])
    out["other_module"] = folder / "other" / "m.so"
    sh("objcopy", "--strip-debug", f"--add-gnu-debuglink={out['other_debug']}", full, out["other_module"])
    # A static program with a symbol table, and stripped: no symbol table of either kind.
    (folder / "bare.c").write_text("void _start(void) { for (;;) {} }\n")
    out["nothing"], out["nothing_symbols"] = folder / "nothing", folder / "nothing-symbols"
    sh("gcc", "-nostdlib", "-static", "-Wl,--build-id=sha1", "-o", out["nothing_symbols"], folder / "bare.c")
    sh("strip", "--strip-all", "-o", out["nothing"], out["nothing_symbols"])
    return out


def crc(path) -> str:
    return f"{zlib.crc32(open(path, 'rb').read()):08x}"


def copy(source, target) -> str:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy(source, target)
    return str(target)


def local(tmp_path, **kwargs) -> DebugInfoLocator:
    kwargs.setdefault("debug_roots", [])
    return DebugInfoLocator(debuginfod_cache=str(tmp_path / "cache"), **kwargs)


def test_the_debuglink_is_looked_for_beside_the_module_in_dot_debug_then_under_each_root(elf, linked, tmp_path) -> None:
    _full, _stripped, build_id = elf
    module = copy(linked["module"], tmp_path / "lib" / "m.so")
    roots = [tmp_path / "r1", tmp_path / "r2"]
    lib = str(tmp_path / "lib").lstrip("/")
    places = [tmp_path / "lib" / "m.debug", tmp_path / "lib" / ".debug" / "m.debug"]
    places += [root / lib / "m.debug" for root in roots]
    for place in places:
        (tmp_path / "cache").mkdir(exist_ok=True)
        debug = copy(linked["debug"], place)
        located = local(tmp_path, debug_roots=roots).locate(build_id, module)
        assert (located.chosen.path, located.chosen.via, located.quality) == (debug, "debuglink", Quality.DWARF)
        build_id_dir = [str(root / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug") for root in roots]
        assert located.looked_in == [f"{path}: no such file" for path in build_id_dir] + [
            f"{tmp_path / 'cache' / build_id / 'debuginfo'}: no such file",
            f"module file {module}: symbols only",
        ] + [f"{path}: no such file" for path in places[: places.index(place)]] + [f"{debug}: DWARF"]
        os.unlink(debug)


def test_a_debuglink_file_must_match_its_crc_and_its_build_id_if_it_has_one(elf, linked, tmp_path) -> None:
    full, _stripped, build_id = elf
    module = copy(linked["module"], tmp_path / "lib" / "m.so")
    wrong = copy(full, tmp_path / "lib" / "m.debug")  # same build-ID, other bytes
    located = local(tmp_path).locate(build_id, module)
    assert f"{wrong}: CRC32 {crc(wrong)} does not match the debuglink's {crc(linked['debug'])}" in located.looked_in
    assert located.chosen.path == module
    # Without a build-ID note, the CRC alone decides; with another build-ID, never.
    bare = local(tmp_path).locate(build_id, str(linked["bare_module"]))
    assert (bare.chosen.path, bare.quality) == (str(linked["bare_debug"]), Quality.DWARF)
    other = local(tmp_path).locate(build_id, str(linked["other_module"]))
    other_id = inspect_elf(str(linked["other_debug"])).build_id
    assert f"{linked['other_debug']}: build-ID mismatch (file has {other_id[:12]}…)" in other.looked_in
    assert other.chosen.path == str(linked["other_module"])


def test_a_debuglink_naming_the_module_itself_is_not_read_again(elf, linked, tmp_path) -> None:
    _full, _stripped, build_id = elf
    module = copy(linked["module"], tmp_path / "lib" / "m.debug")  # the module has its debug file's name
    dotted = copy(linked["debug"], tmp_path / "lib" / ".debug" / "m.debug")
    located = local(tmp_path).locate(build_id, module)
    assert located.looked_in[-2:] == [f"module file {module}: symbols only", f"{dotted}: DWARF"]


def test_the_build_id_tree_refuses_files_of_another_build_or_without_a_note(elf, linked, tmp_path) -> None:
    _full, stripped, build_id = elf
    root = tmp_path / "root"
    place = root / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug"
    for source, said in [
        (
            linked["other_debug"],
            f"build-ID mismatch (file has {inspect_elf(str(linked['other_debug'])).build_id[:12]}…)",
        ),
        (linked["bare_debug"], "has no build-ID note"),
    ]:
        copy(source, place)
        located = local(tmp_path, debug_roots=[root]).locate(build_id, str(stripped))
        assert located.looked_in[0] == f"{place}: {said}"
        assert located.chosen.path == str(stripped)
    place.write_bytes(b"\x7fELF" + b"\0" * 12)
    located = local(tmp_path, debug_roots=[root]).locate(build_id, None)
    assert located.looked_in[0].startswith(f"{place}: ") and located.chosen is None
    copy(linked["debug"], place)
    located = local(tmp_path, debug_roots=[root]).locate(build_id, str(stripped))
    assert (located.chosen.path, located.chosen.via, located.looked_in) == (
        str(place),
        "build-id-dir",
        [f"{place}: DWARF"],
    )


def test_debug_dirs_come_first_and_say_when_they_have_nothing(elf, linked, tmp_path) -> None:
    full, stripped, build_id = elf
    empty, found = tmp_path / "empty", tmp_path / "found"
    empty.mkdir()
    copy(full, found / "x" / "m.so")
    located = local(tmp_path, debug_dirs=[empty]).locate(build_id, str(stripped))
    assert located.looked_in[0] == f"--debug-dir {empty}: no file with this build-ID"
    located = local(tmp_path, debug_dirs=[empty, found]).locate(build_id, str(stripped))
    assert (located.chosen.path, located.chosen.via) == (str(found / "x" / "m.so"), "debug-dir")
    assert located.looked_in == [f"{found / 'x' / 'm.so'}: DWARF"]
    # Of a debug dir's files with symbols only, the first is kept while later places are searched.
    only = copy(stripped, tmp_path / "only" / "s.so")
    located = local(tmp_path, debug_dirs=[tmp_path / "only"]).locate(build_id, str(linked["module"]))
    assert (located.chosen.path, located.chosen.via) == (only, "debug-dir")
    assert f"module file {linked['module']}: symbols only" in located.looked_in
    assert located.looked_in[-1] == f"{linked['module'].parent / '.debug' / 'm.debug'}: no such file"


def test_a_module_without_symbols_is_no_candidate_but_still_the_module(linked, tmp_path) -> None:
    nothing = str(linked["nothing"])
    build_id = inspect_elf(nothing).build_id
    located = local(tmp_path).locate(build_id, nothing)
    assert located.looked_in[-1] == f"module file {nothing}: no symbols or DWARF"
    assert located.chosen is None and located.module.build_id == build_id
    executable = copy(nothing, tmp_path / "cache" / build_id / "executable")
    located = local(tmp_path).locate(build_id, str(tmp_path / "gone"))
    assert located.looked_in[-1] == f"executable {executable}: no symbols or DWARF"
    assert located.chosen is None and located.module.build_id == build_id


def test_every_debug_dir_is_named_and_a_file_gone_since_the_index_is_passed_over(elf, linked, tmp_path) -> None:
    full, stripped, build_id = elf
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    located = local(tmp_path, debug_dirs=[first, second]).locate(build_id, str(stripped))
    assert located.looked_in[0] == f"--debug-dir {first}, {second}: no file with this build-ID"
    gone = copy(full, second / "m.so")
    search = local(tmp_path, debug_dirs=[second])
    search.indexes()  # indexed now; the file goes before the search
    os.unlink(gone)
    located = search.locate(build_id, str(stripped))
    assert located.looked_in[0] == f"{gone}: no such file"
    assert located.chosen.path == str(stripped)


def test_a_damaged_file_is_said_as_the_elf_reader_says_it(elf, tmp_path) -> None:
    _full, _stripped, build_id = elf
    root = tmp_path / "root"
    place = root / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug"
    place.parent.mkdir(parents=True)
    place.write_bytes(b"\x7fELF" + b"\0" * 12)
    with pytest.raises(ElfFileError) as raised:
        inspect_elf(str(place))
    located = local(tmp_path, debug_roots=[root]).locate(build_id, None)
    assert located.looked_in[0] == str(raised.value)


def test_what_the_search_read_is_remembered_and_gives_the_same_choice(elf, linked, tmp_path) -> None:
    _full, _stripped, build_id = elf
    module = copy(linked["module"], tmp_path / "lib" / "m.so")
    debug = copy(linked["debug"], tmp_path / "lib" / "m.debug")
    store = SymbolStore(tmp_path / "store")
    first, again = (local(tmp_path, memo=store).locate(build_id, module) for _ in range(2))
    assert first == again
    assert (again.chosen.path, again.chosen.via, again.quality) == (debug, "debuglink", Quality.DWARF)


def test_a_module_without_symbols_gets_no_executable_from_the_servers(linked, server, tmp_path) -> None:
    url, folder = server
    nothing = str(linked["nothing"])
    build_id = inspect_elf(nothing).build_id
    served(folder, build_id, "executable", nothing)
    client = DebuginfodClient([url], str(tmp_path / "cache"), progress=False)
    located = local(tmp_path, debuginfod=client).locate(build_id, nothing)
    assert located.looked_in[-1].startswith(f"debuginfod {url}: 404 not found in ")
    assert not any("(executable)" in line for line in located.looked_in)


def test_a_kept_index_answers_before_any_refresh_and_a_refresh_reports_itself(elf, tmp_path) -> None:
    full, _stripped, build_id = elf
    folder, kept = tmp_path / "dbg", tmp_path / "index.json"
    copy(full, folder / "m.so")
    DebugDirIndex(folder, kept).refresh()
    again = DebugDirIndex(folder, kept)
    assert again.report is None
    assert [e.path for e in again.lookup(build_id)] == [str(folder / "m.so")]
    report = again.refresh()
    assert again.report is report and report.directory == str(folder)
    # A folder gone since: nothing found, the problem reported.
    shutil.rmtree(folder)
    report = again.refresh()
    assert again.report is report and again.lookup(build_id) == [] and len(again) == 0


def test_linked_files_and_folders_are_indexed_and_other_entries_passed_over(elf, linked, tmp_path) -> None:
    full, stripped, build_id = elf
    root, outside = tmp_path / "dbg", tmp_path / "outside"
    for i in range(8):
        copy(stripped, root / f"a{i}.txt")  # ELF files whatever their names
    os.mkfifo(root / "fifo")
    copy(stripped, root / "sub" / "c.so")
    (root / "sub" / "up").symlink_to(root)  # a loop
    for i in range(8):
        copy(stripped, root / f"b{i}.txt")
    copy(full, outside / "m.so")
    (root / "linked.so").symlink_to(outside / "m.so")
    (root / "again").symlink_to(root / "sub")  # a folder already indexed by another name
    index = DebugDirIndex(root, None)
    report = index.refresh()
    assert (report.files, report.elf_files) == (18, 18)  # sub/c.so once, by whichever name came first
    assert index.lookup(build_id)[0].path == str(root / "linked.so")
    assert report.problems and all(p.endswith("symlink loop (directory already indexed)") for p in report.problems)


def test_of_files_without_dwarf_those_with_symbols_come_first(linked, tmp_path) -> None:
    nothing = str(linked["nothing"])
    build_id = inspect_elf(nothing).build_id
    copy(nothing, tmp_path / "a-stripped")
    copy(linked["nothing_symbols"], tmp_path / "b-symbols")
    index = DebugDirIndex(tmp_path, None)
    index.refresh()
    assert [(e.path, e.has_symbols) for e in index.lookup(build_id)] == [
        (str(tmp_path / "b-symbols"), True),
        (str(tmp_path / "a-stripped"), False),
    ]
