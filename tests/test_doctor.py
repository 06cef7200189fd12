"""`tbpipe doctor`: debug info per module (found, or the package to install), the torch-ops
observer's compiler, CUPTI, the exit status when something asked for cannot work, and a program
run under capture for a bounded time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TBPIPE

pytestmark = pytest.mark.default_interpreter_only  # the checks look at this machine, not the interpreter

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"  # libc6-dbg (.ci/run) gives it DWARF under /usr/lib/debug


def doctor(tmp_path: Path, *args: str, **env: str) -> tuple[int, dict]:
    environ = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    environ.update(TBPIPE_CACHE_DIR=str(tmp_path / "cache"), **env)
    done = subprocess.run(
        [*TBPIPE, "doctor", "--db", str(tmp_path / "none.duckdb"), "--format", "json", *args],
        capture_output=True, text=True, timeout=120, env=environ,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def check(result: dict, subject: str, name: str | None = None) -> dict:
    (found,) = [c for c in result["checks"] if c["subject"] == subject and (name is None or c["name"] == name)]
    return found


def a_module_without_debug_info() -> tuple[str, str]:
    """(path, Debian package) of a library of this machine that has no debug info installed."""
    for name in ("libz.so.1", "liblzma.so.5", "libbz2.so.1.0", "libexpat.so.1", "libffi.so.8"):
        path = f"/lib/x86_64-linux-gnu/{name}"
        owner = subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True)
        debug = subprocess.run(["dpkg-query", "-W", "-f=${Status}", owner.stdout.split(":")[0] + "-dbg"],
                               capture_output=True, text=True)  # fmt: skip
        if owner.returncode == 0 and "installed" not in debug.stdout:
            return path, owner.stdout.split(":")[0]
    raise AssertionError("no library without debug info found on this machine")


def test_a_module_with_debug_info_and_one_without(tmp_path: Path) -> None:
    status, result = doctor(tmp_path, "--module", LIBC)
    libc = check(result, "module", LIBC)
    assert status == 0 and libc["status"] == "ok" and libc["facts"]["quality"] == "dwarf"
    assert libc["facts"]["debug_file"].startswith("/usr/lib/debug/") and "DWARF in /usr/lib/debug/" in libc["found"]
    assert result["modules_from"] == "the modules named"

    path, package = a_module_without_debug_info()
    status, result = doctor(tmp_path, "--module", LIBC, "--module", path)
    bare = check(result, "module", path)
    assert status == 1 and result["failed"] and bare["fails"]  # asked for, and no file:line for it
    assert bare["status"] in ("degraded", "missing") and bare["facts"]["quality"] in ("symbols", "none")
    assert f"apt-get install {package}-dbg" in bare["advice"]  # -dbg or -dbgsym, whichever the archive has
    assert "DEBUGINFOD_URLS" in bare["advice"]


def test_a_missing_compiler_fails_torch_ops(tmp_path: Path) -> None:
    status, result = doctor(tmp_path, "--module", LIBC, "--source", "torch-ops", CXX="/nonexistent/c++")
    observer = check(result, "torch-ops observer")
    assert status == 1 and observer["status"] == "missing" and observer["fails"]
    assert "no C++ compiler: CXX=/nonexistent/c++ is not on PATH" in observer["found"]
    assert "set CXX" in observer["advice"]
    # Not asked for, the same problem is reported but does not fail.
    status, result = doctor(tmp_path, "--module", LIBC, CXX="/nonexistent/c++")
    assert status == 0 and check(result, "torch-ops observer")["status"] == "missing"
    if shutil.which("c++"):
        status, result = doctor(tmp_path, "--module", LIBC, "--source", "torch-ops")
        assert status == 0 and check(result, "torch-ops observer")["facts"]["compiler_path"]


def test_no_cupti_fails_the_cuda_source(tmp_path: Path) -> None:
    status, result = doctor(
        tmp_path, "--module", LIBC, "--source", "cuda", TBPIPE_CUPTI_LIBRARY="/nonexistent/libcupti.so"
    )
    cupti = check(result, "cuda (CUPTI)")
    assert status == 1 and cupti["status"] == "missing" and cupti["fails"]
    assert cupti["facts"]["tried"] == ["/nonexistent/libcupti.so"] and "TBPIPE_CUPTI_LIBRARY" in cupti["advice"]


def test_text_output_and_this_pythons_modules(tmp_path: Path) -> None:
    done = subprocess.run(
        [*TBPIPE, "doctor", "--db", str(tmp_path / "none.duckdb")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, TBPIPE_CACHE_DIR=str(tmp_path / "c")),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "modules of this Python:"
    assert any(line.startswith("  ok ") and line.split()[1].endswith("libc.so.6:") for line in lines)
    assert any("database " in line and "no database yet" in line for line in lines)
    assert lines[-1] == "everything asked for can work"


def test_the_newest_runs_modules_and_the_database(tmp_path_factory, symbol_cache) -> None:
    from support.serve import environment, nights_database

    db = nights_database(tmp_path_factory.getbasetemp(), environment(symbol_cache))
    done = subprocess.run(
        [*TBPIPE, "doctor", "--db", str(db), "--format", "json"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["modules_from"].startswith("run ") and result["modules_from"].endswith(result["modules_from"][4:])
    modules = [c for c in result["checks"] if c["subject"] == "module"]
    assert any(c["name"].endswith("libc.so.6") and c["status"] == "ok" for c in modules)
    database = check(result, "database")
    assert database["status"] == "ok" and database["facts"]["schema_version"] == database["facts"]["latest"]
    assert database["facts"]["bytes"] == db.stat().st_size
    store = check(result, "symbol store")
    assert store["name"] == str(symbol_cache) and store["facts"]["bytes"] > 0


# Records one event, says something on stdout, then sleeps as long as asked.
PROGRAM = """import sys, time
from tbpipe import capture
print("the program's own output")
capture.record("user", "hello")
time.sleep(float(sys.argv[1]))
"""


def test_a_program_run_under_capture_and_stopped_at_the_timeout(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(PROGRAM)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    started = time.monotonic()
    status, result = doctor(
        tmp_path, "--timeout", "2", "--", sys.executable, str(tmp_path / "app.py"), "600", TMPDIR=str(temporary)
    )
    assert time.monotonic() - started < 30  # stopped at the timeout (SIGINT), not after 600 s
    program = check(result, "program")  # the diagnosis alone on stdout: the program's output went to stderr
    assert status == 0 and program["status"] == "ok" and program["facts"]["status"] is None
    assert program["found"].startswith("stopped after the 2 s timeout; 1 process, 1 event, native frames in")
    assert result["modules_from"].startswith("the stacks `") and result["modules_from"].endswith("recorded")
    modules = [c["name"] for c in result["checks"] if c["subject"] == "module"]
    assert len(modules) == program["facts"]["modules"] and any(m.endswith("/libc.so.6") for m in modules)
    assert os.path.realpath(LIBC) in {os.path.realpath(m) for m in modules}
    assert list(temporary.iterdir()) == []  # its run folder is gone


def test_a_program_that_records_no_stack_fails(tmp_path: Path) -> None:
    status, result = doctor(tmp_path, "--timeout", "20", "--", sys.executable, "-c", "print('hello')")
    program = check(result, "program")
    assert status == 1 and program["fails"] and program["facts"]["status"] == 0
    assert "recorded 0 events and no native frame" in program["found"] and "--source torch-ops" in program["advice"]
    assert [c for c in result["checks"] if c["subject"] == "module"] == []
