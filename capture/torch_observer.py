"""The torch-ops source's RecordFunction observer: built against the installed PyTorch, cached, loaded.

PyTorch's C++ API has no stable ABI, so the observer (native/torch_observer/observer.cpp, shipped
in the package as `tbpipe/torch_observer_src/`) is compiled on the user's machine, against the headers
of the torch that the program imports, and kept in the cache folder per torch build:

    <cache>/torch-observer/torch-<version>-<python tag>-<key>/_tbpipe_torch_observer<ext suffix>
                                                             build.log   the compiler's output
                                                             failed.json why the last build failed
                                                             lock        serializes builds

`<cache>` is $TBPIPE_CACHE_DIR, else the user cache folder (tbpipe.capture.cache). `<key>` hashes
the observer's source, the C API header, the compile command, torch's version and git revision and
the Python ABI, so a new tbpipe or a new torch gets a new build and never loads a stale one.

Building needs a C++20 compiler ($CXX, else `c++`) and torch's C++ headers (in every torch wheel,
under torch/include); it takes about 10 s of CPU once per torch build. `make install` builds it
right after installing torch (`python -m tbpipe.capture.torch_observer build`); otherwise the first
session that starts `torch-ops` builds it, saying so on stderr. When it cannot be built or loaded,
`ObserverUnavailable` says why in one line and the source falls back to its dispatch mode. A build
that failed is not retried with the same compiler until its `failed.json` is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbpipe.capture.cache import default_cache_dir

MODULE_NAME = "_tbpipe_torch_observer"
# Changes whenever the command below changes in a way that changes the build.
_COMMAND_VERSION = 1
_BUILD_TIMEOUT_S = 600


class ObserverUnavailable(Exception):
    """The observer cannot be built or loaded here; the message says why, in one line."""


@dataclass(frozen=True)
class BuildPlan:
    """Everything a build of the observer depends on, and where it goes."""

    compiler: str  # as configured: $CXX, else "c++"
    compiler_source: str  # "CXX" or "default", for messages
    sources: tuple[Path, Path]  # observer.cpp, capi.h
    torch_version: str
    torch_include: Path
    torch_lib: Path
    python_include: Path
    cxx11_abi: bool
    key: str
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / (MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))

    @property
    def log(self) -> Path:
        return self.directory / "build.log"

    @property
    def failure(self) -> Path:
        return self.directory / "failed.json"

    def command(self, compiler: list[str], output: Path) -> list[str]:
        torch_lib = str(self.torch_lib)
        return [
            *compiler,
            "-std=c++20",
            "-O2",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            # tbpipe's unwinder walks through the callback's frame: keep its unwind tables.
            "-fasynchronous-unwind-tables",
            "-fno-omit-frame-pointer",
            "-Wall",
            "-Wextra",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(self.cxx11_abi)}",
            # Warnings are for our code: torch's and Python's headers are system headers here.
            "-isystem",
            str(self.torch_include),
            "-isystem",
            str(self.python_include),
            "-I",
            str(self.sources[1].parent),
            str(self.sources[0]),
            "-o",
            str(output),
            f"-L{torch_lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}",
        ]


def source_dir() -> Path:
    """Where the package keeps the observer's source and the C API header."""
    from tbpipe import _native

    return Path(_native.__file__).resolve().parent / "torch_observer_src"


def plan(torch: Any) -> BuildPlan:
    """The build for this torch (imported), or ObserverUnavailable when its inputs are missing."""
    from tbpipe.capture import __version__ as tbpipe_version

    sources = (source_dir() / "observer.cpp", source_dir() / "capi.h")
    for path in sources:
        if not path.is_file():
            raise ObserverUnavailable(f"the observer's source {path} is not installed with tbpipe")
    torch_root = Path(torch.__file__).resolve().parent
    torch_include = torch_root / "include"
    if not (torch_include / "ATen" / "record_function.h").is_file():
        raise ObserverUnavailable(
            f"torch's C++ headers are not installed (no ATen/record_function.h under {torch_include})"
        )
    python_include = Path(sysconfig.get_paths()["include"])
    if not (python_include / "Python.h").is_file():
        raise ObserverUnavailable(f"Python's C headers are not installed (no Python.h in {python_include})")
    configured = os.environ.get("CXX", "").strip()
    torch_version = str(torch.__version__)
    git_version = str(getattr(getattr(torch, "version", None), "git_version", ""))
    cxx11_abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    digest.update(
        json.dumps(
            [_COMMAND_VERSION, tbpipe_version, torch_version, git_version, cxx11_abi, sys.implementation.cache_tag]
        ).encode()
    )
    key = digest.hexdigest()[:16]
    directory = default_cache_dir() / "torch-observer" / f"torch-{torch_version}-{sys.implementation.cache_tag}-{key}"
    return BuildPlan(
        compiler=configured or "c++",
        compiler_source="CXX" if configured else "default",
        sources=sources,
        torch_version=torch_version,
        torch_include=torch_include,
        torch_lib=torch_root / "lib",
        python_include=python_include,
        cxx11_abi=cxx11_abi,
        key=key,
        directory=directory,
    )


def library(torch: Any, *, quiet: bool = False) -> Path:
    """The observer built for this torch: from the cache, else built now (with a message on stderr)."""
    build = plan(torch)
    if build.library.is_file():
        return build.library
    with _build_lock(build):
        if build.library.is_file():  # another process built it while we waited
            return build.library
        _build(build, quiet=quiet)
    return build.library


def load(torch: Any) -> Any:
    """The observer module for this torch (built first if need be), or ObserverUnavailable."""
    module = sys.modules.get(MODULE_NAME)
    if module is not None:
        return module
    path = library(torch)
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        if not all(hasattr(module, name) for name in ("start", "stop", "registered", "set_level", "compiling")):
            raise ImportError("it is not the observer this tbpipe expects")
    except (ImportError, OSError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ObserverUnavailable(f"the observer built in {path.parent} does not load: {first_line}") from None
    sys.modules[MODULE_NAME] = module
    return module


# -- building -----------------------------------------------------------------


@contextlib.contextmanager
def _build_lock(build: BuildPlan) -> Iterator[None]:
    try:
        build.directory.mkdir(parents=True, exist_ok=True)
        handle = open(build.directory / "lock", "a+")
    except OSError as error:
        raise ObserverUnavailable(f"cannot create the observer's cache folder {build.directory}: {error}") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # one build at a time (ranks of a job start together)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _resolve_compiler(build: BuildPlan) -> list[str]:
    """The compiler command as words, its executable found on PATH (CXX may be "ccache g++")."""
    try:
        words = shlex.split(build.compiler) or ["c++"]
    except ValueError:
        words = [build.compiler]
    found = shutil.which(words[0])
    if found is None:
        origin = f"CXX={build.compiler}" if build.compiler_source == "CXX" else "`c++` (set CXX to choose one)"
        raise ObserverUnavailable(f"no C++ compiler to build the observer: {origin} not found")
    return [found, *words[1:]]


def _earlier_failure(build: BuildPlan, compiler: list[str]) -> str | None:
    try:
        failure = json.loads(build.failure.read_text())
    except (OSError, ValueError):
        return None
    return failure.get("why") if failure.get("compiler") == compiler else None


def _build(build: BuildPlan, *, quiet: bool) -> None:
    compiler = _resolve_compiler(build)
    earlier = _earlier_failure(build, compiler)
    if earlier is not None:
        raise ObserverUnavailable(f"{earlier} (an earlier build; remove {build.failure} to try again)")
    partial = build.directory / f".{build.library.name}.{os.getpid()}.tmp"
    command = build.command(compiler, partial)
    if not quiet:
        print(
            f"tbpipe: building the torch-ops observer for torch {build.torch_version} in {build.directory} "
            "(once per torch version; about 10 s of CPU)",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        output, returncode = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired:
        output, returncode = f"timed out after {_BUILD_TIMEOUT_S} s\n", -1
    except OSError as error:
        output, returncode = f"{error}\n", -1
    elapsed = time.monotonic() - started
    build.log.write_text(f"$ {shlex.join(command)}\n{output}exit status {returncode} after {elapsed:.1f} s\n")
    if returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        why = f"the observer did not compile with {shlex.join(compiler)} (exit status {returncode}; see {build.log})"
        build.failure.write_text(json.dumps({"compiler": compiler, "why": why}) + "\n")
        raise ObserverUnavailable(why)
    os.replace(partial, build.library)  # whole or absent: a concurrent loader never sees half a file
    build.failure.unlink(missing_ok=True)
    if not quiet:
        print(f"tbpipe: built the torch-ops observer in {elapsed:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m tbpipe.capture.torch_observer [build|path]`: build it now / print where it is."""
    args = sys.argv[1:] if argv is None else argv
    action = args[0] if args else "build"
    if action not in ("build", "path"):
        print("usage: python -m tbpipe.capture.torch_observer [build|path]", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print(f"tbpipe: PyTorch is not installed for this Python ({sys.executable})", file=sys.stderr)
        return 1
    try:
        if action == "path":
            print(plan(torch).library)
        else:
            print(library(torch))
    except ObserverUnavailable as error:
        print(f"tbpipe: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
