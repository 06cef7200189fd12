"""Service benchmark: concurrent API requests against a 10M-event database, on loopback only.

    python bench/serve.py                          # 10M events (the ingest bench's runs), 200 requests at once
    python bench/serve.py --events 1000000 --stacks 20000 --runs 8 --requests 100

The runs are the ingest bench's (`bench/ingest.py`'s generation over tests/support/synthetic.py,
kept in its work folder); the database is ingested once and cached in --work. A real `tbpipe
serve` (uvicorn, a child process on a free 127.0.0.1 port) answers; per endpoint, --requests
requests (a mix of runs, sites and parameters) are sent all at once from one client, and p50/p95
latencies are printed. A fixed number of requests: the benchmark stops by itself.
Target: p95 <= 300 ms for /api/runs, /api/runs/{id}/sites and /api/sites/{key}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the helpers shared with the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGET_MS = 300
TARGETED = ("runs", "run sites", "site")


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--stacks", type=int, default=100_000, help="unique stacks")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--requests", type=int, default=200, help="requests per endpoint, all sent at once")
    parser.add_argument("--runs-work", type=Path, default=Path(tempfile.gettempdir()) / "tbpipe-bench-ingest")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tbpipe-bench-serve")
    return parser.parse_args()


def _database(args: argparse.Namespace) -> Path:
    """The ingest bench's runs, ingested once into WORK/serve.duckdb (reused while the runs are the same)."""
    import ingest as ingest_bench

    generation = argparse.Namespace(
        events=args.events, stacks=args.stacks, runs=args.runs, zipf=args.zipf, work=args.runs_work
    )
    args.runs_work.mkdir(parents=True, exist_ok=True)
    info = ingest_bench._generate(generation)
    args.work.mkdir(parents=True, exist_ok=True)
    db = args.work / "serve.duckdb"
    stamp = args.work / "serve.json"
    from tbpipe.pipeline.db.schema import latest_version

    key = {"key": info["key"], "schema": latest_version()}  # a database of an older schema is made again
    if db.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        print(f"database: reusing {db}")
        return db
    for path in (db, db.with_name(db.name + ".wal")):
        path.unlink(missing_ok=True)
    cache = args.runs_work / "symbols"
    ingest_bench._warm_symbols(args.runs_work / "runs", cache)
    ingest_bench._ingest(args.runs_work / "runs", db, cache, "ingest")
    stamp.write_text(json.dumps(key))
    return db


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


async def _burst(session, paths: list[str]) -> tuple[list[float], int]:
    async def one(path: str) -> tuple[float, int]:
        started = time.perf_counter()
        try:
            async with session.get(path) as response:
                await response.read()
                status = response.status
        except Exception:  # counted as an error, measured all the same
            status = 0
        return time.perf_counter() - started, status

    results = await asyncio.gather(*(one(p) for p in paths))
    return [r[0] for r in results], sum(1 for r in results if r[1] != 200)


async def _measure(url: str, endpoints: dict[str, list[str]], requests: int) -> dict[str, tuple]:
    # aiohttp: the client shares the service's two cores, and httpx spent ~1.7 ms of CPU per request
    # here (its 200 requests cost more than the service's answers to them), aiohttp ~0.2 ms.
    import aiohttp

    out = {}
    for name, paths in endpoints.items():
        # A client per burst: the server closes keep-alive connections idle between bursts.
        connector = aiohttp.TCPConnector(limit=requests)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
            await _burst(session, paths[:4])  # warm: first plans made
            batch = [paths[i % len(paths)] for i in range(requests)]
            started = time.perf_counter()
            latencies, failed = await _burst(session, batch)
            wall = time.perf_counter() - started
        out[name] = (latencies, failed, wall)
        print(f"  {name}: done in {wall:.1f} s", flush=True)
    return out


def main() -> None:
    args = _args()
    import httpx
    from support.serve import Server

    print(f"tbpipe serve bench on {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    db = _database(args)
    copy = args.work / "served.duckdb"  # the service opens its own copy (it migrates and locks it)
    shutil.copy(db, copy)
    with Server(
        copy, "--log-level", "warning", env=dict(os.environ, TBPIPE_CACHE_DIR=str(args.runs_work / "symbols"))
    ) as server:
        runs = httpx.get(server.url + "/api/runs", params={"limit": 1000}, timeout=120).json()["runs"]
        run_ids = [r["run_id"] for r in runs]
        sites = []
        for run_id in run_ids[:8]:
            page = httpx.get(server.url + f"/api/runs/{run_id}/sites", params={"limit": 20}, timeout=120).json()
            sites += [s for s in page["sites"] if s["site_key"]]
        keys = list(dict.fromkeys(s["site_key"] for s in sites))
        names = list(dict.fromkeys(s["name"] for s in sites))[:5]
        commits = sorted({r["labels"].get("commit") for r in runs if r["labels"].get("commit")})
        labels = [f"commit={c}" for c in commits]
        endpoints = {
            "runs": [f"/api/runs?limit=50&offset={o}" for o in (0, 10, 20)]
            + [f"/api/runs?label={label}" for label in labels],
            "run sites": [f"/api/runs/{r}/sites?limit=50" for r in run_ids]
            + [f"/api/runs/{r}/sites?kind=kernel_launch&limit=20" for r in run_ids],
            "site": [f"/api/sites/{k}" for k in keys],
            "site history": [f"/api/sites/{k}/history" for k in keys],
            "kernel callers": [f"/api/kernels/{quote(n, safe='')}/callers" for n in names],
            "query": [
                "/api/query?sql=SELECT%20count(*)%20FROM%20runs",
                "/api/query?sql=SELECT%20kind,%20count(*)%20FROM%20event_names%20GROUP%20BY%20kind",
            ],
        }
        print(
            f"database: {sum(r['events'] for r in runs):,} events in {len(runs)} runs; "
            f"{args.requests} requests per endpoint, all at once, from one client on loopback"
        )
        results = asyncio.run(_measure(server.url, endpoints, args.requests))
    print(f"{'endpoint':<16} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'req/s':>7} {'errors':>6}")
    verdict = []
    for name, (latencies, failed, wall) in results.items():
        p50, p95 = _percentile(latencies, 0.5) * 1000, _percentile(latencies, 0.95) * 1000
        print(f"{name:<16} {p50:8.0f} {p95:8.0f} {max(latencies) * 1000:8.0f} {len(latencies) / wall:7.0f} {failed:6d}")
        if name in TARGETED:
            verdict.append(f"{name} {'OK' if p95 <= TARGET_MS and not failed else 'SLOW'} (p95 {p95:.0f} ms)")
    print(f"targets (p95 <= {TARGET_MS} ms): " + "; ".join(verdict))
    print(f"median of medians: {statistics.median(_percentile(r[0], 0.5) for r in results.values()) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
