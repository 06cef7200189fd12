"""Debug info from debuginfod servers: elfutils' real `debuginfod` started on a loopback port over a
folder of debug files (glibc's from libc6-dbg, and libraries built here and split with objcopy), and
a small server that answers wrongly on purpose (an error status, a cut body, a page that is not
ELF, another build-ID's file, no answer in time).

What is held: a stripped module's frames get the same answers from the server as from the local
debug file; the cache is elfutils' (its `debuginfod-find` and tbpipe each find what the other
downloaded, negative entries included); an ingest whose modules are settled asks nothing; a
build-ID a server learns later is fetched once its negative entry expires and its old frames are
redone; a bad or stopped server gets a line in the ingest's summary, the next server is asked, the
ingest goes on, and the cache never holds half a file.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import TBPIPE
from rich.console import Console
from support.debuginfod import DebuginfodServer, MisbehavingServer, cache_leftovers, debuginfod_missing, files_in
from support.synthetic import manifest_for, write_run
from symbols_data.testlib import LIBC, function_addresses, have_tools, our_chains, run

from tbpipe.pipeline.db import IngestOptions, ingest_runs
from tbpipe.pipeline.db.connection import open_database, query_rows
from tbpipe.pipeline.reports.ingest_summary import render_ingest_summary
from tbpipe.pipeline.symbols import ModuleRef, Quality, Symbolizer
from tbpipe.pipeline.symbols.debuginfod import DebuginfodClient, DebuginfodHooks, DebuginfodSettings
from tbpipe.pipeline.symbols.elf import read_build_id
from tbpipe.schemas import raw

# The server is installed by .ci/run: only a machine outside CI without it skips these tests.
_MISSING = debuginfod_missing() if not os.environ.get("CI") else ""
_MISSING = _MISSING or have_tools("gcc", "g++", "objcopy", "strip")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)

LIBC_DEBUG = Path("/usr/lib/debug/.build-id")


# ------------------------------------------------------------------------------ the modules and servers


class Module:
    """A library built here: stripped (what a run loaded), its debug file, its function addresses."""

    def __init__(self, unstripped: Path, stripped: Path, debug: Path):
        self.unstripped, self.stripped, self.debug = unstripped, stripped, debug
        self.build_id = read_build_id(str(stripped))

    def address_of(self, name: str) -> int:
        from elftools.elf.elffile import ELFFile

        with open(self.unstripped, "rb") as handle:
            return ELFFile(handle).get_section_by_name(".symtab").get_symbol_by_name(name)[0]["st_value"]


@pytest.fixture(scope="module")
def modules(libs, tmp_path_factory) -> dict[str, Module]:
    """c: the C test library; other: another build of it; cxx: the C++ one; each stripped and split."""
    root = tmp_path_factory.mktemp("debuginfod-modules")
    cxx_debug = root / "libtbcxx.debug"
    run("objcopy", "--only-keep-debug", libs.cxx_lib, cxx_debug)
    out = {"c": Module(libs.c_lib, libs.c_stripped, libs.c_debug)}
    for name, unstripped, debug in (("other", libs.other_lib, libs.other_debug), ("cxx", libs.cxx_lib, cxx_debug)):
        stripped = root / "stripped" / unstripped.name
        stripped.parent.mkdir(exist_ok=True)
        run("strip", "--strip-all", "-o", stripped, unstripped)
        out[name] = Module(unstripped, stripped, debug)
    return out


def libc_debug_file() -> Path:
    build_id = read_build_id(str(LIBC))
    path = LIBC_DEBUG / build_id[:2] / f"{build_id[2:]}.debug"
    assert path.exists(), f"{path}: glibc's debug file is missing (Debian: libc6-dbg, installed by .ci/run)"
    return path


def serve_copies(folder: Path, *files: Path) -> Path:
    """`files` placed in `folder` (linked where the filesystem allows, else copied), under their own names."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in files:
        target = folder / source.name
        try:
            os.link(source, target)
        except OSError:
            shutil.copy(source, target)
    return folder


def start_server(folder: Path, workdir: Path) -> DebuginfodServer:
    try:
        return DebuginfodServer(folder, workdir)
    except FileNotFoundError:
        pytest.fail("debuginfod is not installed, and CI is set: .ci/run installs it (Debian: debuginfod)")


@pytest.fixture(scope="module")
def server(modules, tmp_path_factory):
    """One server for the module: glibc's and the C library's debug files, and the other build's
    stripped file only (an executable without debug info)."""
    root = tmp_path_factory.mktemp("debuginfod-server")
    folder = serve_copies(root / "served", libc_debug_file(), modules["c"].debug, modules["other"].stripped)
    with start_server(folder, root / "server") as started:
        yield started


def settings(*urls: str, cache: Path, **kwargs) -> DebuginfodSettings:
    return DebuginfodSettings(urls=urls, environment=False, cache_dir=str(cache), **kwargs)


def native_run(runs: Path, name: str, frames: list[tuple[Module, str]]) -> Path:
    """A run of one event whose stack is `frames` (innermost first): (module, function), each at the
    function's address + 4 in the module's stripped file."""
    used = list(dict.fromkeys(module for module, _function in frames))
    stacks = pa.table(
        {
            "stack_id": pa.array([1], pa.uint64()),
            "thread_id": pa.array([1], pa.int64()),
            "status": pa.array([raw.STACK_NO_PYTHON], pa.uint32()),
            "native": pa.array(
                [
                    [
                        {"module": used.index(m), "offset": m.address_of(f) + 4, "flags": raw.NATIVE_FRAME_EXACT_PC}
                        for m, f in frames
                    ]
                ],
                raw.stacks_schema().field("native").type,
            ),
            "python": pa.array([[]], raw.stacks_schema().field("python").type),
        }
    )
    count = len(used)
    module_rows = pa.table(
        {
            "module_index": pa.array(range(count), pa.int32()),
            "path": [str(m.stripped) for m in used],
            "build_id": [m.build_id for m in used],
            "load_bias": pa.array([0] * count, pa.uint64()),
            "exec_ranges": pa.array([[]] * count, raw.modules_schema().field("exec_ranges").type),
            "eval_ranges": pa.array([[]] * count, raw.modules_schema().field("eval_ranges").type),
        }
    )
    events = pa.table(
        {
            "ts": pa.array([1_700_000_000_000_000_000], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
            "thread_id": pa.array([1], pa.int64()),
            "kind": ["kernel_launch"],
            "name": [name],
            "stack_id": pa.array([1], pa.uint64()),
            "attrs": pa.nulls(1, pa.string()),
        }
    )
    folder = runs / name
    write_run(
        folder,
        manifest_for(f"20260101T000000-1-{name}"),
        {"events": events, "stacks": stacks, "modules": module_rows, "code": raw.code_schema().empty_table()},
    )
    return folder


def ingest(tmp_path: Path, *dirs: Path, servers: DebuginfodSettings):
    return ingest_runs(
        list(dirs),
        IngestOptions(
            db_path=tmp_path / "t.duckdb", cache_dir=tmp_path / "store", progress=False, wait_s=30, debuginfod=servers
        ),
    )


def rows(tmp_path: Path, sql: str) -> list[tuple]:
    con = open_database(tmp_path / "t.duckdb", read_only=True)
    try:
        return query_rows(con, sql)
    finally:
        con.close()


def frames_of(tmp_path: Path, build_id: str) -> list[tuple]:
    """(function, file name, has a line) of the stored frames of one module, outermost of each chain."""
    return [
        (function, os.path.basename(file) if file else None, line is not None)
        for function, file, line in rows(
            tmp_path,
            f"SELECT DISTINCT function, file, line FROM stack_frames WHERE module_key = '{build_id}' AND NOT inlined "
            "ORDER BY function",
        )
    ]


def line_of(summary, url: str) -> str:
    lines = [line for line in summary.debuginfod if line.startswith(url + ":")]
    assert len(lines) == 1, summary.debuginfod
    return lines[0]


# ------------------------------------------------------------------------------ the same answers


def test_stripped_modules_symbolized_from_the_server_as_from_their_local_debug_files(modules, server, tmp_path):
    c = modules["c"]
    local_dir = serve_copies(tmp_path / "local", c.debug)
    cases = [
        # (module, addresses, where the local symbolizer finds its debug file)
        (ModuleRef(c.build_id, str(c.stripped)), function_addresses(c.unstripped), {"debug_dirs": [local_dir]}),
        (ModuleRef(read_build_id(str(LIBC)), str(LIBC)), _libc_addresses(), {"debug_roots": [LIBC_DEBUG.parent]}),
    ]
    cache = tmp_path / "debuginfod"
    before = server.requests()
    for ref, addresses, local_places in cases:
        local = Symbolizer(
            cache_dir=tmp_path / "store-local", jobs=1, debuginfod=settings(cache=cache, offline=True), **local_places
        )
        remote = Symbolizer(
            cache_dir=tmp_path / "store-remote", jobs=1, debug_roots=[], debuginfod=settings(server.url, cache=cache)
        )
        with local, remote:
            expected = our_chains(local.symbolize_module(ref, addresses))
            got = our_chains(remote.symbolize_module(ref, addresses))
            status = remote.module_status(ref.build_id, ref.path)
        assert status.quality is Quality.DWARF, status.describe()
        assert status.found_via == f"debuginfod {server.url}"
        assert status.debug_file == str(cache / ref.build_id / "debuginfo")
        assert any(chain and chain[0][2] for chain in expected), "the local file gave no lines: nothing compared"
        assert got == expected
    assert server.requests() - before == 2  # one file each; the modules are on this machine: no executable
    assert cache_leftovers(cache) == []


def _libc_addresses() -> list[int]:
    from support.addresses import sample_code_addresses

    return sample_code_addresses(str(LIBC), 3000, seed=5)


def test_a_module_not_on_this_machine_gets_its_executable(modules, server, tmp_path):
    """No debug info anywhere and no module file: the server's `/executable` gives its symbols."""
    other = modules["other"]
    ref = ModuleRef(other.build_id, "/gone/lib/libtbinline-other.so")
    with Symbolizer(
        cache_dir=tmp_path / "store", jobs=1, debug_roots=[], debuginfod=settings(server.url, cache=tmp_path / "d")
    ) as sym:
        (frames,) = sym.symbolize_module(ref, [other.address_of("tb_outer") + 4])
        status = sym.module_status(ref.build_id, ref.path)
    assert status.quality is Quality.SYMBOLS, status.describe()
    assert status.found_via == f"debuginfod {server.url}"
    assert status.debug_file == str(tmp_path / "d" / other.build_id / "executable")
    assert [f.function for f in frames] == ["tb_outer"]
    assert f"debuginfod {server.url}: 404 not found" in "\n".join(status.looked_in)
    assert any(line.startswith(f"debuginfod {server.url} (executable): 200, ") for line in status.looked_in)


# ------------------------------------------------------------------------------ elfutils' cache, both ways


def test_the_cache_is_shared_with_elfutils(modules, server, tmp_path):
    cache = tmp_path / "debuginfod"
    env = dict(os.environ, DEBUGINFOD_CACHE_PATH=str(cache), DEBUGINFOD_URLS=server.url)
    c, cxx, libc_id = modules["c"], modules["cxx"], read_build_id(str(LIBC))
    client = DebuginfodClient([server.url], str(cache))
    try:
        assert client.fetch(c.build_id).path == str(cache / c.build_id / "debuginfo")
        assert client.fetch(cxx.build_id).path is None  # 404: a negative entry, as elfutils writes them
    finally:
        client.close()
    asked = server.requests()

    # elfutils' client takes both from the cache: the file, and the negative entry (it asks nothing).
    found = subprocess.run(["debuginfod-find", "debuginfo", c.build_id], env=env, capture_output=True, text=True)
    assert (found.returncode, found.stdout.strip()) == (0, str(cache / c.build_id / "debuginfo")), found.stderr
    missing = subprocess.run(["debuginfod-find", "debuginfo", cxx.build_id], env=env, capture_output=True, text=True)
    assert missing.returncode != 0
    assert server.requests() == asked

    # What elfutils' client downloads, tbpipe reads from the cache without asking.
    fetched = subprocess.run(["debuginfod-find", "debuginfo", libc_id], env=env, capture_output=True, text=True)
    assert fetched.returncode == 0, fetched.stderr
    asked = server.requests()
    with Symbolizer(
        cache_dir=tmp_path / "store", jobs=1, debug_roots=[], debuginfod=settings(server.url, cache=cache)
    ) as sym:
        status = sym.module_status(libc_id, str(LIBC))
        unknown = sym.module_status(cxx.build_id, str(cxx.stripped))
    assert (status.quality, status.found_via) == (Quality.DWARF, "debuginfod-cache"), status.describe()
    assert status.debug_file == fetched.stdout.strip()
    assert unknown.quality is Quality.SYMBOLS
    assert "debuginfod: not asked: every server answered 404" in unknown.reason
    assert server.requests() == asked


# ------------------------------------------------------------------------------ ingests


def test_a_second_ingest_asks_nothing_and_a_build_id_known_later_is_fetched_after_its_negative_entry(modules, tmp_path):
    c, cxx = modules["c"], modules["cxx"]
    folder = serve_copies(tmp_path / "served", c.debug)
    cache = tmp_path / "debuginfod"
    runs = tmp_path / "runs"
    with start_server(folder, tmp_path / "server") as server:
        servers = settings(server.url, cache=cache)
        native_run(runs, "night1", [(c, "tb_outer"), (cxx, "tb_cxx_entry")])
        first = ingest(tmp_path, runs, servers=servers)
        assert first.ok
        assert server.requests() == 2
        assert line_of(first, server.url) == f"{server.url}: 1 file downloaded ({_size(c.debug)}); 1 not found"
        assert rows(tmp_path, "SELECT build_id, quality, found_via FROM symbol_coverage ORDER BY quality") == [
            (c.build_id, "dwarf", f"debuginfod {server.url}"),
            (cxx.build_id, "symbols", "module"),
        ]
        assert frames_of(tmp_path, c.build_id) == [("tb_outer", "inlines.c", True)]
        assert frames_of(tmp_path, cxx.build_id) == [("tb_cxx_entry", None, False)]

        # Another night with the same modules: nothing is asked, the unknown one is held by its negative entry.
        native_run(runs, "night2", [(c, "tb_second"), (cxx, "tb_cxx_entry")])
        second = ingest(tmp_path, runs, servers=servers)
        assert [o.status for o in second.outcomes] == ["present", "ingested"]
        assert server.requests() == 2
        assert second.debuginfod == [
            f"1 build-ID not asked: every server answered 404 within the last 10 min (negative cache in {cache})"
        ]

        # The server learns the C++ library's debug info; the negative entry ages past the cache's
        # own setting (elfutils' cache_miss_s, here 30 s): the next ingest asks again and redoes the frames.
        serve_copies(folder, cxx.debug)
        server.rescan()
        (cache / "cache_miss_s").write_text("30\n")
        yesterday = time.time() - 31
        os.utime(cache / cxx.build_id / "debuginfo", (yesterday, yesterday))
        third = ingest(tmp_path, servers=servers)
        assert server.requests() == 3
        assert third.refreshed_modules == [cxx.build_id]
        assert line_of(third, server.url) == f"{server.url}: 1 file downloaded ({_size(cxx.debug)})"
        assert frames_of(tmp_path, cxx.build_id) == [("tb_cxx_entry", "cxx.cpp", True)]
        assert files_in(cache) == {
            f"{c.build_id}/debuginfo": c.debug.stat().st_size,
            f"{cxx.build_id}/debuginfo": cxx.debug.stat().st_size,
        }


def _size(path: Path) -> str:
    from tbpipe.pipeline.progress import size_text

    return size_text(path.stat().st_size)


def test_offline_asks_nothing(modules, server, tmp_path):
    native_run(tmp_path / "runs", "r", [(modules["c"], "tb_outer")])
    before = server.requests()
    summary = ingest(tmp_path, tmp_path / "runs", servers=settings(server.url, cache=tmp_path / "d", offline=True))
    assert summary.ok and summary.debuginfod == []
    assert server.requests() == before
    assert rows(tmp_path, "SELECT quality FROM modules") == [("symbols",)]


class StopAfterFirstDownload(DebuginfodHooks):
    def __init__(self, server: DebuginfodServer):
        self.server = server
        self.answers: list[str] = []

    def answered(self, server, build_id, kind, attempt) -> None:
        self.answers.append(attempt.outcome)
        if attempt.outcome == "downloaded":
            self.server.stop()


def test_a_server_stopped_mid_ingest(modules, tmp_path):
    """The server goes away after its first file: the ingest goes on with what it has, says so,
    leaves no part of a file in the cache, and the next ingest (server back) redoes the rest."""
    mods = [modules["c"], modules["other"], modules["cxx"]]
    folder = serve_copies(tmp_path / "served", *(m.debug for m in mods))
    cache = tmp_path / "debuginfod"
    native_run(tmp_path / "runs", "r", [(mods[0], "tb_outer"), (mods[1], "tb_outer"), (mods[2], "tb_cxx_entry")])
    with start_server(folder, tmp_path / "server") as server:
        hooks = StopAfterFirstDownload(server)
        url = server.url
        summary = ingest(tmp_path, tmp_path / "runs", servers=settings(url, cache=cache, jobs=1, hooks=hooks))
        assert summary.ok
        assert hooks.answers == ["downloaded", "failed", "skipped"]
        line = line_of(summary, url)
        assert line.startswith(f"{url}: 1 file downloaded (")
        assert "failed for 1 (" in line and "cannot connect" in line and "not asked for 1 more" in line
        qualities = dict(rows(tmp_path, "SELECT build_id, quality FROM modules"))
        assert sorted(qualities.values()) == ["dwarf", "symbols", "symbols"]
        (fetched,) = [b for b, q in qualities.items() if q == "dwarf"]
        assert files_in(cache) == {
            f"{fetched}/debuginfo": next(m for m in mods if m.build_id == fetched).debug.stat().st_size
        }
        assert cache_leftovers(cache) == []

        server.start()  # back, on another port
        again = ingest(tmp_path, servers=settings(server.url, cache=cache))
        assert sorted(again.refreshed_modules) == sorted(b for b, q in qualities.items() if q == "symbols")
        assert rows(tmp_path, "SELECT DISTINCT quality FROM modules") == [("dwarf",)]
        assert all(
            file for (_f, file, _l) in frames_of(tmp_path, mods[1].build_id) + frames_of(tmp_path, mods[2].build_id)
        )


BAD = {
    "500": "HTTP 500 Internal Server Error",
    "truncated": "truncated body: got ",
    "not-elf": "not an ELF file (starts with b'<html><b')",
    "wrong-build-id": "wrong build-ID: the file's is ",
    "slow": "no answer within 0.5 s (DEBUGINFOD_TIMEOUT)",
}


def test_bad_servers_each_get_a_line_and_the_next_server_is_asked(modules, server, tmp_path, monkeypatch):
    c, other = modules["c"], modules["other"]
    files = {c.build_id: c.debug.read_bytes(), other.build_id: other.debug.read_bytes()}
    bad = {mode: MisbehavingServer(mode, files, delay=3.0) for mode in BAD}
    monkeypatch.setenv("DEBUGINFOD_TIMEOUT", "0.5")  # the slow one's wait, as elfutils' clients read it
    cache = tmp_path / "debuginfod"
    native_run(tmp_path / "runs", "r", [(c, "tb_outer")])
    try:
        urls = [bad[mode].url for mode in BAD]
        # Only bad servers: the ingest goes on, the frames keep their symbol-table names.
        summary = ingest(
            tmp_path,
            tmp_path / "runs",
            servers=DebuginfodSettings(urls=tuple(urls), environment=False, cache_dir=str(cache)),
        )
        assert summary.ok
        for mode, expected in BAD.items():
            line = line_of(summary, bad[mode].url)
            assert f"failed for 1 ({c.build_id[:12]}…): {expected}" in line, line
            assert line.endswith("the next server was tried") == (mode != "slow"), line
        assert rows(tmp_path, "SELECT quality FROM modules") == [("symbols",)]
        assert frames_of(tmp_path, c.build_id) == [("tb_outer", None, False)]
        assert files_in(cache) == {} and cache_leftovers(cache) == []  # no file, no part, no negative entry

        # The same bad servers, then a good one: its file is used, the old frames redone.
        again = ingest(
            tmp_path, servers=DebuginfodSettings(urls=(*urls, server.url), environment=False, cache_dir=str(cache))
        )
        assert again.refreshed_modules == [c.build_id]
        for mode in BAD:
            assert line_of(again, bad[mode].url).endswith("the next server was tried")
        assert line_of(again, server.url).startswith(f"{server.url}: 1 file downloaded")
        printed = io.StringIO()
        render_ingest_summary(again, Console(file=printed, width=400))
        shown = [row.split() for row in printed.getvalue().splitlines() if bad["500"].url in row]
        assert len(shown) == 1 and "debuginfod" in shown[0] and " ".join(shown[0]).find("HTTP 500") > 0, shown
        assert frames_of(tmp_path, c.build_id) == [("tb_outer", "inlines.c", True)]
        assert files_in(cache) == {f"{c.build_id}/debuginfo": c.debug.stat().st_size}
        assert cache_leftovers(cache) == []
        assert {mode: s.requests for mode, s in bad.items()} == {mode: 2 for mode in BAD}
    finally:
        for each in bad.values():
            each.stop()


def test_downloads_run_in_parallel_compressed_with_their_bytes_shown(modules, tmp_path):
    files = {m.build_id: m.debug.read_bytes() for m in modules.values()}
    good = MisbehavingServer("gzip", files, delay=0.3)  # a good server, slow enough to overlap
    told: list[str] = []
    client = DebuginfodClient([good.url], str(tmp_path / "d"), jobs=4, describe=told.append)
    try:
        fetched = client.fetch_many(list(files))
    finally:
        client.close()
        good.stop()
    for build_id, data in files.items():
        assert Path(fetched[build_id].path).read_bytes() == data
    assert good.most_at_once == len(files)
    assert all("gzip" in accepted for accepted in good.encodings)
    total = sum(len(d) for d in files.values())
    from tbpipe.pipeline.progress import size_text

    assert f"downloading debug info: 3 of 3 files, {size_text(total)} of {size_text(total)}" in told


# ------------------------------------------------------------------------------ the command line


def test_commands_show_the_servers(modules, server, tmp_path):
    c = modules["c"]
    env = dict(
        os.environ, DEBUGINFOD_CACHE_PATH=str(tmp_path / "d"), TBPIPE_CACHE_DIR=str(tmp_path / "store"), COLUMNS="300"
    )

    def tbpipe(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([*TBPIPE, *args], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    unknown = modules["cxx"].build_id
    found = tbpipe(
        "debuginfo",
        "find",
        unknown,
        "--debuginfod",
        "http://127.0.0.1:9",
        "--debuginfod",
        server.url,
        "--debug-root",
        str(tmp_path),
        "--json",
    )
    looked = json.loads(found.stdout)["looked_in"]
    assert any(
        line.startswith("debuginfod http://127.0.0.1:9: failed after ") and "cannot connect" in line for line in looked
    )
    assert any(line.startswith(f"debuginfod {server.url}: 404 not found in ") for line in looked)

    found = tbpipe(
        "debuginfo",
        "find",
        c.build_id,
        "--module",
        str(c.stripped),
        "--debuginfod",
        server.url,
        "--debug-root",
        str(tmp_path),
    )
    assert f"debuginfod {server.url}: 200, {_size(c.debug)} in " in found.stdout
    assert (
        f"dwarf: DWARF from {tmp_path / 'd' / c.build_id / 'debuginfo'} (via debuginfod {server.url})" in found.stdout
    )

    # addr2line by build-ID alone; the file is in the cache now: nothing asked.
    asked = server.requests()
    line = tbpipe(
        "addr2line", "-f", "--build-id", c.build_id, "--debuginfod", server.url, f"{c.address_of('tb_second') + 4:#x}"
    )
    assert line.stdout.splitlines()[0] == "tb_second"
    assert server.requests() == asked

    help_text = tbpipe("ingest", "--help").stdout
    for word in ("--debuginfod", "--offline", "DEBUGINFOD_URLS", "DEBUGINFOD_CACHE_PATH", "DEBUGINFOD_TIMEOUT"):
        assert word in help_text, word


# ------------------------------------------------------------------------------ Spark


def test_spark_executors_fetch_from_the_servers(modules, server, tmp_path, spark):
    from tbpipe.pipeline.lake import store
    from tbpipe.pipeline.lake.spark_ingest import SparkIngestOptions, ingest_runs_spark

    c = modules["c"]
    native_run(tmp_path / "runs", "r", [(c, "tb_outer")])
    cache = tmp_path / "executor-debuginfod"
    options = SparkIngestOptions(
        lake=tmp_path / "lake", cache_dir=tmp_path / "store", debuginfod=settings(server.url, cache=cache)
    )
    summary = ingest_runs_spark([tmp_path / "runs"], options, spark=spark)
    render_ingest_summary(summary, Console(file=io.StringIO()))
    assert summary.ok
    assert files_in(cache) == {f"{c.build_id}/debuginfo": c.debug.stat().st_size}
    con = store.connect(tmp_path / "lake")
    try:
        coverage = con.execute("SELECT build_id, quality, found_via, debug_file FROM symbol_coverage").fetchall()
        frames = con.execute("SELECT function, file, line FROM stack_frames WHERE NOT inlined").fetchall()
    finally:
        con.close()
    assert coverage == [(c.build_id, "dwarf", f"debuginfod {server.url}", str(cache / c.build_id / "debuginfo"))]
    assert [(f, os.path.basename(p), line > 0) for f, p, line in frames] == [("tb_outer", "inlines.c", True)]
