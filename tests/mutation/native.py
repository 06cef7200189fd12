"""`make mutate-native`: hand-planted mutants of the extension's rules (combined order, inline rows,
stack identity, drain layout, the unwinder's bounds), each built and run against its tests.

No C++ mutation tool fits (Debian packages neither mull nor dextool), so the mutants are
written out in tests/mutation/native_mutants.toml: a file under native/, a text that must occur in it
exactly once, its replacement, the rule it breaks and the tests expected to kill it.

The native sources are copied once into build/mutate/native/src and configured there (Ninja, Release,
the test extension on); each mutant is planted in that copy, only its extensions are rebuilt (the
object files of unchanged sources are reused), the file is restored, and its tests run with
build/mutate/native/overlay first on PYTHONPATH: its sitecustomize.py (tests/mutation/native_site.py)
imports the mutated `tbpipe._native`/`_native_test` ahead of the installed ones, in the test process
and in the processes it starts. Link-time optimization is left out of this build (every link would
recompile the whole core): it changes no defined behaviour, and the unmutated build must pass every
listed test first. A mutant is killed when its tests fail, crash or run past their time limit.

    python tests/mutation/native.py [--budget MINUTES] [NAME ...]
    python tests/mutation/native.py compile COMPILER ARGS...   # the build's compiler launcher
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "build" / "mutate" / "native"
MUTANTS = HERE / "native_mutants.toml"
EXTENSIONS = ("_native", "_native_test")
# What the build copies: the sources CMakeLists.txt globs and the file itself.
SOURCES = ("CMakeLists.txt", "native")
# A mutant's tests may take this many times their unmutated wall time (plus a constant) first: wall,
# not CPU, since the limit is a wall clock and the machine's load varies during a run.
TIMEOUT_MULTIPLIER, TIMEOUT_CONSTANT_S = 5.0, 60.0
KILLED, SURVIVED, EQUIVALENT, BUILD_FAILED, NOT_RUN = "killed", "survived", "equivalent", "build failed", "not run"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under native/
    original: str
    replacement: str
    rule: str
    tests: tuple[str, ...]
    targets: tuple[str, ...] = ("_native",)
    equivalent: str = ""  # why no user could tell, when it cannot be killed


@dataclass
class Outcome:
    result: str = NOT_RUN
    killed_by: str = ""
    cpu_s: float = 0.0


def load_mutants(path: Path = MUTANTS) -> list[Mutant]:
    """The listed mutants, each checked against the sources: its file and tests exist, and its
    original text occurs exactly once (else the list no longer says what it plants)."""
    mutants, problems = [], []
    for entry in tomllib.loads(path.read_text())["mutant"]:
        try:
            mutant = Mutant(**{key: tuple(value) if isinstance(value, list) else value for key, value in entry.items()})
        except TypeError as error:  # a field missing or unknown
            problems.append(f"{entry.get('name', entry)}: {error}")
            continue
        source = ROOT / "native" / mutant.file
        if not source.is_file():
            problems.append(f"{mutant.name}: native/{mutant.file} does not exist")
            continue
        count = source.read_text().count(mutant.original)
        if count != 1:
            problems.append(f"{mutant.name}: its original text occurs {count} times in native/{mutant.file}, not once")
        problems += [
            f"{mutant.name}: test file {test} does not exist"
            for test in mutant.tests
            if not (ROOT / test.partition("::")[0]).is_file()
        ]
        problems += [f"{mutant.name}: unknown target {target}" for target in mutant.targets if target not in EXTENSIONS]
        mutants.append(mutant)
    names = [mutant.name for mutant in mutants]
    problems += [f"{name}: listed twice" for name in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise SystemExit(f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(problems))
    return mutants


def without_lto(arguments: list[str]) -> list[str]:
    """A compiler command without link-time optimization: plain object files, quick links."""
    return [a for a in arguments if not (a == "-flto" or a.startswith("-flto=") or a == "-fno-fat-lto-objects")]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sync_sources(src: Path) -> None:
    """The repository's build sources in `src`, rewriting only files whose text differs so that
    Ninja rebuilds only what changed (a mutant's file restored by the last run included)."""
    wanted = set()
    for top in SOURCES:
        origin = ROOT / top
        for path in [origin] if origin.is_file() else sorted(p for p in origin.rglob("*") if p.is_file()):
            relative = path.relative_to(ROOT)
            wanted.add(relative)
            target = src / relative
            if not target.is_file() or target.read_bytes() != path.read_bytes():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
    for path in [p for p in src.rglob("*") if p.is_file()]:
        if path.relative_to(src) not in wanted:
            path.unlink()


def tool(name: str) -> str:
    """The `mutate` extra's build tool beside this Python (make runs without the venv on PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or name


def configure(src: Path, build: Path) -> None:
    if (build / "build.ninja").exists():
        return
    import pybind11

    launcher = f"{sys.executable};{Path(__file__).resolve()};compile"
    definitions = {
        "CMAKE_MAKE_PROGRAM": tool("ninja"),
        "CMAKE_BUILD_TYPE": "Release",
        "TBPIPE_BUILD_TESTING": "ON",
        "Python_EXECUTABLE": sys.executable,
        "pybind11_DIR": pybind11.get_cmake_dir(),
        "CMAKE_CXX_COMPILER_LAUNCHER": launcher,
    }
    command = [tool("cmake"), "-S", str(src), "-B", str(build), "-G", "Ninja"]
    command += [f"-D{name}={value}" for name, value in definitions.items()]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def build_extensions(build: Path, targets: tuple[str, ...], log: Path) -> bool:
    with open(log, "w") as out:
        command = ["nice", "-n", "19", tool("cmake"), "--build", str(build), "--target", *targets]
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode == 0


def place_overlay(build: Path, overlay: Path) -> None:
    """The built extensions and the finder that imports them first, in `overlay`."""
    (overlay / "tbpipe").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HERE / "native_site.py", overlay / "sitecustomize.py")
    for name in EXTENSIONS:
        for built in build.glob(f"{name}.*.so"):
            shutil.copyfile(built, overlay / "tbpipe" / built.name)


def overlay_env(overlay: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), env.get("PYTHONPATH")]))
    return env


def check_overlay_is_imported(overlay: Path) -> None:
    """Both extensions load from the overlay, not from the install."""
    script = "import tbpipe._native as a, tbpipe._native_test as b; print(a.__file__); print(b.__file__)"
    files = subprocess.run(
        [sys.executable, "-c", script], env=overlay_env(overlay), cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = [f for f in files if not Path(f).resolve().is_relative_to(overlay.resolve())]
    if len(files) != 2 or outside:
        raise SystemExit(f"the mutated extensions are not the ones imported: {files}")


def run_tests(
    tests: tuple[str, ...], overlay: Path, timeout_s: float | None, log: Path
) -> tuple[int | None, str, float, float]:
    """(pytest's exit status, None past the time limit; the first failing test; CPU and wall seconds)."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:random_order", "-p", "no:cacheprovider"]
    command += ["-p", "sitecustomize"]  # the overlay's finder, also a plugin: no shrinking (native_site.py)
    before, started = children_cpu_s(), time.monotonic()
    with open(log, "w") as out:
        try:
            status = subprocess.run(
                [*command, *tests], cwd=ROOT, env=overlay_env(overlay), stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout_s,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            status = None
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", log.read_text(), re.MULTILINE)
    return status, failed.group(1) if failed else "", children_cpu_s() - before, time.monotonic() - started


def plant(src: Path, mutant: Mutant) -> str:
    """Writes the mutant into the copy; returns the file's text to restore."""
    path = src / "native" / mutant.file
    text = path.read_text()
    if text.count(mutant.original) != 1:
        raise SystemExit(f"{mutant.name}: the original text is not in {path} exactly once")
    path.write_text(text.replace(mutant.original, mutant.replacement))
    return text


def judge(mutant: Mutant, status: int | None, failed: str) -> Outcome:
    if status is None:
        return Outcome(KILLED, "timed out")
    if status == 0:
        return Outcome(EQUIVALENT if mutant.equivalent else SURVIVED)
    if status < 0 or status > 5:  # a signal (a crash), not pytest's own exit status
        return Outcome(KILLED, failed or f"crashed ({status})")
    return Outcome(KILLED, failed or f"pytest exit {status}")


def baseline(mutants: list[Mutant], build: Path, overlay: Path) -> dict[tuple[str, ...], float]:
    """The unmutated build and each mutant's tests against it: all must pass. Returns their wall time."""
    if not build_extensions(build, EXTENSIONS, WORK / "baseline-build.log"):
        raise SystemExit(f"the unmutated build failed: {WORK / 'baseline-build.log'}")
    place_overlay(build, overlay)
    check_overlay_is_imported(overlay)
    times = {}
    for tests in dict.fromkeys(m.tests for m in mutants):
        status, failed, cpu_s, wall_s = run_tests(tests, overlay, None, WORK / "baseline-tests.log")
        if status != 0:
            raise SystemExit(f"unmutated, {' '.join(tests)} fails ({failed}): see {WORK / 'baseline-tests.log'}")
        times[tests] = wall_s
        print(f"baseline: {' '.join(tests)} passes in {cpu_s:.1f} s CPU ({wall_s:.1f} s wall)", flush=True)
    return times


def table(mutants: list[Mutant], outcomes: dict[str, Outcome]) -> str:
    header = "| mutant | file | rule it breaks | result | killed by | CPU s (build and tests) |"
    rows = [header, "|---|---|---|---|---|---|"]
    for m in mutants:
        o = outcomes[m.name]
        why = f" ({m.equivalent})" if o.result == EQUIVALENT else ""
        rows.append(f"| {m.name} | {m.file} | {m.rule} | {o.result}{why} | {o.killed_by} | {o.cpu_s:.0f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (all by default)")
    parser.add_argument("--budget", type=float, default=40.0, help="minutes in all, the baseline included")
    args = parser.parse_args()
    started = time.monotonic()
    mutants = load_mutants()
    unknown = set(args.names) - {m.name for m in mutants}
    if unknown:
        raise SystemExit(f"unknown mutants {sorted(unknown)}")
    chosen = [m for m in mutants if not args.names or m.name in args.names]
    src, build, overlay = WORK / "src", WORK / "build", WORK / "overlay"
    sync_sources(src)
    configure(src, build)
    times = baseline(chosen, build, overlay)
    outcomes = {m.name: Outcome() for m in chosen}
    for mutant in chosen:
        if time.monotonic() - started > args.budget * 60:
            break
        log = WORK / f"{mutant.name}.log"
        original = plant(src, mutant)
        try:
            cpu_before = children_cpu_s()
            built = build_extensions(build, mutant.targets, log.with_suffix(".build.log"))
        finally:
            (src / "native" / mutant.file).write_text(original)
        if not built:
            outcomes[mutant.name] = Outcome(BUILD_FAILED, cpu_s=children_cpu_s() - cpu_before)
        else:
            place_overlay(build, overlay)
            limit = times[mutant.tests] * TIMEOUT_MULTIPLIER + TIMEOUT_CONSTANT_S
            status, failed, _, _ = run_tests(mutant.tests, overlay, limit, log)
            outcomes[mutant.name] = judge(mutant, status, failed)
            outcomes[mutant.name].cpu_s = children_cpu_s() - cpu_before
        print(f"{mutant.name}: {outcomes[mutant.name].result} {outcomes[mutant.name].killed_by}", flush=True)
    print()
    print(table(chosen, outcomes))
    counts = {
        r: sum(o.result == r for o in outcomes.values()) for r in (KILLED, SURVIVED, EQUIVALENT, BUILD_FAILED, NOT_RUN)
    }
    print("\n" + ", ".join(f"{count} {result}" for result, count in counts.items()))
    print(f"logs: {WORK.relative_to(ROOT)}/NAME.log; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"]:
        # The build's compiler launcher: the compiler's command as CMake gave it, less LTO.
        arguments = without_lto(sys.argv[2:])
        os.execvp(arguments[0], arguments)
    sys.exit(main())
