"""Ingest benchmark: synthetic run directories -> DuckDB, then the call-site query.

    python bench/ingest.py                      # 10M events, 100k unique stacks, 40 runs
    python bench/ingest.py --events 1000000 --stacks 20000 --runs 8
    python bench/ingest.py --events 10000000 --stacks 20000 --runs 1000   # a night of small runs
    python bench/ingest.py --events 10000000 --stacks 20000 --runs 1000 --runs-per-transaction 1

Steps, each timed:
1. generate the runs (numpy; kept in --work and reused when the parameters match),
2. warm the symbol store: every distinct native address symbolized once (the "cold" cost),
3. ingest every run into a fresh database (symbols known: the target is <= 10 s for 10M events,
   <= 15 s for 10M events in 1,000 runs),
   and, as the anchor, DuckDB alone copying the same events Parquet into a table (target: the
   ingest within 2x of it); then the same copy made in a transaction per run, as the ingest loads
   with --runs-per-transaction 1: the floor under that mode (by default small runs share a
   transaction), which stores each run's stacks, counts and sites besides,
4. ingest again (every run already present),
5. `call_sites` top-20 over all events (target <= 0.5 s), cold and warm,
6. database bytes per event, against the raw runs' (target: no more).

With --stages, step 3 also says where the ingest's time goes: the loading thread's steps (laying out
the new stacks, each transaction's statements and commit, the wait for prepared runs, the close),
which follow one another and add up to the wall time, and the time the threads beside it spend reading,
checking and hashing the runs ahead, and loading the next transaction's events while the loading
thread finishes the one before (wall time on those threads, and their own CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--stacks", type=int, default=100_000, help="unique stacks")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of stack popularity")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tbpipe-bench-ingest")
    parser.add_argument("--cache-dir", type=Path, default=None, help="symbol store [default: WORK/symbols]")
    parser.add_argument("--keep-db", action="store_true", help="keep the database (WORK/bench.duckdb)")
    parser.add_argument("--stages", action="store_true", help="print where the ingest's time goes, per stage")
    parser.add_argument(
        "--runs-per-transaction",
        type=int,
        default=None,
        help="as tbpipe ingest --runs-per-transaction [default: as the ingest, small runs together]",
    )
    parser.add_argument(
        "--no-written-hashes",
        action="store_true",
        help="runs without the stack hashes the capture writes (as captures before raw schema 4 wrote them)",
    )
    return parser.parse_args()


def _generate(args: argparse.Namespace):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the helpers shared with the tests
    from support.synthetic import PARTS_FORMAT, SyntheticConfig, generate

    config = SyntheticConfig(
        runs=args.runs,
        events=args.events,
        unique_stacks=args.stacks,
        zipf_s=args.zipf,
        written_hashes=not args.no_written_hashes,
    )
    key = json.dumps({k: getattr(config, k) for k in config.__dataclass_fields__}, sort_keys=True) + sys.version
    key += f" parts format {PARTS_FORMAT}"
    runs_dir = args.work / "runs"
    stamp = args.work / "runs.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        info = json.loads(stamp.read_text())
        print(
            f"runs: reusing {runs_dir} ({info['runs']} runs, {info['events']:,} events, {info['stacks_used']:,} stacks used)"
        )
        return info
    shutil.rmtree(runs_dir, ignore_errors=True)
    started = time.perf_counter()
    generated = generate(runs_dir, config)
    info = {"key": key, "runs": generated.runs, "events": generated.events, "stacks_used": generated.stacks_used}
    stamp.write_text(json.dumps(info))
    size = sum(p.stat().st_size for p in runs_dir.rglob("*") if p.is_file())
    print(
        f"runs: generated {generated.runs} runs, {generated.events:,} events, {generated.stacks_used:,} of "
        f"{args.stacks:,} stacks used, {len(generated.modules)} real modules, {size / 1e6:.0f} MB raw, "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return info


def _warm_symbols(runs_dir: Path, cache_dir: Path) -> None:
    """Symbolizes every distinct native address of the runs once, through the persistent store."""
    import duckdb

    from tbpipe.pipeline.db.connection import query_arrow
    from tbpipe.pipeline.symbols import ModuleRef, Symbolizer

    started = time.perf_counter()
    con = duckdb.connect()
    addresses = query_arrow(
        con,
        f"""
        WITH frames AS (
            SELECT filename, unnest(native) AS f FROM read_parquet('{runs_dir}/*/stacks-*.parquet', filename = true)
        ), modules AS (
            SELECT DISTINCT build_id, path, module_index, regexp_extract(filename, '(.*)/[^/]*$', 1) AS dir
            FROM read_parquet('{runs_dir}/*/modules-*.parquet', filename = true)
        )
        SELECT m.build_id, any_value(m.path) AS path,
               list(DISTINCT struct_pack(a := f.f.offset, e := (f.f.flags & 4) <> 0)) AS keys
        FROM frames f JOIN modules m ON m.dir = regexp_extract(f.filename, '(.*)/[^/]*$', 1) AND m.module_index = f.f.module
        WHERE (f.f.flags & 128) = 0
        GROUP BY m.build_id
        """,
    )
    requests = {}
    total = 0
    for row in addresses.to_pylist():
        keys = row["keys"]
        total += len(keys)
        requests[ModuleRef(row["build_id"], row["path"])] = ([k["a"] for k in keys], [k["e"] for k in keys])
    with Symbolizer(cache_dir=cache_dir, progress=False) as symbolizer:
        symbolizer.symbolize_arrow(requests)
    print(
        f"symbols: {total:,} distinct native addresses in {len(requests)} modules warmed in {time.perf_counter() - started:.1f} s"
    )


# The ingest's stages: (where, function, label, part). The loading thread lays out each batch's new
# stacks ("layout"), then loads its runs ("load", one transaction at a time): those run one after
# another and are the ingest's wall time, with the wait for prepared runs and the rest (open,
# migrations, close and its checkpoint). A stage of a part counts only inside that part's step (a
# commit outside a load is the rest's). The preparing threads ("prepare") read, check and hash the
# next runs meanwhile: their time is shown apart, as it overlaps the loading.
LAYOUT, LOAD, PREPARE = "layout", "load", "prepare"
INGEST = "tbpipe.pipeline.db.ingest"
FLOW, READ, LAY, LOADING = (f"{INGEST}.{name}" for name in ("flow", "read_ahead", "lay_out", "load"))
STEPS = {LAYOUT: "lay out new stacks", LOAD: "load runs"}  # each part's own step
# A transaction's events are loaded on the events thread: beside the layout for a batch's first
# transaction, beside the transaction before it otherwise.
EVENTS_BESIDE = "load events + counts (the events thread)"
STAGES = [
    (FLOW, "open_database", "open the database (and migrate it)", None),
    (FLOW, "lay_out", STEPS[LAYOUT], None),
    (FLOW, "assign_stack_ids", "find known stacks", None),
    (f"{LAY}.layout", "combined_slots", "combined order (slots)", LAYOUT),
    (f"{INGEST}.symbols.SymbolLoader", "symbols_for", "symbols for new frames", LAYOUT),
    (f"{LAY}.layout", "expand", "inline expansion, distinct frames", LAYOUT),
    (LAY, "resolve_frames", "frame ids", LAYOUT),
    (LAY, "sites_of_laid_out", "site new stacks", LAYOUT),
    (f"{LOADING}.Loader", "load", STEPS[LOAD], None),
    (f"{INGEST}.rows", "insert_modules", "insert modules", LOAD),
    (f"{INGEST}.rows", "insert_stacks", "insert stacks + frames", LOAD),
    (LOADING, "insert_sites", "insert sites", LOAD),
    (f"{LOADING}.Loader", "_load_events", EVENTS_BESIDE, PREPARE),
    (LOADING, "insert_site_counts", "site counts", LOAD),
    (f"{INGEST}.rows", "insert_runs", "insert runs", LOAD),
    (f"{INGEST}.rows", "insert_run_modules", "insert run modules", LOAD),
    (f"{INGEST}.tables.Transaction", "__exit__", "commit", LOAD),
    (FLOW, "_count_new_frames", "summary counts", None),
    (READ, "read_manifest", "manifest", PREPARE),
    (READ, "read_tables", "read stacks/modules/code parts", PREPARE),
    (READ, "events_part", "events parts: checksums, names, stackless", PREPARE),
    (READ, "flatten_run", "flatten + hash stacks", PREPARE),
    # A run whose stacks are all stored: their hashes and references, without the frames.
    (READ, "read_stack_keys", "read stacks without frames (all stored)", PREPARE),
]
WAITING = "waiting for prepared runs"


class _StageTimes:
    """Wraps the stage functions: wall time of each stage and CPU time of the thread that runs it
    (the loading thread, or a preparing one), and the loading thread's wait for prepared runs."""

    def __init__(self) -> None:
        import importlib

        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inside = {part: 0 for part in STEPS}  # the loading thread's steps under way
        self._lock = threading.Lock()  # the preparing threads add up their stages side by side
        self._undo = []
        for owner, name, label, part in STAGES:
            self._wrap(self._resolve(importlib, owner), name, self._timed(label, part))
        ahead = self._resolve(importlib, f"{READ}.ReadAhead")
        self._wrap(ahead, "__iter__", self._timed_iteration)

    def _wrap(self, target, name, make) -> None:
        original = getattr(target, name)
        self._undo.append((target, name, original))
        setattr(target, name, make(original))

    @staticmethod
    def _resolve(importlib, dotted: str):
        parts = dotted.split(".")
        for split in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for attribute in parts[split:]:
                obj = getattr(obj, attribute)
            return obj
        raise ImportError(dotted)

    def _add(self, label: str, wall: float, cpu: float) -> None:
        with self._lock:
            self.wall[label] = self.wall.get(label, 0.0) + wall
            self.cpu[label] = self.cpu.get(label, 0.0) + cpu
            self.calls[label] = self.calls.get(label, 0) + 1

    def _timed(self, label, part):
        step = next((p for p, name in STEPS.items() if name == label), None)

        def make(function):
            def timed(*args, **kwargs):
                here = threading.current_thread() is threading.main_thread()
                name = label
                if part in STEPS and not (here and self._inside[part]):
                    return function(*args, **kwargs)
                wall, cpu = time.perf_counter(), time.thread_time()
                if step is not None:
                    self._inside[step] += 1
                try:
                    return function(*args, **kwargs)
                finally:
                    if step is not None:
                        self._inside[step] -= 1
                    self._add(name, time.perf_counter() - wall, time.thread_time() - cpu)

            return timed

        return make

    def _timed_iteration(self, original):
        timer = self

        def iterate(ahead):
            runs = original(ahead)
            while True:
                started = time.perf_counter()
                try:
                    item = next(runs)
                except StopIteration:
                    return
                finally:
                    timer._add(WAITING, time.perf_counter() - started, 0.0)
                yield item

        return iterate

    def restore(self) -> None:
        for target, name, original in reversed(self._undo):
            setattr(target, name, original)

    def _line(self, label: str, indent: int, seconds: float, note: str = "") -> None:
        print(f"  {'  ' * indent}{label:<{44 - 2 * indent}} {seconds:7.2f} s{note}")

    def print(self, total_wall: float, total_cpu: float, runs: int, new_stacks: int) -> None:
        print(
            f"stages: {total_wall:.1f} s wall, {total_cpu:.1f} s CPU (all threads) for {runs} runs, {new_stacks:,} new stacks"
        )
        print("  the loading thread, one step after another (wall time):")
        accounted = 0.0
        opened = self.wall.get("open the database (and migrate it)", 0.0)
        accounted += opened
        self._line("open the database (and migrate it)", 1, opened)
        for part, per, count, scale, unit in (
            (LAYOUT, "new stack", new_stacks, 1e6, "us"),
            (LOAD, "run", runs, 1e3, "ms"),
        ):
            parent = STEPS[part]
            wall = self.wall.get(parent, 0.0)
            accounted += wall
            each = f", {wall / count * scale:,.1f} {unit} a {per}" if count else ""
            self._line(parent, 1, wall, f" ({self.calls.get(parent, 0)} calls{each})")
            inside = [(label, self.wall[label]) for _o, _n, label, p in STAGES if p == part and label in self.wall]
            for label, seconds in sorted(inside, key=lambda item: -item[1]):
                # CPU of the thread: what DuckDB does on it too (a small transaction's statements
                # run there alone); much less than the wall time means waiting (locks, the GIL, cores).
                self._line(
                    label, 2, seconds, f" ({self.calls[label]} calls; {self.cpu[label]:.2f} s CPU of the thread)"
                )
            self._line("the rest of it", 2, wall - sum(seconds for _label, seconds in inside))
        for label in ("find known stacks", "summary counts", WAITING):
            accounted += self.wall.get(label, 0.0)
            self._line(label, 1, self.wall.get(label, 0.0))
        self._line("the rest (closing, with its checkpoint)", 1, total_wall - accounted)
        # Wall time summed over the workers (it overlaps the loading), and the CPU time of the worker
        # threads themselves (Arrow decodes a big part's columns on its own pool, not counted there).
        print("  the threads beside the loading one, preparing runs and loading events (time on them, summed):")
        for _o, _n, label, part in STAGES:
            if part == PREPARE and label in self.wall:
                per_run = f", {self.wall[label] / runs * 1e3:.1f} ms a run" if runs else ""
                note = f" ({self.calls[label]} calls{per_run}; {self.cpu[label]:.2f} s CPU of the thread)"
                self._line(label, 1, self.wall[label], note)


def _ingest(
    runs_dir: Path, db: Path, cache_dir: Path, label: str, stages: bool = False, per_transaction: int | None = None
):
    import resource

    from tbpipe.pipeline.db import IngestOptions, ingest_runs

    timer = _StageTimes() if stages else None
    cpu_started = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    started = time.perf_counter()
    try:
        options = IngestOptions(db_path=db, cache_dir=cache_dir, progress=False, runs_per_transaction=per_transaction)
        summary = ingest_runs([runs_dir], options)
    finally:
        if timer is not None:
            timer.restore()
    seconds = time.perf_counter() - started
    cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu_started
    rate = summary.events / seconds if seconds else 0
    print(
        f"{label}: {summary.ingested} runs ingested, {summary.present} present, {summary.events:,} events, "
        f"{summary.new_stacks:,} new stacks, frames {summary.frames_symbolized:,} symbolized / "
        f"{summary.frames_unsymbolized:,} not, in {seconds:.1f} s ({rate / 1e6:.2f} M events/s)"
    )
    if summary.quarantined:
        raise SystemExit(f"quarantined: {[o.reason for o in summary.quarantined]}")
    if timer is not None:
        timer.print(seconds, cpu, summary.ingested, summary.new_stacks)
    return summary, seconds


def _timed_anchor(work: Path, name: str, fill: Callable[[Any], None]) -> tuple[float, float]:
    """(wall, CPU) seconds of a new database file WORK/NAME opened, filled by `fill(connection)` and
    closed (its checkpoint included); the file is removed after."""
    import resource

    import duckdb

    db = work / name
    db.unlink(missing_ok=True)
    cpu_started = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    started = time.perf_counter()
    con = duckdb.connect(str(db))
    fill(con)
    con.close()
    seconds = time.perf_counter() - started
    cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu_started
    db.unlink(missing_ok=True)
    return seconds, cpu


def _duckdb_copy(runs_dir: Path, work: Path) -> tuple[float, float]:
    """The anchor: DuckDB alone copying the same events Parquet parts into a table of a new database
    file (read, decompress, store, checkpoint), as (wall, CPU) seconds."""
    parts = sorted(str(p) for p in runs_dir.glob("*/events-*.parquet"))  # raw.table_file_name("events", n)

    def copy(con) -> None:
        con.execute("CREATE TABLE events AS SELECT * FROM read_parquet(?)", [parts])

    return _timed_anchor(work, "anchor-copy.duckdb", copy)


def _duckdb_copy_per_run(runs_dir: Path, work: Path) -> tuple[float, float]:
    """The floor of an ingest at one transaction per run: DuckDB alone copying each run's events
    Parquet parts into a table in a transaction of its own (BEGIN, one INSERT, COMMIT), with the
    ingest's settings (DuckDB's threads: one below `one_thread_below_events` events; one checkpoint,
    at the close), as (wall, CPU) seconds. Nothing else of a run is stored: its stacks, counts, sites
    and run row come on top."""
    import pyarrow.parquet as pq

    from tbpipe.pipeline.db.ingest.tuning import IngestLimits, checkpoint_at_close

    runs = [sorted(str(p) for p in run.glob("events-*.parquet")) for run in sorted(runs_dir.iterdir())]
    runs = [(parts, sum(pq.ParquetFile(p).metadata.num_rows for p in parts)) for parts in runs if parts]

    def copy(con) -> None:
        default_threads = con.execute("SELECT current_setting('threads')").fetchone()[0]
        checkpoint_at_close(con)
        con.execute("CREATE TABLE events AS SELECT * FROM read_parquet(?) LIMIT 0", [runs[0][0]])
        for parts, events in runs:
            con.execute(f"SET threads = {1 if events < IngestLimits().one_thread_below_events else default_threads}")
            con.execute("BEGIN TRANSACTION")
            con.execute("INSERT INTO events SELECT * FROM read_parquet(?)", [parts])
            con.execute("COMMIT")
        con.execute(f"SET threads = {default_threads}")  # for the closing checkpoint, as the ingest

    return _timed_anchor(work, "anchor-per-run.duckdb", copy)


TOP_SITES = """
SELECT name, site_function, site_file, site_line, sum(events) AS events
FROM call_sites
GROUP BY ALL
ORDER BY events DESC
LIMIT 20
"""


def _query(db: Path) -> tuple[float, float]:
    from tbpipe.pipeline.db import open_database
    from tbpipe.pipeline.db.connection import query_rows

    con = open_database(db, read_only=True)
    try:
        started = time.perf_counter()
        rows = query_rows(con, TOP_SITES)
        first = time.perf_counter() - started
        warm = []
        for _ in range(3):
            started = time.perf_counter()
            query_rows(con, TOP_SITES)
            warm.append(time.perf_counter() - started)
        events = query_rows(con, "SELECT count(*) FROM events")[0][0]
    finally:
        con.close()
    print(f"query: call_sites top-20 over {events:,} events: {first:.2f} s first, {min(warm):.2f} s warm (best of 3)")
    top = rows[0]
    print(f"       top site: {top[4]:,} x {top[0][:50]} at {top[1]} ({top[2]}:{top[3]})")
    return first, min(warm)


def _sizes(db: Path) -> tuple[int, int]:
    """(file bytes, bytes in used blocks): DuckDB keeps blocks freed by a checkpoint in the file for reuse."""
    from tbpipe.pipeline.db import open_database
    from tbpipe.pipeline.db.connection import query_rows

    wal = db.with_name(db.name + ".wal")
    size = db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    con = open_database(db, read_only=True)
    try:
        block_size, total, free = query_rows(
            con, "SELECT block_size, total_blocks, free_blocks FROM pragma_database_size()"
        )[0]
    finally:
        con.close()
    return size, (total - free) * block_size


def main() -> None:
    args = _args()
    args.work.mkdir(parents=True, exist_ok=True)
    cache_dir = args.cache_dir or args.work / "symbols"
    print(f"tbpipe ingest bench on {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    info = _generate(args)
    runs_dir = args.work / "runs"
    _warm_symbols(runs_dir, cache_dir)
    db = args.work / "bench.duckdb"
    for path in (db, db.with_name(db.name + ".wal")):
        path.unlink(missing_ok=True)
    per_transaction = args.runs_per_transaction
    label = {None: "ingest", 1: "ingest, a transaction per run"}.get(
        per_transaction, f"ingest, {per_transaction} runs a transaction"
    )
    summary, seconds = _ingest(runs_dir, db, cache_dir, label, args.stages, args.runs_per_transaction)
    _ingest(runs_dir, db, cache_dir, "re-ingest")
    copy_seconds, copy_cpu = _duckdb_copy(runs_dir, args.work)
    ratio = seconds / copy_seconds
    print(
        f"anchor: DuckDB copies the same events Parquet into a table in {copy_seconds:.1f} s "
        f"({copy_cpu:.1f} s CPU); the ingest takes {ratio:.1f}x that"
    )
    per_run_seconds, per_run_cpu = _duckdb_copy_per_run(runs_dir, args.work)
    print(
        f"        and in a transaction per run ({info['runs']} transactions, the events alone) in "
        f"{per_run_seconds:.1f} s ({per_run_cpu:.1f} s CPU): {per_run_seconds / copy_seconds:.1f}x the copy; "
        f"the ingest takes {seconds / per_run_seconds:.1f}x that"
    )
    first, warm = _query(db)
    size, used = _sizes(db)
    events = max(summary.events, 1)
    raw = sum(p.stat().st_size for p in runs_dir.rglob("*.parquet")) / events
    print(
        f"size: {size / 1e6:.0f} MB database file, {size / events:.1f} bytes per event "
        f"({used / 1e6:.0f} MB in used blocks: {used / events:.1f} bytes per event); the raw runs' Parquet "
        f"{raw:.1f} bytes per event"
    )
    verdict = []
    verdict.append(f"ingest vs DuckDB's copy {'OK' if ratio <= 2 else 'SLOW'} ({ratio:.1f}x vs 2x)")
    verdict.append(f"size {'OK' if size <= raw * events else 'BIG'} ({size / events:.1f} vs {raw:.1f} bytes per event)")
    if info["events"] >= 10_000_000:
        # The two nights of the targets: 10M events in a few big runs (<= 10 s), or in 1,000 small ones (<= 15 s).
        limit = 15 if info["runs"] >= 1000 else 10
        below = (
            f"; below the floor of a transaction per run, {per_run_seconds:.1f} s"
            if args.runs_per_transaction == 1 and per_run_seconds > limit
            else ""
        )
        verdict.append(f"ingest {'OK' if seconds <= limit else 'SLOW'} ({seconds:.1f} s vs {limit} s{below})")
        verdict.append(f"query {'OK' if warm <= 0.5 else 'SLOW'} ({warm:.2f} s vs 0.5 s)")
    if verdict:
        print("targets: " + "; ".join(verdict))
    if not args.keep_db:
        db.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
