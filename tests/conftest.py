"""Shared fixtures and helpers for the suite: running child Pythons, the test libraries, symbol stores.

Helpers that the benchmarks share live in `support/`; `read_runs` is re-exported for the tests."""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from support.ingest import ingest
from support.known_lines import LIBRARY, workload

from tbpipe import capture
from tbpipe.pipeline.rawrun import find_run_dirs

# The CLI as the tests run it: the same interpreter, no reliance on PATH.
TBPIPE = [sys.executable, "-m", "tbpipe.pipeline"]

# The machine's own debuginfod servers (Fedora and Ubuntu set DEBUGINFOD_URLS at login) are never
# asked by the suite, nor by the processes it starts: the debuginfod tests name the servers they run.
os.environ.pop("DEBUGINFOD_URLS", None)


# Test modules of what is drawn from the database for people (reports, the service), whose code
# nothing of the interpreter's internals reaches: run on the default interpreter only. They build
# nights of captures and serve them, two of the matrix's three slowest modules; every version still
# imports them (collection), and the capture, native and ingest tests run on every version.
PRESENTATION_MODULES = {"test_serve.py", "test_report.py", "test_report_gpu.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts Spark (the `spark` session fixture, directly or through another fixture)
    is marked `spark`: the matrix runs those on one interpreter besides the default one. Tests on
    the standalone cluster (`spark_cluster`, tests/test_lake.py) and tests of PRESENTATION_MODULES
    are marked `default_interpreter_only`."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "spark" in fixtures or "spark_cluster" in fixtures:
            item.add_marker(pytest.mark.spark)
        if "spark_cluster" in fixtures:
            item.add_marker(pytest.mark.default_interpreter_only)
        if item.path.name in PRESENTATION_MODULES:
            item.add_marker(pytest.mark.default_interpreter_only)


def run_python(
    code: str, *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (the one running the tests)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def spark_unavailable() -> str | None:
    """Why PySpark cannot run here, or None. Only the interpreter is a reason: PySpark 4.3 (the
    version the `spark` extra installs) needs CPython 3.11+; a missing package or Java is a setup
    error the tests report by failing."""
    if sys.version_info < (3, 11):
        return f"PySpark 4.3 needs CPython 3.11 or newer; this is CPython {platform.python_version()}"
    return None


# The tests' Spark jobs are short and many on two cores: a JVM that compiles with its quick compiler
# only, and collects garbage on one thread, takes about half the CPU for them (the optimizing
# compiler's threads never pay back in a job of seconds). Users' long jobs keep the JVM's defaults.
QUICK_JVM = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}


@pytest.fixture(scope="session")
def spark():
    """One Spark session (local[2], no UI, loopback) for every test that needs one."""
    reason = spark_unavailable()
    if reason:
        pytest.skip(reason)
    from tbpipe.pipeline.lake.spark_ingest import spark_session

    session = spark_session(
        "local[2]",
        {"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "2", **QUICK_JVM},
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def libs(tmp_path_factory):
    """The test libraries of the symbolization tests, built once per session (symbols_data/testlib.py)."""
    from symbols_data.testlib import build_libs

    return build_libs(str(tmp_path_factory.getbasetemp() / "symbols-libs"))


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


@pytest.fixture(scope="session")
def symbol_cache(tmp_path_factory) -> Path:
    """One symbol store for the whole session (child processes get it as TBPIPE_CACHE_DIR),
    so each SymCache is built once."""
    path = tmp_path_factory.getbasetemp() / "tbpipe-symbols"
    path.mkdir(exist_ok=True)
    return path


# ---------------------------------------------------------------- runs of the ingest tests (tests/test_ingest*.py)


@pytest.fixture(scope="session")
def library(tmp_path_factory):
    """A module under a site-packages folder: not user code, so sites skip its frames. Its folder stays
    on sys.path for the whole session: the runs that call it are captured when first asked for."""
    site_packages = tmp_path_factory.mktemp("venv") / "site-packages"
    package = site_packages / "fakelib_tbpipe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch.py").write_text(LIBRARY)
    sys.path.insert(0, str(site_packages))
    try:
        yield importlib.import_module("fakelib_tbpipe.launch")
    finally:
        sys.path.remove(str(site_packages))
        sys.modules.pop("fakelib_tbpipe.launch", None)
        sys.modules.pop("fakelib_tbpipe", None)


@pytest.fixture(scope="session")
def workload_runs(tmp_path_factory, library) -> Path:
    """The workload at known lines (support/known_lines.py), captured once."""
    out = tmp_path_factory.mktemp("workload") / "runs"
    with capture.session(out, labels={"suite": "workload"}):
        workload(library)
    return out


@pytest.fixture(scope="session")
def workload_db(tmp_path_factory, workload_runs, symbol_cache) -> Path:
    """`workload_runs` ingested, shared by several files: a test that changes its user-code rules leaves its sites as found."""
    db = tmp_path_factory.mktemp("workload-db") / "tbpipe.duckdb"
    summary = ingest(db, workload_runs, cache=symbol_cache)
    assert summary.ok and summary.ingested == 1
    return db


@pytest.fixture(scope="session")
def good_run(tmp_path_factory, library) -> Path:
    """One whole run of the workload at known lines; tests copy it (`support.ingest._copy`), never change it."""
    out = tmp_path_factory.mktemp("good") / "runs"
    with capture.session(out, labels={"suite": "good"}):
        workload(library)
    (run_dir,) = find_run_dirs([out])
    return run_dir
