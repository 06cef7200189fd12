"""`tbpipe doctor`: what the next capture and ingest can do on this machine, and why not.

`diagnose` returns a `Diagnosis`: one `Check` per subject (each native module's debug info, the
torch-ops observer's build, CUPTI, Triton, torch.compile's hooks, the symbol store, the database;
with a program, how its run went),
each with a status (`ok`, `degraded`: works with less, `missing`: cannot work), what was found and
what to do. A check the user asked for (a source they will switch on, a module they named) that
cannot work makes the diagnosis fail (`failed`: `tbpipe doctor` exits 1).

Nothing here imports torch or triton (seconds each): their files are looked at instead. Debug
info is looked up by `symbols.debuginfo.DebugInfoLocator`, the same search the ingest runs.

A program (`tbpipe doctor -- python train.py`) runs for real, captured as `tbpipe run` captures it
(the sources asked for on), into a temporary folder removed afterwards, and is stopped after a
bounded time: its modules are those on the stacks it recorded, the ones the ingest will symbolize.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import duckdb

from tbpipe.capture.cache import default_cache_dir
from tbpipe.capture.cuda import cupti_candidates
from tbpipe.capture.launch import captured_environment
from tbpipe.pipeline.db.schema import latest_version
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.rawrun import DamagedRunError, find_run_dirs, part_files, read_manifest, read_tables
from tbpipe.pipeline.symbols.debuginfo import DebugInfoLocator
from tbpipe.pipeline.symbols.elf import inspect_elf
from tbpipe.pipeline.symbols.model import ElfFileError, Quality

OK, DEGRADED, MISSING = "ok", "degraded", "missing"
_COMMAND_TIMEOUT_S = 10.0


@dataclass
class Check:
    subject: (
        str  # "module", "torch-ops observer", "cuda (CUPTI)", "triton", "torch.compile", "symbol store", "database"
    )
    name: str  # what was checked (a module's path, a library)
    status: str  # OK, DEGRADED or MISSING
    found: str  # what is there, in one line
    advice: str | None = None  # what to do about it
    asked: bool = False  # the user asked for it: MISSING fails the diagnosis
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def fails(self) -> bool:
        """Asked for and cannot work: a module named without DWARF cannot give file:line either."""
        return self.asked and (self.status == MISSING or (self.subject == "module" and self.status == DEGRADED))


@dataclass
class Diagnosis:
    checks: list[Check]
    modules_from: str  # where the module list came from

    @property
    def failed(self) -> bool:
        return any(check.fails for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "failed": self.failed,
            "modules_from": self.modules_from,
            "checks": [{**asdict(check), "fails": check.fails} for check in self.checks],
        }


def _run(command: Sequence[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


# ------------------------------------------------------------------------------------------ modules


def loaded_modules(imports: Sequence[str] = ()) -> list[tuple[str, str | None]]:
    """(path, build-ID) of every native module a Python process that imports `imports` has loaded
    (this interpreter, in a child process: the imports may be heavy)."""
    code = (
        "import json\n"
        + "".join(f"import {name}\n" for name in imports)
        + "from tbpipe import _native\n"
        + "print(json.dumps([[m['path'], m['build_id'] or None] for m in _native._modules()]))\n"
    )
    done = _run([sys.executable, "-c", code])
    if done is None or done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done is not None and done.stderr.strip() else "it did not finish"

        raise UsageError(f"could not list the modules of a Python process importing {', '.join(imports)}: {why}")

    return [(path, build_id) for path, build_id in json.loads(done.stdout) if path]


def run_modules(con: Any, run_id: str) -> list[tuple[str, str | None]]:
    """(path, build-ID) of the native modules the database holds for a run."""
    rows = con.execute(
        """
        SELECT DISTINCT rm.path, m.build_id FROM run_modules rm LEFT JOIN modules m USING (module_key)
        WHERE rm.run_id = ? ORDER BY rm.path
        """,
        [run_id],
    ).fetchall()
    return [(path, build_id) for path, build_id in rows]


def _owning_package(path: str) -> str | None:
    """The Debian package that installed `path` (dpkg), else None."""
    if shutil.which("dpkg-query") is None:
        return None
    real = os.path.realpath(path)
    candidates = dict.fromkeys([path, real, *(p.replace("/usr/lib/", "/lib/", 1) for p in (path, real))])
    for candidate in candidates:
        done = _run(["dpkg-query", "-S", candidate])
        if done is not None and done.returncode == 0 and ":" in done.stdout:
            return done.stdout.split(":", 1)[0].split(",")[0].strip()
    return None


def _known_package(name: str) -> bool:
    done = _run(["apt-cache", "show", "--no-all-versions", name]) if shutil.which("apt-cache") else None
    return done is not None and done.returncode == 0 and bool(done.stdout.strip())


def debug_package_hint(path: str) -> str:
    """What to install for `path`'s debug info: the distribution's -dbg or -dbgsym package, else a
    debuginfod server."""
    servers = os.environ.get("DEBUGINFOD_URLS", "").strip()
    server_hint = (
        f"the ingest asks the debuginfod servers in DEBUGINFOD_URLS ({servers})"
        if servers
        else "set DEBUGINFOD_URLS to a debuginfod server that has this build-ID (tbpipe ingest asks it)"
    )
    package = _owning_package(path)
    if package is None:
        if "/site-packages/" in path or "/dist-packages/" in path:
            return f"a pip wheel's library (wheels ship no debug packages): {server_hint}, or rebuild it with -g"
        return f"not from a system package: pass --debug-dir DIR with its debug files, or {server_hint}"
    source = package.split(":")[0]
    for candidate in (f"{source}-dbg", f"{source}-dbgsym"):
        if _known_package(candidate):
            return f"apt-get install {candidate}, or {server_hint}"
    return f"apt-get install {source}-dbgsym (from the distribution's debug archive), or {server_hint}"


def module_checks(
    modules: Iterable[tuple[str, str | None]], asked: bool, debug_dirs: Sequence[str] = ()
) -> list[Check]:
    """Debug info for each module: DWARF found (where), symbols only or nothing (what to install)."""

    locator = DebugInfoLocator(debug_dirs=debug_dirs)
    checks = []
    for path, build_id in modules:
        if build_id is None:
            try:
                build_id = inspect_elf(path).build_id
            except (ElfFileError, OSError) as error:
                checks.append(Check("module", path, MISSING, f"cannot read it: {error}", asked=asked))
                continue
        if build_id is None:
            advice = "link it with --build-id (tbpipe finds debug info by build-ID)"
            checks.append(Check("module", path, MISSING, "no build-ID note", advice, asked, {"build_id": None}))
            continue
        located = locator.locate(build_id, path if os.path.exists(path) else None)
        facts = {"build_id": build_id, "quality": located.quality.value, "looked_in": located.looked_in}
        if located.quality is Quality.DWARF:
            found = f"DWARF in {located.chosen.path} (via {located.chosen.via})"
            checks.append(Check("module", path, OK, found, None, asked, {**facts, "debug_file": located.chosen.path}))
            continue
        status = DEGRADED if located.quality is Quality.SYMBOLS else MISSING
        found = "symbols only: functions, no file:line" if status == DEGRADED else "no debug info: addresses only"
        checks.append(Check("module", path, status, found, debug_package_hint(path), asked, facts))
    return checks


# ------------------------------------------------------------------------------------------ a program

PROGRAM_TIMEOUT_S = 30.0
# After the timeout: SIGINT first (Python runs its exit handlers, the capture writes its last part),
# then SIGTERM, then SIGKILL, each after this many seconds.
_STOP_GRACE_S = {signal.SIGINT: 5.0, signal.SIGTERM: 2.0, signal.SIGKILL: 2.0}


@dataclass
class ProgramRun:
    """A program run under capture for the doctor: the native modules on its stacks, and how it went."""

    command: list[str]
    modules: list[tuple[str, str | None]]
    processes: int  # run folders written (Python processes that recorded)
    events: int
    status: int | None  # its exit status; None: stopped at the timeout
    seconds: float
    timeout_s: float


def run_program(command: Sequence[str], sources: Sequence[str], timeout_s: float = PROGRAM_TIMEOUT_S) -> ProgramRun:
    """Runs `command` as `tbpipe run` does (its Python processes recording, `sources` on) into a
    temporary folder, for at most `timeout_s` seconds, then stops what is left of it; reads the
    modules its runs recorded and removes the folder. Its output goes to stderr: stdout is the
    diagnosis's. UsageError when it cannot start."""

    if timeout_s <= 0:
        raise UsageError(f"--timeout must be positive, not {timeout_s}")
    folder = Path(tempfile.mkdtemp(prefix="tbpipe-doctor-"))
    try:
        runs = folder / "runs"
        env = captured_environment(runs, {}, list(sources))
        started = time.monotonic()
        try:
            # A session of its own: the program and its children are stopped as one group.
            process = subprocess.Popen(
                list(command), env=env, stdin=subprocess.DEVNULL, stdout=_stderr_fd(), start_new_session=True
            )
        except OSError as error:
            raise UsageError(f"cannot run {command[0]}: {error.strerror or error}") from None
        status = None
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _stop_group(process)
        seconds = time.monotonic() - started
        modules, processes, events = _recorded_modules(runs)
        return ProgramRun(list(command), modules, processes, events, status, seconds, timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reaps the leader once it exited
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(process: subprocess.Popen) -> None:
    """Stops every process left in the program's group, politely first."""
    for stop, grace_s in _STOP_GRACE_S.items():
        if not _group_alive(process):
            return
        try:
            os.killpg(process.pid, stop)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(process):
            time.sleep(0.05)


def _recorded_modules(runs: Path) -> tuple[list[tuple[str, str | None]], int, int]:
    """(path, build-ID) of every native module on the recorded stacks, the run folders, the events."""

    found: dict[str, str | None] = {}
    run_dirs = find_run_dirs([runs]) if runs.is_dir() else []
    events = 0
    for run_dir in run_dirs:
        try:
            manifest = read_manifest(run_dir)
            modules = read_tables(part_files(run_dir, manifest), ("modules",))["modules"]
        except DamagedRunError:  # killed before it wrote a whole manifest: nothing to read
            continue
        events += int((manifest.get("counters") or {}).get("events_written") or 0)
        for path, build_id in zip(modules["path"].to_pylist(), modules["build_id"].to_pylist()):
            if path:
                found.setdefault(path, build_id)
    return sorted(found.items()), len(run_dirs), events


def _events(count: int) -> str:
    return f"{count:,} event{'s' if count != 1 else ''}"


def program_check(run: ProgramRun) -> Check:
    """How the program's run went; MISSING (and asked for) when it recorded no native frames."""
    how = (
        f"stopped after the {run.timeout_s:g} s timeout"
        if run.status is None
        else f"exited with status {run.status} after {run.seconds:.1f} s"
    )
    facts = {
        "command": run.command,
        "status": run.status,
        "seconds": round(run.seconds, 2),
        "timeout_s": run.timeout_s,
        "processes": run.processes,
        "events": run.events,
        "modules": len(run.modules),
    }
    name = shlex.join(run.command)
    if not run.processes:
        found = f"{how}; no Python process of it recorded"
        advice = "run a Python program (`python -I` and `-E` ignore PYTHONPATH, through which tbpipe starts recording)"
        return Check("program", name, MISSING, found, advice, True, facts)
    processes = f"{run.processes} process{'es' if run.processes != 1 else ''}"
    if not run.modules:
        found = f"{how}; {processes} recorded {_events(run.events)} and no native frame"
        advice = (
            "switch on the sources the capture will use (--source torch-ops, cuda, triton), give it longer "
            "(--timeout), or check every module an import loads (--import NAME)"
        )
        return Check("program", name, MISSING, found, advice, True, facts)
    found = f"{how}; {processes}, {_events(run.events)}, native frames in {len(run.modules)} modules"
    failed = run.status not in (None, 0)
    advice = "it failed: its modules are those of the stacks it recorded until then" if failed else None
    return Check("program", name, DEGRADED if failed else OK, found, advice, True, facts)


# ------------------------------------------------------------------------------------------ sources


def _package_dir(name: str) -> Path | None:
    """A top-level package's folder, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _version(distribution: str) -> str | None:

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def observer_check(asked: bool) -> Check:
    """The torch-ops source's RecordFunction observer: torch's headers and a C++20 compiler."""
    torch_dir = _package_dir("torch")
    if torch_dir is None:
        return Check("torch-ops observer", "torch", MISSING, "torch is not installed", "pip install torch", asked)
    facts: dict[str, Any] = {"torch": _version("torch"), "torch_dir": str(torch_dir)}
    headers = torch_dir / "include" / "ATen" / "record_function.h"
    configured = os.environ.get("CXX", "").strip()
    words = shlex.split(configured) if configured else ["c++"]
    compiler = shutil.which(words[0]) if words else None
    facts.update(compiler=configured or "c++", compiler_path=compiler, headers=str(headers))
    built = sorted((_cache_dir() / "torch-observer").glob(f"torch-{facts['torch']}-*/_tbpipe_torch_observer*.so"))
    if built:
        found = f"built for torch {facts['torch']}: {built[-1]}"
        return Check("torch-ops observer", "RecordFunction observer", OK, found, None, asked, facts)
    problems = []
    if not headers.is_file():
        problems.append(f"torch's C++ headers are not installed (no {headers})")
    if compiler is None:
        origin = f"CXX={configured}" if configured else "`c++`"
        problems.append(f"no C++ compiler: {origin} is not on PATH")
    else:
        done = _run([compiler, *words[1:], "--version"])
        facts["compiler_version"] = done.stdout.splitlines()[0] if done is not None and done.stdout else None
    if problems:
        advice = "install g++ (C++20) or set CXX; then `python -m tbpipe.capture.torch_observer build`"
        found = "; ".join(problems) + " (torch-ops falls back to its slower dispatch mode)"
        return Check("torch-ops observer", "RecordFunction observer", MISSING, found, advice, asked, facts)
    found = f"not built yet; the first torch-ops session builds it with {facts.get('compiler_version') or compiler}"
    advice = "`python -m tbpipe.capture.torch_observer build` now saves ~10 s at the first capture"
    return Check("torch-ops observer", "RecordFunction observer", OK, found, advice, asked, facts)


def _cupti_version(library: Any) -> int | None:
    version = ctypes.c_uint32(0)
    try:
        return version.value if library.cuptiGetVersion(ctypes.byref(version)) == 0 else None
    except AttributeError:
        return None


def cupti_check(asked: bool) -> Check:
    """CUPTI for the cuda source: which library loads, its version, who else subscribes."""

    tried = cupti_candidates()
    for candidate in tried:
        try:
            library = ctypes.CDLL(candidate)
        except OSError:
            continue
        version = _cupti_version(library)
        others = [
            v for v in ("CUDA_INJECTION64_PATH", "NSYS_PROFILING_SESSION_ID", "KINETO_USE_DAEMON") if os.environ.get(v)
        ]
        found = f"{candidate} (CUPTI API version {version})"
        advice = None
        if others:
            advice = f"another CUPTI subscriber may hold it ({', '.join(others)} set): only one subscriber per process"
        facts = {"library": candidate, "version": version, "other_subscribers": others}
        return Check("cuda (CUPTI)", "libcupti", DEGRADED if others else OK, found, advice, asked, facts)
    advice = "install CUDA's CUPTI (the nvidia-cuda-cupti wheel torch depends on, or the toolkit's extras/CUPTI), or set TBPIPE_CUPTI_LIBRARY"
    return Check(
        "cuda (CUPTI)",
        "libcupti",
        MISSING,
        f"no CUPTI library loads (tried {len(tried)} places)",
        advice,
        asked,
        {"tried": tried},
    )


def triton_check(asked: bool) -> Check:
    if _package_dir("triton") is None:
        return Check("triton", "triton", MISSING, "triton is not installed", "pip install triton", asked)
    return Check(
        "triton",
        "triton",
        OK,
        f"triton {_version('triton')}: launches recorded through its launch-enter hook",
        None,
        asked,
    )


def compile_check(asked: bool) -> Check:
    """torch.compile's hooks: Dynamo's structured trace and compile callbacks."""
    torch_dir = _package_dir("torch")
    if torch_dir is None:
        return Check("torch.compile", "torch._dynamo", MISSING, "torch is not installed", None, asked)
    needed = [torch_dir / "_dynamo" / "callback.py", torch_dir / "_logging" / "structured.py"]
    absent = [str(path.relative_to(torch_dir)) for path in needed if not path.is_file()]
    if absent:
        found = f"torch {_version('torch')} lacks {', '.join(absent)}: compiled code is not followed"
        return Check("torch.compile", "torch._dynamo", MISSING, found, "torch 2.3 or newer", asked)
    found = f"torch {_version('torch')}: Dynamo's compile callbacks and structured trace are there"
    return Check("torch.compile", "torch._dynamo", OK, found, None, asked)


# ------------------------------------------------------------------------------------------ storage


def _cache_dir() -> Path:

    return default_cache_dir()


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def store_check() -> Check:
    root = _cache_dir()
    if not root.exists():
        return Check("symbol store", str(root), OK, "empty: the first ingest fills it", None, False, {"bytes": 0})
    size = _size(root)
    writable = os.access(root, os.W_OK)
    status = OK if writable else MISSING
    advice = None if writable else "set TBPIPE_CACHE_DIR to a writable folder"
    found = f"{_mib(size)}" + ("" if writable else ", not writable")
    return Check("symbol store", str(root), status, found, advice, False, {"bytes": size})


def database_check(path: Path, asked: bool) -> tuple[Check, Any]:
    """The database's size and schema version; and a read-only connection to it (None when absent)."""

    latest = latest_version()
    if not path.exists():
        found = "no database yet: `tbpipe ingest` makes it"
        return Check("database", str(path), MISSING, found, None, asked, {"latest": latest}), None
    facts: dict[str, Any] = {"bytes": path.stat().st_size, "latest": latest}
    try:
        con = duckdb.connect(str(path), read_only=True)
        version = con.execute("SELECT max(version) FROM schema_versions").fetchone()[0]
    except duckdb.Error as error:
        found = f"{_mib(facts['bytes'])}; cannot open it: {str(error).splitlines()[0]}"
        return Check(
            "database", str(path), DEGRADED, found, "another process may hold it (tbpipe serve)", asked, facts
        ), None
    facts["schema_version"] = version
    found = f"{_mib(facts['bytes'])}, schema version {version}"
    if version < latest:
        advice = f"this tbpipe's schema is version {latest}: `tbpipe ingest` upgrades the file"
        return Check("database", str(path), DEGRADED, found, advice, asked, facts), con
    return Check("database", str(path), OK, found, None, asked, facts), con


# ------------------------------------------------------------------------------------------ all


def diagnose(
    db_path: Path,
    *,
    sources: Sequence[str] = (),
    modules: Sequence[str] = (),
    imports: Sequence[str] = (),
    run_id: str | None = None,
    debug_dirs: Sequence[str] = (),
    program: Sequence[str] = (),
    timeout_s: float = PROGRAM_TIMEOUT_S,
) -> Diagnosis:
    """Every check. Modules: those named (asked for), else those on the stacks `program` records
    in `timeout_s` (`run_program`), else those a process importing `imports` loads, else the
    modules of run `run_id` or of the newest run in the database, else this Python's."""
    checks: list[Check] = []
    ran = run_program(program, sources, timeout_s) if program and not modules else None
    database, con = database_check(db_path, asked=run_id is not None)
    try:
        if modules:
            listed, where = [(m, None) for m in modules], "the modules named"
        elif ran is not None:
            listed, where = ran.modules, f"the stacks `{shlex.join(ran.command)}` recorded"
            checks.append(program_check(ran))
        elif imports:
            listed, where = loaded_modules(imports), f"a Python process importing {', '.join(imports)}"
        elif con is not None and (run_id or _newest_run(con)):
            run_id = run_id or _newest_run(con)
            listed, where = run_modules(con, run_id), f"run {run_id}"
        else:
            listed, where = loaded_modules(), "this Python"
    finally:
        if con is not None:
            con.close()
    checks += module_checks(listed, asked=bool(modules), debug_dirs=debug_dirs)
    checks.append(observer_check("torch-ops" in sources))
    checks.append(cupti_check("cuda" in sources))
    checks.append(triton_check("triton" in sources))
    checks.append(compile_check(False))
    checks.append(store_check())
    checks.append(database)
    return Diagnosis(checks, where)


def _newest_run(con: Any) -> str | None:
    row = con.execute("SELECT run_id FROM runs ORDER BY started_at DESC, run_id LIMIT 1").fetchone()
    return row[0] if row else None
