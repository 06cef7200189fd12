"""Symbolization benchmark: binutils addr2line, llvm-symbolizer and tbpipe on the same addresses.

    python bench/symbolize.py                 # 20k random libc + 100k random libpython addresses
    python bench/symbolize.py --quick         # 5k + 20k, for a smoke run
    python bench/symbolize.py --torch         # also libtorch_cpu.so (symbols only): time, peak memory
    python bench/symbolize.py --debuginfod-only   # only the debuginfod comparison below

Each address set is uniform over the module's executable segments (fixed seed). Every tool reads
the same file of addresses on stdin and writes to a file; wall times are the best of --repeat
runs, measured in this run, and ratios are against binutils `addr2line -afiC` from this run:

- tbpipe cold:  `tbpipe addr2line -afiC` with an empty store (finds debug info, builds the
                SymCache, resolves every address, stores the results)
- tbpipe warm:  the same command again: the store knows every address
- "python -m tbpipe.pipeline.commands.addr2line": the same two runs without loading the other
                CLI commands (their imports are part of every `tbpipe` call)
- tbpipe warm, new addresses: stored SymCache, addresses it has not seen (another seed)
- bulk, known:  `Symbolizer.symbolize_arrow` / `symbolize_many` in this process on addresses the
                store already knows (what an ingest of old modules costs), in addresses/s

- debuginfod:   the cold libc run with its debug file downloaded from elfutils' `debuginfod`
                on a loopback port (empty store, empty debuginfod cache, no local debug root)
                against the same with the local debug file, as a ratio; both outputs must match

Accuracy is checked against llvm-symbolizer (JSON output): the inline chain, file and line of
every address. Targets: cold <= 1.5x binutils (goal 1.0x), warm <= 1.0x (goal 0.2x), bulk known
>= 1M addresses/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the helpers shared with the tests
from support.addresses import sample_code_addresses  # noqa: E402

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
LIBPYTHON = os.path.expanduser("~/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0")


def tbpipe_command() -> list[str]:
    beside = Path(sys.executable).with_name("tbpipe")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("tbpipe")
    if found:
        return [found]
    return [sys.executable, "-c", "from tbpipe.pipeline.cli import main; main()"]


def timed(command: list[str], stdin_path: Path, stdout_path: Path, env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS in KiB) of one run."""
    wrapper = ["/usr/bin/time", "-f", "%M", "-o", str(stdout_path) + ".rss"] if Path("/usr/bin/time").exists() else []
    with open(stdin_path, "rb") as stdin, open(stdout_path, "wb") as stdout:
        start = time.perf_counter()
        subprocess.run(wrapper + command, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, check=True, env=env)
        wall = time.perf_counter() - start
    rss = 0
    if wrapper:
        try:
            rss = int(Path(str(stdout_path) + ".rss").read_text().split()[-1])
        except (OSError, ValueError, IndexError):
            rss = 0
    return wall, rss


def best_of(repeat: int, run) -> tuple[float, int]:
    results = [run() for _ in range(repeat)]
    return min(r[0] for r in results), max(r[1] for r in results)


def llvm_chains(path: Path) -> list[list[tuple[str | None, int | None]]]:
    chains = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        symbols = json.loads(line)["Symbol"]
        chain = [
            (os.path.normpath(s["FileName"]) if s["Line"] and s["FileName"] else None, s["Line"] or None)
            for s in symbols
        ]
        if chain == [(None, None)] and not symbols[0]["FunctionName"]:
            chain = []
        chains.append(chain)
    return chains


def agreement(expected: list, results: list) -> float:
    same = 0
    for chain, frames in zip(expected, results):
        ours = [(f.file if f.line else None, f.line) for f in frames if not (f.function is None and f.file is None)]
        same += chain == ours
    return same / max(1, len(expected))


def bench_module(name: str, module: str, count: int, args, tbpipe: list[str], workdir: Path) -> list[tuple]:
    from tbpipe.pipeline.symbols import DebugInfoLocator, ModuleRef, Symbolizer
    from tbpipe.pipeline.symbols.elf import read_build_id

    addresses = sample_code_addresses(module, count, seed=1)
    fresh = sample_code_addresses(module, count, seed=2)
    address_file = workdir / f"{name}.txt"
    fresh_file = workdir / f"{name}-fresh.txt"
    address_file.write_text("".join(f"{a:#x}\n" for a in addresses))
    fresh_file.write_text("".join(f"{a:#x}\n" for a in fresh))
    rows = []

    binutils, binutils_rss = best_of(
        args.repeat, lambda: timed(["addr2line", "-afiC", "-e", module], address_file, workdir / "binutils.out")
    )
    rows.append((name, "binutils addr2line -afiC", binutils, binutils_rss))
    llvm, llvm_rss = best_of(
        args.repeat, lambda: timed(["llvm-symbolizer", f"--obj={module}", "-afiC"], address_file, workdir / "llvm.out")
    )
    rows.append((name, "llvm-symbolizer -afiC", llvm, llvm_rss))
    # The oracle reads the debug file itself: given a stripped module, llvm-symbolizer takes
    # DWARF from the debug file but function names from the module's .dynsym only.
    located = DebugInfoLocator().locate(read_build_id(module), module)
    oracle_input = located.chosen.path if located.chosen else module
    timed(
        ["llvm-symbolizer", f"--obj={oracle_input}", "--output-style=JSON", "-fiC"], address_file, workdir / "llvm.json"
    )

    command = tbpipe + ["addr2line", "-afiC", "-e", module]
    # The same command without the rest of the CLI: what tbpipe's own start-up costs on top.
    alone = [sys.executable, "-m", "tbpipe.pipeline.commands.addr2line", "-afiC", "-e", module]
    for label, argv in (("tbpipe addr2line", command), ("  same, python -m ...addr2line", alone)):
        cold_runs = []
        for attempt in range(args.repeat):
            store = workdir / f"store-{name}-{label[:3]}-{attempt}"
            shutil.rmtree(store, ignore_errors=True)
            cold_runs.append(timed(argv + ["--cache-dir", str(store)], address_file, workdir / "tbpipe.out"))
        cold = min(r[0] for r in cold_runs), max(r[1] for r in cold_runs)
        rows.append((name, f"{label}: cold (empty store)", *cold))
        store = workdir / f"store-{name}-{label[:3]}-0"
        warm = best_of(
            args.repeat,
            lambda argv=argv, store=store: timed(
                argv + ["--cache-dir", str(store)], address_file, workdir / "tbpipe-warm.out"
            ),
        )
        rows.append((name, f"{label}: warm (known addresses)", *warm))
    store = workdir / f"store-{name}-{'tbpipe addr2line'[:3]}-0"
    fresh_runs = []
    for attempt in range(args.repeat):
        # Each attempt needs addresses the store has not seen: a store with the SymCache only.
        copy = workdir / f"store-{name}-fresh-{attempt}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(store, copy)
        for segment in copy.rglob("known-*.seg"):
            segment.unlink()
        fresh_runs.append(timed(command + ["--cache-dir", str(copy)], fresh_file, workdir / "tbpipe-fresh.out"))
    rows.append(
        (
            name,
            "tbpipe addr2line: stored SymCache, new addresses",
            min(r[0] for r in fresh_runs),
            max(r[1] for r in fresh_runs),
        )
    )

    # The library paths, in this process, on the filled store.
    import numpy as np

    ref = ModuleRef(read_build_id(module), module)
    symbolizer = Symbolizer(cache_dir=store, jobs=args.jobs)
    array = np.asarray(addresses, dtype=np.uint64)
    exact = np.ones(len(array), dtype=bool)
    start = time.perf_counter()
    symbolizer.symbolize_arrow({ref: (array, exact)})
    first = time.perf_counter() - start
    best = min(_timed_call(lambda: symbolizer.symbolize_arrow({ref: (array, exact)})) for _ in range(args.repeat))
    rows.append((name, f"bulk known: symbolize_arrow (1st call {first:.3f} s)", best, 0, count / best))
    best_list = min(
        _timed_call(lambda: symbolizer.symbolize_many({ref: (addresses, None)})) for _ in range(args.repeat)
    )
    rows.append((name, "bulk known: symbolize_many (frame lists)", best_list, 0, count / best_list))
    results = symbolizer.symbolize_many({ref: (addresses, None)})[ref]
    symbolizer.close()

    expected = llvm_chains(workdir / "llvm.json")
    rows.append((name, f"same chain/file/line as llvm-symbolizer: {agreement(expected, results) * 100:.3f}%", None, 0))
    return rows


def _timed_call(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def bench_debuginfod(args, tbpipe: list[str], workdir: Path) -> list[str]:
    """Cold libc with its debug file from a local debuginfod server against the local debug file."""
    from support.debuginfod import DebuginfodServer, debuginfod_missing

    from tbpipe.pipeline.symbols.elf import read_build_id

    missing = debuginfod_missing()
    if missing or not os.path.exists(LIBC):
        return [f"debuginfod: skipped ({missing or LIBC + ' not found'})"]
    build_id = read_build_id(LIBC)
    debug_file = Path("/usr/lib/debug/.build-id") / build_id[:2] / f"{build_id[2:]}.debug"
    if not debug_file.exists():
        return [f"debuginfod: skipped ({debug_file} not found: Debian's libc6-dbg)"]
    served = workdir / "served"
    served.mkdir()
    shutil.copy(debug_file, served / debug_file.name)
    address_file = workdir / "debuginfod-libc.txt"
    address_file.write_text("".join(f"{a:#x}\n" for a in sample_code_addresses(LIBC, args.libc_count, seed=1)))
    command = tbpipe + ["addr2line", "-afiC", "-e", LIBC]
    lines = []
    with DebuginfodServer(served, workdir / "server") as server:
        walls: dict[str, list[float]] = {"local": [], "server": []}
        for attempt in range(args.repeat):
            for place in ("local", "server"):  # alternately, so that both see the same machine
                fresh = workdir / f"debuginfod-{place}-{attempt}"
                env = dict(os.environ, DEBUGINFOD_CACHE_PATH=str(fresh / "debuginfod"))
                where = ["--offline"] if place == "local" else ["--debug-root", str(fresh), "--debuginfod", server.url]
                argv = command + ["--cache-dir", str(fresh / "store"), *where]
                wall, _rss = timed(argv, address_file, workdir / f"debuginfod-{place}.out", env=env)
                walls[place].append(wall)
        same = (workdir / "debuginfod-local.out").read_bytes() == (workdir / "debuginfod-server.out").read_bytes()
        downloads = server.requests()
    local, remote = min(walls["local"]), min(walls["server"])
    size = debug_file.stat().st_size / 1e6
    lines.append(
        f"debuginfod: cold libc, {args.libc_count:,} addresses, best of {args.repeat}: local debug file "
        f"{local:.3f} s, downloaded from the local server ({size:.1f} MB) {remote:.3f} s: "
        f"{remote / local:.2f}x the local file; outputs identical: {same}; files served: {downloads}"
    )
    return lines


def bench_torch(args, tbpipe: list[str], workdir: Path) -> list[tuple]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return [("libtorch_cpu", "skipped: torch is not installed", None, 0)]
    import torch

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.exists():
        return [("libtorch_cpu", f"skipped: {library} not found", None, 0)]
    addresses = sample_code_addresses(str(library), args.torch_count, seed=3)
    address_file = workdir / "torch.txt"
    address_file.write_text("".join(f"{a:#x}\n" for a in addresses))
    rows = []
    wall, rss = timed(["addr2line", "-afiC", "-e", str(library)], address_file, workdir / "torch-binutils.out")
    rows.append(("libtorch_cpu", "binutils addr2line -afiC", wall, rss))
    store = workdir / "store-torch"
    shutil.rmtree(store, ignore_errors=True)
    command = tbpipe + ["addr2line", "-afiC", "-e", str(library), "--cache-dir", str(store)]
    wall, rss = timed(command, address_file, workdir / "torch-cold.out")
    rows.append(("libtorch_cpu", "tbpipe addr2line, cold (symbols only)", wall, rss))
    wall, rss = timed(command, address_file, workdir / "torch-warm.out")
    rows.append(("libtorch_cpu", "tbpipe addr2line, warm", wall, rss))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libc-count", type=int, default=20_000)
    parser.add_argument("--python-count", type=int, default=100_000)
    parser.add_argument("--torch", action="store_true", help="also libtorch_cpu.so (needs torch installed)")
    parser.add_argument("--torch-count", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="5k libc + 20k libpython addresses, one run each")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--debuginfod-only", action="store_true", help="only cold libc from a local debuginfod server vs the local file"
    )
    args = parser.parse_args()
    if args.quick:
        args.libc_count, args.python_count, args.repeat = 5_000, 20_000, 1
    for tool in ("addr2line", "llvm-symbolizer"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found (install binutils and llvm)")
    tbpipe = tbpipe_command()
    workdir = Path(tempfile.mkdtemp(prefix="tbpipe-bench-"))
    rows: list[tuple] = []
    notes: list[str] = []
    try:
        targets = [("libc", LIBC, args.libc_count), ("libpython3.11", LIBPYTHON, args.python_count)]
        for name, module, count in [] if args.debuginfod_only else targets:
            if not os.path.exists(module):
                rows.append((name, f"skipped: {module} not found", None, 0))
                continue
            rows.extend(bench_module(name, module, count, args, tbpipe, workdir))
        if args.torch:
            rows.extend(bench_torch(args, tbpipe, workdir))
        notes.extend(bench_debuginfod(args, tbpipe, workdir))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work directory: {workdir}")

    from rich.console import Console
    from rich.table import Table

    table = Table("module", "run", "wall s", "x binutils", "peak RSS MiB", "addresses/s", title="symbolization")
    baseline: dict[str, float] = {}
    for row in rows:
        module, label, wall, rss = row[:4]
        rate = row[4] if len(row) > 4 else None
        if label.startswith("binutils") and wall:
            baseline[module] = wall
        ratio = f"{wall / baseline[module]:.2f}" if wall and module in baseline and rate is None else ""
        table.add_row(
            module,
            label,
            f"{wall:.3f}" if wall is not None else "",
            ratio,
            f"{rss / 1024:.0f}" if rss else "",
            f"{rate / 1e6:.2f}M" if rate else "",
        )
    if rows:
        Console(width=150).print(table)
    for note in notes:
        print(note)
    print(
        f"(tbpipe command: {' '.join(tbpipe)}; {os.cpu_count()} CPUs; peak RSS of this process "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
