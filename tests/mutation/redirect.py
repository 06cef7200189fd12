"""A pytest plugin for mutation runs (`-p tbpipe_mutation_redirect`): `tbpipe.*` modules that mutmut
copied into `mutants/tbpipe/...` are imported from there.

The package is an editable install whose finder maps `tbpipe.*` to the repository's folders ahead of
sys.path, so without this finder the tests would import the unmutated sources and every mutant would
survive. Modules not copied (those of other groups, the compiled extensions) still come from the
install."""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec

import pytest


class MutatedSourcesFirst(importlib.abc.MetaPathFinder):
    """Finds `tbpipe.a.b` as `<root>/tbpipe/a/b.py` or `<root>/tbpipe/a/b/__init__.py`, in the first
    of `roots` that has it."""

    def __init__(self, roots: list[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if not fullname.startswith("tbpipe."):
            return None
        for root in self.roots:
            base = os.path.join(root, *fullname.split("."))
            package_init = os.path.join(base, "__init__.py")
            if os.path.isfile(package_init):
                return importlib.util.spec_from_file_location(fullname, package_init, submodule_search_locations=[base])
            if os.path.isfile(base + ".py"):
                return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


def install(mutants: str) -> None:
    """Puts the finder first on sys.meta_path, once: the mutated copies in `mutants`, then the other
    Python modules from the group's folder (its `tbpipe/` links to the checkout that runs the
    mutation), so that a checkout other than the installed one is tested whole."""
    if not any(isinstance(finder, MutatedSourcesFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, MutatedSourcesFirst([mutants, os.path.dirname(mutants)]))


# While mutmut learns which tests reach which functions (MUTANT_UNDER_TEST=stats), the functions a
# child process reached are written here at its exit and counted for the test that started it.
CHILD_HITS = "child-hits"


def record_hits_at_exit() -> None:
    """In a child process of a stats run: mutmut's record of reached functions goes to a file at exit."""
    from mutmut.configuration import config
    from mutmut.state import state

    try:
        here = os.getcwd()
    except OSError:  # started in a folder since removed: nothing relative can be found there anyway
        here = None
    os.chdir(MUTANTS)  # mutmut reads its settings from the working folder, once
    try:
        config()
    finally:
        if here is not None:
            os.chdir(here)

    def write() -> None:
        if state()._stats:
            folder = os.path.join(MUTANTS, CHILD_HITS)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as out:
                out.write("\n".join(sorted(state()._stats)))

    atexit.register(write)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Before mutmut's own teardown hook files the test's reached functions: add its children's."""
    folder = os.path.join(MUTANTS, CHILD_HITS)
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or not os.path.isdir(folder):
        return
    from mutmut.state import state

    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        with open(path) as hits:
            state()._stats.update(hits.read().split())
        os.unlink(path)


def forget_a_parent_s_forkserver() -> None:
    """mutmut runs each mutant's tests in a fork of one process: a multiprocessing forkserver that
    process started (the ingest's symbol workers use one) is not the fork's child, and the fork's
    first use of it fails with ChildProcessError (every in-process ingest, so every mutant its tests
    reach, counted as killed). The fork starts its own instead."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        if hasattr(server, "_forkserver_authkey"):  # CPython 3.12+
            server._forkserver_authkey = None


def pytest_sessionstart(session: pytest.Session) -> None:
    forget_a_parent_s_forkserver()


# mutmut runs pytest from inside `mutants/`, where this file is copied to, beside a sitecustomize.py
# that does the same in the Python processes the tests start (a capture's child, the CLI).
MUTANTS = os.path.dirname(os.path.abspath(__file__))
install(MUTANTS)
if MUTANTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [MUTANTS, os.environ.get("PYTHONPATH")]))
