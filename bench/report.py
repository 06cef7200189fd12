"""Benchmark: `tbpipe report` over a long nightly history.

    python bench/report.py                      # 30 nightly groups x 10 runs x 10k sites, window of 30
    python bench/report.py --sites 2000 --quick

Builds a database with the real schema (migrations applied by tbpipe) and fills it column-wise in
DuckDB: every night is a group of ranks (commit=nN), each rank's run counting events at every site;
10% of the sites launch a data-dependent number of kernels, and the candidate night doubles a few
sites and adds a few new ones. Then times, each best of --repeat:
  - `tbpipe report` as a user runs it (a new process: start-up, read-only open, compare, Markdown),
    against the window of all earlier nights grouped by commit, and against the previous night;
  - the in-process phases of the window comparison, to say what dominates.
The anchor is DuckDB's own scan of the same event counts (a sum per site over the window) in the
same run: the floor for any report that reads them.

Suspects: a git repository is built beside the database (the 200 files the frames name, a function
every ten lines, --commits commits a night, each night's last one tagged with its commit label, the
candidate night's changing the doubled sites' functions), and both reports are timed with suspects
read from it (`--repo`) and without (`--no-suspects`), with the in-process suspects step alone.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILES, LINES = 200, 420  # the frames' files (model/layer_K.py) and their length


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nights", type=int, default=31, help="nights, the last one the candidate")
    parser.add_argument("--ranks", type=int, default=10, help="runs per night")
    parser.add_argument("--sites", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tbpipe-bench-report")
    parser.add_argument("--commits", type=int, default=4, help="commits a night in the suspects' repository")
    parser.add_argument("--quick", action="store_true", help="5 nights x 4 ranks")
    args = parser.parse_args()
    if args.quick:
        args.nights, args.ranks = 5, 4
    return args


def build(path: Path, nights: int, ranks: int, sites: int) -> None:
    from tbpipe.pipeline.db import open_database

    if path.exists():
        path.unlink()
    con = open_database(path)  # the real schema, migrations applied
    runs = nights * ranks
    con.execute("BEGIN TRANSACTION")
    con.execute(
        """
        INSERT INTO runs BY NAME
        SELECT printf('run-%05d', i) AS run_id, i + 1 AS run_number, TIMESTAMPTZ '2026-01-01 00:00:00+00'
                   + to_days(CAST(i // $ranks AS INTEGER)) + to_seconds(CAST(i % $ranks AS BIGINT)) AS started_at,
               true AS complete, 'bench' AS host, 1000 + i AS pid,
               map(['suite', 'commit', 'rank'], ['bench', 'n' || (i // $ranks + 1), CAST(i % $ranks AS VARCHAR)]) AS labels,
               '3.11.7' AS python_version, '2.13.0' AS torch_version, '0.1.0' AS tbpipe_version,
               0 AS events, 0 AS stacks, 0 AS new_stacks, '/bench' AS source_dir, '' AS parts, now() AS ingested_at,
               '{}' AS manifest
        FROM range($runs) t(i)
        """,
        {"ranks": ranks, "runs": runs},
    )
    con.execute(
        """
        INSERT INTO event_names BY NAME
        SELECT i + 1 AS name_id, 'kernel_launch' AS kind, 'kernel_' || i AS name FROM range(50) t(i)
        """
    )
    con.execute(
        """
        INSERT INTO stacks BY NAME
        SELECT i + 1 AS stack_id, hash(i) AS stack_hash, 0 AS status, 1 AS native_frames, 2 AS python_frames,
               3 AS frames, 1 AS symbolized_depth, 'run-00000' AS first_run_id
        FROM range($sites + 20) t(i)
        """,
        {"sites": sites},
    )
    # Three frames per stack (the site, its caller, the launch), each distinct frame stored once.
    con.execute(
        """
        INSERT INTO frames BY NAME
        SELECT row_number() OVER (ORDER BY s.i, d.depth) AS frame_id, hash(s.i, d.depth) AS frame_hash,
               CASE WHEN d.depth < 2 THEN 'python' ELSE 'native' END AS kind,
               CASE d.depth WHEN 0 THEN 'site_' || s.i WHEN 1 THEN 'train_step' ELSE 'cudaLaunchKernel' END AS function,
               CASE WHEN d.depth < 2 THEN '/builds/1/repo/model/layer_' || (s.i % 200) || '.py' END AS file,
               10 + s.i % 400 AS line, CASE WHEN d.depth < 2 THEN 1 END AS first_line, false AS inlined
        FROM range($sites + 20) s(i), (SELECT unnest([0, 1, 2]) AS depth) d
        ORDER BY s.i, d.depth
        """,
        {"sites": sites},
    )
    con.execute(
        """
        INSERT INTO stack_frame_rows BY NAME
        SELECT s.i + 1 AS stack_id, d.depth, d.depth AS slot, 0 AS chain_depth, s.i * 3 + d.depth + 1 AS frame_id
        FROM range($sites + 20) s(i), (SELECT unnest([0, 1, 2]) AS depth) d
        """,
        {"sites": sites},
    )
    con.execute(
        """
        INSERT INTO sites BY NAME
        SELECT i + 1 AS site_id, substr(md5('site' || i), 1, 16) AS site_key, 'site_' || i AS function,
               '/builds/1/repo/model/layer_' || (i % 200) || '.py' AS file, 10 + i % 400 AS line, 'python' AS kind,
               'model/layer_' || (i % 200) || '.py' AS portable_file, 9 + i % 400 AS line_offset
        FROM range($sites + 20) t(i)
        """,
        {"sites": sites},
    )
    con.execute(
        """
        INSERT INTO stack_sites BY NAME
        SELECT i + 1 AS stack_id, i + 1 AS site_id, 0 AS site_depth, 'python' AS site_kind, true AS site_is_user,
               '/builds/1/repo/model/layer_' || (i % 200) || '.py' AS site_file, 10 + i % 400 AS site_line
        FROM range($sites + 20) t(i)
        """,
        {"sites": sites},
    )
    # Every run counts events at every site; the candidate night (the last) doubles sites 0..9 and
    # adds sites past the usual ones; every tenth site is data-dependent.
    con.execute(
        """
        INSERT INTO event_counts BY NAME
        SELECT r.i + 1 AS run_number, s.i % 50 + 1 AS name_id, s.i + 1 AS stack_id,
               (1 + s.i % 37)
                 * CASE WHEN r.i // $ranks = $nights - 1 AND s.i < 10 THEN 2 ELSE 1 END
                 + CASE WHEN s.i % 10 = 5 THEN hash(r.i // $ranks, s.i) % 5 ELSE 0 END AS events
        FROM range($runs) r(i), range($sites) s(i)
        UNION ALL
        SELECT r.i + 1, s.i % 50 + 1, s.i + 1, 3
        FROM range(($nights - 1) * $ranks, $runs) r(i), range($sites, $sites + 20) s(i)
        """,
        {"ranks": ranks, "nights": nights, "runs": runs, "sites": sites},
    )
    from tbpipe.pipeline.db.ingest.site_counts import count_sites
    from tbpipe.pipeline.db.ingest.tables import IngestDb

    count_sites(IngestDb(con), None)  # what the ingest keeps beside event_counts
    con.execute("COMMIT")
    con.execute("CHECKPOINT")
    con.close()


def build_repository(path: Path, nights: int, commits: int) -> None:
    """The repository the frames' files come from: night N's last commit tagged nN (its commit label)."""
    if path.exists():
        shutil.rmtree(path)
    (path / "model").mkdir(parents=True)
    env = dict(
        os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="bench",
        GIT_AUTHOR_EMAIL="bench@example.com", GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@example.com",
    )  # fmt: skip

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True)

    # A function every ten lines: `def f_M(x):` and nine statements.
    files = [
        [f"def f_{n // 10}(x):" if n % 10 == 0 else f"    x = x + {n}" for n in range(LINES)] for _ in range(FILES)
    ]

    def write(indexes) -> None:
        for k in indexes:
            (path / "model" / f"layer_{k}.py").write_text("\n".join(files[k]) + "\n")

    git("init", "-q", "-b", "main")
    write(range(FILES))
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    draw = random.Random(7)
    for night in range(1, nights + 1):
        for c in range(commits):
            # The candidate's first commit changes the doubled sites' functions (site k < 10: file k, line
            # 10 + k, list index 9 + k), a statement of each.
            if night == nights and c == 0:
                changed = [(k, (9 + k) // 10 * 10 + 5) for k in range(10)]
            else:
                changed = [
                    (draw.randrange(FILES), 1 + 10 * draw.randrange(LINES // 10) + draw.randrange(8)) for _ in range(5)
                ]
            for k, line in changed:
                files[k][line] = files[k][line].rstrip("0123456789") + str(night * 100 + c)
            write({k for k, _ in changed})
            git("commit", "-q", "-a", "-m", f"night {night}, change {c}")
        git("tag", f"n{night}")


def best(repeat: int, run) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def best_of_pair(repeat: int, first, second) -> tuple[float, float]:
    """The best time of each of two runs, taken in turns."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for run, out in ((first, times[0]), (second, times[1])):
            started = time.perf_counter()
            run()
            out.append(time.perf_counter() - started)
    return min(times[0]), min(times[1])


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    db = args.work / "report.duckdb"
    started = time.perf_counter()
    build(db, args.nights, args.ranks, args.sites)
    runs = args.nights * args.ranks
    print(
        f"database: {args.nights} nights x {args.ranks} runs x {args.sites:,} sites = {runs * args.sites:,} "
        f"event-count rows, built in {time.perf_counter() - started:.1f} s"
    )
    repo = args.work / "repo"
    started = time.perf_counter()
    build_repository(repo, args.nights, args.commits)
    print(f"repository: {args.nights * args.commits + 1} commits over {FILES} files, built in "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    candidate = f"commit=n{args.nights}"
    window = args.nights - 1
    tbpipe = [sys.executable, "-m", "tbpipe.pipeline", "report", "--db", str(db), "--candidate", candidate]
    env = dict(os.environ, COLUMNS="200")

    def cli(*extra: str) -> subprocess.CompletedProcess:
        result = subprocess.run([*tbpipe, *extra], capture_output=True, text=True, env=env)
        if result.returncode not in (0, 1):
            raise SystemExit(result.stderr)
        return result

    first = cli("--baseline-window", str(window), "--group-by", "commit").stdout.splitlines()[0]
    print(f"verdict: {first}")
    without, with_suspects = ("--no-suspects",), ("--repo", str(repo))

    import duckdb

    from tbpipe.pipeline.db import open_database
    from tbpipe.pipeline.reports.regression import ReportRequest, compare, compute, select
    from tbpipe.pipeline.reports.regression.suspects import attach_suspects
    from tbpipe.pipeline.reports.regression_markdown import render_markdown

    con = duckdb.connect(str(db), read_only=True)
    floor = best(
        args.repeat,
        lambda: con.execute(
            "SELECT stack_id, sum(events) FROM event_counts WHERE run_number <= ? GROUP BY stack_id", [runs]
        ).fetchall(),
    )
    con.close()
    window_args = ("--baseline-window", str(window), "--group-by", "commit")
    pair_args = ("--baseline", f"commit=n{args.nights - 1}")
    # Without and with suspects alternately, so that both see the same moments of a noisy machine.
    window_cli, window_suspects = best_of_pair(
        args.repeat, lambda: cli(*window_args, *without), lambda: cli(*window_args, *with_suspects)
    )
    pair_cli, pair_suspects = best_of_pair(
        args.repeat, lambda: cli(*pair_args, *without), lambda: cli(*pair_args, *with_suspects)
    )

    con = open_database(db, read_only=True)
    request = ReportRequest(candidate=candidate, window=window, group_by="commit")
    phases = {}
    phases["select runs"] = best(
        args.repeat, lambda: select.window(con, select.resolve(con, candidate, request, role="candidate"), request)
    )
    sets = [*select.window(con, select.resolve(con, candidate, request, role="candidate"), request)]
    sets.append(select.resolve(con, candidate, request, role="candidate"))
    phases["site values (SQL)"] = best(args.repeat, lambda: compute._site_values(con, sets, request))
    values = compute._site_values(con, sets, request)
    phases["classify (numpy)"] = best(args.repeat, lambda: compute._classify(values, sets, request))
    phases["whole compare()"] = best(args.repeat, lambda: compare(con, request))
    report = compare(con, request)
    phases["render Markdown"] = best(args.repeat, lambda: render_markdown(report))
    phases["suspects (git)"] = best(args.repeat, lambda: attach_suspects(con, report, str(repo)))
    con.close()

    print(f"tbpipe report, window of {window} groups x {args.ranks} runs (new process): {window_cli:.2f} s")
    print(f"tbpipe report, against the previous night (new process):                {pair_cli:.2f} s")
    print(f"  the same with suspects (--repo): window {window_suspects:.2f} s ({window_suspects / window_cli:.2f}x), "
          f"previous night {pair_suspects:.2f} s ({pair_suspects / pair_cli:.2f}x)")  # fmt: skip
    print(f"anchor, DuckDB summing the same event counts per stack:                    {floor:.3f} s")
    print(f"window report / anchor: {window_cli / floor:.1f}x   (target: tbpipe report <= 3 s)")
    print("where the window report's time goes (in process, best of", args.repeat, "):")
    for name, seconds in phases.items():
        print(f"  {name:<20} {seconds:6.3f} s")
    print(f"  {len(report.sites):,} sites compared, {len(report.regressions)} flagged")
    explained = [s for s in report.regressions if s.suspects]
    print(f"  suspects: {report.history.commits} commits in the range, {len(explained)} of the flagged sites have some; "
          f"top suspect of the first: {explained[0].suspects[0].subject if explained else '-'}")  # fmt: skip


if __name__ == "__main__":
    main()
