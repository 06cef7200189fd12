"""Export benchmark: `tbpipe export` of every event of a synthetic 10M-event database, per format.

    python bench/export.py                      # 10M events, 100k unique stacks, 40 runs
    python bench/export.py --events 1000000 --stacks 20000 --runs 8
    python bench/export.py --formats pprof

The database is built as `bench/ingest.py` builds it (same generator, same work folder, so its
runs and symbol store are reused) and kept in WORK/export.duckdb while the runs are unchanged.
Each format is exported by the real command line in a child process (all runs, `--run` per run)
and timed, with the child's peak memory; the anchor is DuckDB itself streaming the same events
to Arrow batches (the floor for anything that reads every event). Target: <= 30 s per format
for 10M events.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMATS = ("pprof", "collapsed", "chrome-trace")
TARGET_S = 30.0


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--stacks", type=int, default=100_000, help="unique stacks")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of stack popularity")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tbpipe-bench-ingest")
    parser.add_argument("--cache-dir", type=Path, default=None, help="symbol store [default: WORK/symbols]")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--keep-output", action="store_true", help="keep the exported files (WORK/export.*)")
    return parser.parse_args()


def _database(args: argparse.Namespace) -> Path:
    """WORK/export.duckdb holding the generated runs, ingested once per set of runs."""
    sys.path.insert(0, str(HERE))
    import ingest as ingest_bench  # bench/ingest.py: the generator and the ingest, shared

    info = ingest_bench._generate(args)
    runs_dir = args.work / "runs"
    cache_dir = args.cache_dir or args.work / "symbols"
    db = args.work / "export.duckdb"
    stamp = args.work / "export.json"
    if db.is_file() and stamp.is_file() and json.loads(stamp.read_text()).get("key") == info["key"]:
        print(f"database: reusing {db}")
        return db
    for path in (db, db.with_name(db.name + ".wal"), stamp):
        path.unlink(missing_ok=True)
    ingest_bench._warm_symbols(runs_dir, cache_dir)
    ingest_bench._ingest(runs_dir, db, cache_dir, "ingest")
    stamp.write_text(json.dumps({"key": info["key"]}))
    return db


def _run_ids(db: Path) -> tuple[list[str], int]:
    from tbpipe.pipeline.db import open_database
    from tbpipe.pipeline.db.connection import query_rows

    con = open_database(db, read_only=True)
    try:
        runs = [row[0] for row in query_rows(con, "SELECT run_id FROM runs ORDER BY run_id")]
        events = query_rows(con, "SELECT count(*) FROM events")[0][0]
    finally:
        con.close()
    return runs, events


def _anchor(db: Path) -> float:
    """Seconds for DuckDB to stream every event (the columns the Chrome trace reads) to Arrow batches."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        started = time.perf_counter()
        relation = con.sql("SELECT event_id, run_id, epoch_us(ts), thread_id, kind, name, stack_id, attrs FROM events")
        reader = getattr(relation, "to_arrow_reader", None) or relation.fetch_arrow_reader
        rows = sum(batch.num_rows for batch in reader(1 << 18))
        seconds = time.perf_counter() - started
    finally:
        con.close()
    print(f"anchor: DuckDB streams {rows:,} events to Arrow batches in {seconds:.2f} s")
    return seconds


# The command line in a child that reports its own peak memory when it ends: the kernel's VmHWM
# of the program after exec (a child's ru_maxrss would include this benchmark's own memory).
_CHILD = """
import atexit, sys
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("peak-kb " + line.split()[1] + "\\n")
atexit.register(peak)
sys.argv = ["tbpipe", *sys.argv[1:]]
from tbpipe.pipeline.cli import main
main()
"""


def _cpu_of_children() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _export(db: Path, runs: list[str], fmt: str, out: Path) -> tuple[float, float, int, str]:
    """(seconds, CPU seconds, peak RSS bytes, what the command said) of one `tbpipe export` in a
    child process. CPU time says how much work it was when other processes share the cores."""
    command = [sys.executable, "-c", _CHILD, "export", "--db", str(db), "-f", fmt, "-o", str(out)]
    for run_id in runs:
        command += ["--run", run_id]
    env = {**os.environ, "COLUMNS": "400"}  # its one-line summary, unwrapped
    cpu = _cpu_of_children()
    started = time.perf_counter()
    process = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    seconds = time.perf_counter() - started
    cpu = _cpu_of_children() - cpu
    lines = process.stderr.strip().splitlines()
    if process.returncode != 0:
        raise SystemExit(f"tbpipe export -f {fmt} failed: {process.stderr.strip()}")
    peak = next((int(line.split()[1]) * 1024 for line in lines if line.startswith("peak-kb ")), 0)
    said = [line for line in lines if not line.startswith("peak-kb ")]
    return seconds, cpu, peak, said[-1] if said else ""


def main() -> None:
    args = _args()
    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"tbpipe export bench on {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load average {load:.1f}")
    db = _database(args)
    runs, events = _run_ids(db)
    print(f"database: {len(runs)} runs, {events:,} events, {db.stat().st_size / 1e6:.0f} MB")
    anchor = _anchor(db)
    verdicts = []
    for fmt in args.formats:
        out = args.work / f"export.{fmt}"
        seconds, cpu, peak, said = _export(db, runs, fmt, out)
        size = out.stat().st_size
        print(
            f"{fmt}: {seconds:.1f} s ({cpu:.1f} s CPU; {events / seconds / 1e6:.2f} M events/s, "
            f"{seconds / anchor:.1f}x the anchor), "
            f"{size / 1e6:.0f} MB written, {peak / 1e9:.2f} GB peak RSS"
        )
        print(f"       {said}")
        if events >= 10_000_000:
            verdicts.append(f"{fmt} {'OK' if seconds <= TARGET_S else 'SLOW'} ({seconds:.1f} s vs {TARGET_S:g} s)")
        if not args.keep_output:
            out.unlink(missing_ok=True)
    if verdicts:
        print("targets: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
