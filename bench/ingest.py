"""Ingest benchmark: synthetic run directories -> DuckDB, then the call-site query.

    python bench/ingest.py                      # 10M events, 100k unique stacks, 40 runs
    python bench/ingest.py --events 1000000 --stacks 20000 --runs 8

Steps, each timed:
1. generate the runs (numpy; kept in --work and reused when the parameters match),
2. warm the symbol store: every distinct native address symbolized once (the "cold" cost),
3. ingest every run into a fresh database (symbols known: the target is <= 60 s for 10M events),
4. ingest again (every run already present),
5. `call_sites` top-20 over all events (target <= 1 s), cold and warm,
6. database bytes per event.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--stacks", type=int, default=100_000, help="unique stacks")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of stack popularity")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tbpipe-bench-ingest")
    parser.add_argument("--cache-dir", type=Path, default=None, help="symbol store [default: WORK/symbols]")
    parser.add_argument("--keep-db", action="store_true", help="keep the database (WORK/bench.duckdb)")
    return parser.parse_args()


def _generate(args: argparse.Namespace):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the helpers shared with the tests
    from support.synthetic import SyntheticConfig, generate

    config = SyntheticConfig(runs=args.runs, events=args.events, unique_stacks=args.stacks, zipf_s=args.zipf)
    key = json.dumps({k: getattr(config, k) for k in config.__dataclass_fields__}, sort_keys=True) + sys.version
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


def _ingest(runs_dir: Path, db: Path, cache_dir: Path, label: str):
    from tbpipe.pipeline.db import IngestOptions, ingest_runs

    started = time.perf_counter()
    summary = ingest_runs([runs_dir], IngestOptions(db_path=db, cache_dir=cache_dir, progress=False))
    seconds = time.perf_counter() - started
    rate = summary.events / seconds if seconds else 0
    print(
        f"{label}: {summary.ingested} runs ingested, {summary.present} present, {summary.events:,} events, "
        f"{summary.new_stacks:,} new stacks, frames {summary.frames_symbolized:,} symbolized / "
        f"{summary.frames_unsymbolized:,} not, in {seconds:.1f} s ({rate / 1e6:.2f} M events/s)"
    )
    if summary.quarantined:
        raise SystemExit(f"quarantined: {[o.reason for o in summary.quarantined]}")
    return summary, seconds


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
    summary, seconds = _ingest(runs_dir, db, cache_dir, "ingest")
    _ingest(runs_dir, db, cache_dir, "re-ingest")
    first, warm = _query(db)
    size, used = _sizes(db)
    events = max(summary.events, 1)
    print(
        f"size: {size / 1e6:.0f} MB database file, {size / events:.1f} bytes per event "
        f"({used / 1e6:.0f} MB in used blocks: {used / events:.1f} bytes per event)"
    )
    verdict = []
    if info["events"] >= 10_000_000:
        verdict.append(f"ingest {'OK' if seconds <= 60 else 'SLOW'} ({seconds:.1f} s vs 60 s)")
        verdict.append(f"query {'OK' if warm <= 1 else 'SLOW'} ({warm:.2f} s vs 1 s)")
    if verdict:
        print("targets: " + "; ".join(verdict))
    if not args.keep_db:
        db.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
