"""Retention: the events of old runs let go, what history reads of them kept ("rolled up").

A policy (`RetainPolicy`) keeps the newest N runs of each group of runs (by labels) and/or the runs
of the last D days; every other run is rolled up, in one transaction under the ingest lock:

- its events are counted per kind/name, stack and thread into `rolled_up_counts` (threads numbered
  in `rolled_up_threads`), checked equal to its `event_counts` before anything is deleted, and its
  backward events' moves to their forward ops into `rolled_up_forward_counts`;
- its `event_rows`, `gpu_activity`, `event_counts` and `site_counts` rows are deleted (the views of
  sql/counts.sql read the rolled-up counts in their place, and derive its counts per site from its
  counts per stack as the ingest does), and `runs.rolled_up_at` marks it;
- its first `LEAD_SITES` sites, in the order the service's run pages show them, are kept in
  `rolled_up_leads` (sql/migrations/012_rolled_up_leads.sql), made again whenever every stack is
  sited again.

Its run row, labels, modules, GPU time per stack (`gpu_time_counts`) and the stacks, frames and
sites it uses stay. `rolled_up_counts` is written in blocks of runs rolled up together, each block
sorted by stack (see sql/migrations/011_retention.sql): the newest block takes new runs until it
holds `BLOCK_ROWS` rows, rewritten each time, so a retain rewrites at most one block besides its own
rows. A second retain with the same policy finds nothing to do and writes nothing; a kill leaves the
database as it was (nothing is committed before the end). Then the space is reused by later ingests.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb

from tbpipe.pipeline.db.connection import ingest_lock, open_database, query_rows, query_value, resolve_db_path
from tbpipe.pipeline.errors import TbpipeError, UsageError
from tbpipe.pipeline.rawrun import DamagedRunError, parts_fingerprint, read_manifest

# Rows of `rolled_up_counts` a block takes before the next one begins: a run's rows are read from
# its block (a few MB of compressed columns), a stack's from one row group per block.
BLOCK_ROWS = 1 << 21
# The order the service pages a run's sites in (`run_site_counts` p, `event_names` n): a total order.
LEAD_ORDER = "p.events DESC, n.name, n.kind, p.site_id"
# The rows of each rolled-up run's sites kept whole (`rolled_up_leads`): what the service's run
# pages show first, read without deriving the run's sites from its block of counts.
LEAD_SITES = 200
# What a rolled-up run has instead of its events.
ROLLED_UP_TABLES = (
    "rolled_up_counts", "rolled_up_name_counts", "rolled_up_threads", "rolled_up_forward_counts", "rolled_up_runs",
    "rolled_up_leads",
)  # fmt: skip

_temporary = itertools.count(1)


class RetainError(TbpipeError):
    """A retain that cannot go on: nothing was changed."""


@dataclass(frozen=True)
class RetainPolicy:
    """Which runs keep their events. A run is kept when any given rule keeps it."""

    keep_runs: int | None = None  # the newest N runs of each group
    by: tuple[str, ...] = ()  # labels whose values make the groups (none: all runs are one group)
    keep_days: float | None = None  # the runs started in the last D days

    def check(self) -> None:
        if self.keep_runs is None and self.keep_days is None:
            raise UsageError("say which runs keep their events: --keep-runs N (per --by group) and/or --keep-days D")
        if self.keep_runs is not None and self.keep_runs < 0:
            raise UsageError(f"--keep-runs must be 0 or more, not {self.keep_runs}")
        if self.keep_days is not None and self.keep_days < 0:
            raise UsageError(f"--keep-days must be 0 or more, not {self.keep_days:g}")
        if self.by and self.keep_runs is None:
            raise UsageError("--by groups the runs that --keep-runs counts: give --keep-runs too")

    def describe(self) -> str:
        rules = []
        if self.keep_runs is not None:
            rules.append(f"the newest {self.keep_runs} run{'s' if self.keep_runs != 1 else ''}")
            rules[-1] += f" of each {'/'.join(self.by)}" if self.by else ""
        if self.keep_days is not None:
            rules.append(f"the runs of the last {self.keep_days:g} days")
        return " and ".join(rules)


@dataclass
class RetainHooks:
    """Seams for tests: `before_commit` runs inside the transaction, after every change, before COMMIT."""

    before_commit: Callable[[], None] | None = None


@dataclass(frozen=True)
class RolledUpRun:
    run_id: str
    run_number: int
    started_at: datetime | None  # UTC
    group: tuple[str | None, ...]  # its values of the policy's `by` labels
    events: int  # event rows let go
    gpu_records: int  # GPU activity records let go


@dataclass
class RetainResult:
    db_path: Path
    policy: RetainPolicy
    dry_run: bool
    runs: list[RolledUpRun]  # rolled up (or, dry, to be)
    kept: int  # runs that keep their events
    already: int  # runs rolled up before
    bytes_freed: int  # measured; with dry_run, estimated from the tables' size per row
    orphans: int = 0  # rolled-up rows of runs no longer rolled up (ingested again), deleted

    @property
    def events(self) -> int:
        return sum(run.events for run in self.runs)

    @property
    def gpu_records(self) -> int:
        return sum(run.gpu_records for run in self.runs)


# ------------------------------------------------------------------------------------------ choosing


@dataclass(frozen=True)
class _Run:
    run_id: str
    run_number: int
    started_at: datetime | None
    labels: dict[str, str]
    rolled_up: bool


def _runs(con: Any) -> list[_Run]:
    rows = query_rows(
        con,
        """
        SELECT run_id, run_number, started_at AT TIME ZONE 'UTC', labels, rolled_up_at IS NOT NULL
        FROM runs ORDER BY started_at NULLS FIRST, run_id
        """,
    )
    return [_Run(r[0], r[1], r[2], dict(r[3] or {}), r[4]) for r in rows]


def runs_to_roll_up(con: Any, policy: RetainPolicy, now: datetime | None = None) -> tuple[list[_Run], int, int]:
    """(runs the policy rolls up that still hold their events, oldest first; runs kept; runs rolled up before)."""
    policy.check()
    runs = _runs(con)
    kept: set[str] = set()
    if policy.keep_runs is not None:
        groups: dict[tuple, list[_Run]] = {}
        for run in runs:  # oldest first
            groups.setdefault(tuple(run.labels.get(key) for key in policy.by), []).append(run)
        for members in groups.values():
            kept.update(r.run_id for r in members[len(members) - policy.keep_runs :] if policy.keep_runs)
    if policy.keep_days is not None:
        cutoff = (now or datetime.now(timezone.utc)).replace(tzinfo=None) - timedelta(days=policy.keep_days)
        # A run without a start time is kept: nothing says it is old.
        kept.update(r.run_id for r in runs if r.started_at is None or r.started_at >= cutoff)
    chosen = [r for r in runs if r.run_id not in kept and not r.rolled_up]
    already = sum(1 for r in runs if r.rolled_up)
    return chosen, sum(1 for r in runs if r.run_id in kept), already


# ------------------------------------------------------------------------------------------ the roll-up


def _numbers(values: Iterable[int]) -> str:
    """A literal list of run numbers for `IN (...)`: constant filters reach the tables' scans."""
    return ", ".join(str(int(v)) for v in values) or "NULL"


def _per_run(con: Any, table: str, numbers: list[int], value: str = "count(*)") -> dict[int, int]:
    """{run_number: value} over the rows of `table` of these runs (runs without rows left out)."""
    sql = f"SELECT run_number, {value} FROM {table} WHERE run_number IN ({_numbers(numbers)}) GROUP BY ALL"
    return {number: int(total) for number, total in query_rows(con, sql)}


def _orphans(con: Any) -> int:
    """Rolled-up rows of runs that are not rolled up (a run ingested again after its roll-up)."""
    marked = "SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL"
    return int(
        query_value(
            con,
            f"""
            SELECT {" + ".join(f"(SELECT count(*) FROM {t} WHERE run_number NOT IN ({marked}))" for t in ROLLED_UP_TABLES)}
            """,
        )
    )


def _delete_orphans(con: Any) -> None:
    marked = "SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL"
    for table in ROLLED_UP_TABLES:
        con.execute(f"DELETE FROM {table} WHERE run_number NOT IN ({marked})")


@dataclass
class _Counted:
    """What the runs' events come to, in temporary tables of the transaction."""

    prefix: str
    # run_number -> (rows, first event id, last event id)
    per_run: dict[int, tuple[int, int | None, int | None]] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)  # to drop

    def table(self, name: str) -> str:
        """A temporary table of this roll-up: grouped, threads (run_number, thread_id, thread), counts."""
        self.tables.append(self.prefix + name)
        return self.prefix + name


def _count_events(con: Any, numbers: list[int]) -> _Counted:
    """The runs' events counted per name, stack and thread (one scan of their events), the threads
    numbered in the order of their first events; RetainError when they do not add up to the runs'
    `event_counts` (then nothing would be kept of what is missing)."""
    counted = _Counted(f"tbpipe_retain_{next(_temporary)}_")
    grouped, threads, counts = counted.table("grouped"), counted.table("threads"), counted.table("counts")
    con.execute(
        f"""
        CREATE TEMP TABLE {grouped} AS
        SELECT run_number, name_id, stack_id, thread_id, count(*)::BIGINT AS events,
               min(event_id) AS first_event, max(event_id) AS last_event
        FROM event_rows WHERE run_number IN ({_numbers(numbers)})
        GROUP BY run_number, name_id, stack_id, thread_id
        """
    )
    con.execute(
        f"""
        CREATE TEMP TABLE {threads} AS
        SELECT run_number, thread_id,
               (row_number() OVER (PARTITION BY run_number ORDER BY min(first_event), thread_id) - 1)::INTEGER AS thread
        FROM {grouped} GROUP BY run_number, thread_id
        """
    )
    con.execute(
        f"""
        CREATE TEMP TABLE {counts} AS
        SELECT g.stack_id, g.name_id, t.thread, g.run_number, g.events
        FROM {grouped} g JOIN {threads} t USING (run_number, thread_id)
        """
    )
    differing = query_rows(
        con,
        f"""
        WITH mine AS (
            SELECT run_number, name_id, stack_id, sum(events) AS events FROM {grouped} GROUP BY ALL
        ), stored AS (
            SELECT run_number, name_id, stack_id, events FROM event_counts WHERE run_number IN ({_numbers(numbers)})
        )
        SELECT DISTINCT coalesce(m.run_number, s.run_number)
        FROM mine m FULL JOIN stored s
            ON s.run_number = m.run_number AND s.name_id = m.name_id AND s.stack_id IS NOT DISTINCT FROM m.stack_id
        WHERE m.events IS DISTINCT FROM s.events
        ORDER BY 1
        """,
    )
    if differing:
        sql = f"SELECT run_id FROM runs WHERE run_number IN ({_numbers(r[0] for r in differing)}) ORDER BY run_id"
        ids = [row[0] for row in query_rows(con, sql)]
        raise RetainError(
            f"the events of {len(ids)} run{'s' if len(ids) != 1 else ''} ({', '.join(ids[:3])}"
            f"{', ...' if len(ids) > 3 else ''}) do not add up to their event counts: not rolled up, nothing changed"
        )
    for run_number, rows, first, last in query_rows(
        con, f"SELECT run_number, count(*), min(first_event), max(last_event) FROM {grouped} GROUP BY run_number"
    ):
        counted.per_run[run_number] = (rows, first, last)
    return counted


def _drop(con: Any, tables: Sequence[str]) -> None:
    for table in tables:
        con.execute(f"DROP TABLE IF EXISTS {table}")


def _blocks(con: Any, numbers: list[int], rows: dict[int, int]) -> tuple[dict[int, int], int | None]:
    """The block of each new run (in run order: the newest block while it has room, then new ones),
    and the newest block if new runs join it (its rows are written again with theirs)."""
    newest = query_value(con, "SELECT max(block) FROM rolled_up_runs")
    if newest is None:
        block, filled = 0, 0
    else:
        block = int(newest)
        filled = int(
            query_value(
                con,
                "SELECT count(*) FROM rolled_up_counts WHERE run_number IN "
                "(SELECT run_number FROM rolled_up_runs WHERE block = ?)",
                [block],
            )
        )
    assigned, joined = {}, None
    for number in sorted(numbers):
        if filled >= BLOCK_ROWS:
            block, filled = block + 1, 0
        if newest is not None and block == newest:
            joined = block
        assigned[number] = block
        filled += rows.get(number, 0)
    return assigned, joined


def _write_counts(con: Any, counts: str, assigned: dict[int, int], joined: int | None) -> None:
    """The new runs' rows (of the relation `counts`) into their blocks, each block written sorted
    (the newest one again, whole)."""
    by_block: dict[int, list[int]] = {}
    for number, block in assigned.items():
        by_block.setdefault(block, []).append(number)
    columns = "stack_id, name_id, thread, run_number, events"
    for block in sorted(by_block):
        sources = [f"SELECT {columns} FROM {counts} WHERE run_number IN ({_numbers(by_block[block])})"]
        kept = None
        if block == joined:
            kept = f"tbpipe_retain_block_{next(_temporary)}"
            members = f"SELECT run_number FROM rolled_up_runs WHERE block = {int(block)}"
            con.execute(
                f"CREATE TEMP TABLE {kept} AS SELECT {columns} FROM rolled_up_counts WHERE run_number IN ({members})"
            )
            con.execute(f"DELETE FROM rolled_up_counts WHERE run_number IN ({members})")
            sources.append(f"SELECT {columns} FROM {kept}")
        con.execute(
            f"""
            INSERT INTO rolled_up_counts BY NAME
            SELECT * FROM ({" UNION ALL ".join(sources)})
            ORDER BY stack_id, name_id, thread, run_number
            """
        )
        if kept is not None:
            con.execute(f"DROP TABLE {kept}")


def store_rolled_up(con: Any, counts: str, threads: str, runs: dict[int, tuple[int | None, int | None, int]]) -> None:
    """The rows of newly rolled-up runs, inside the caller's transaction: `counts` (a relation of
    stack_id, name_id, thread, run_number, events) into `rolled_up_counts`, in blocks, and its sums per
    name into `rolled_up_name_counts`; `threads`
    (run_number, thread, thread_id) into `rolled_up_threads`; `runs` {run_number: (first event id,
    last event id, GPU records)} into `rolled_up_runs`. The roll-up writes its runs through it, and
    so does the history bench for the runs it makes without events (the same layout)."""
    rows = dict(query_rows(con, f"SELECT run_number, count(*) FROM {counts} GROUP BY ALL"))
    assigned, joined = _blocks(con, list(runs), rows)
    _write_counts(con, counts, assigned, joined)
    con.execute(
        f"INSERT INTO rolled_up_name_counts SELECT run_number, name_id, sum(events) FROM {counts} GROUP BY ALL ORDER BY ALL"
    )
    con.execute(f"INSERT INTO rolled_up_threads SELECT run_number, thread, thread_id FROM {threads} ORDER BY ALL")
    con.executemany(
        "INSERT INTO rolled_up_runs VALUES (?, ?, ?, ?, ?)",
        [[number, assigned[number], *runs[number]] for number in sorted(runs)],
    )


def keep_leads(con: Any, numbers: list[int] | None) -> None:
    """`rolled_up_leads` of these rolled-up runs (every rolled-up run with None, their old leads
    replaced), from `rolled_up_site_counts`: the runs must be marked rolled up. Run by the roll-up,
    by the history bench's writer, and when every stack is sited again (then block by block: a
    block's runs are read from its rows alone, and one window over a year's runs costs several times
    as much)."""
    if numbers is not None:
        con.execute(f"DELETE FROM rolled_up_leads WHERE run_number IN ({_numbers(numbers)})")
        _insert_leads(con, numbers)
        return
    con.execute("DELETE FROM rolled_up_leads")
    blocks = query_rows(
        con,
        """
        SELECT list(run_number ORDER BY run_number) FROM rolled_up_runs
        WHERE run_number IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
        GROUP BY block ORDER BY block
        """,
    )
    for (members,) in blocks:
        _insert_leads(con, members)


def _insert_leads(con: Any, numbers: list[int]) -> None:
    con.execute(
        f"""
        INSERT INTO rolled_up_leads BY NAME
        SELECT p.run_number, p.name_id, p.site_id, p.events, p.site_file, p.site_line,
               (row_number() OVER (PARTITION BY p.run_number ORDER BY {LEAD_ORDER}) - 1)::INTEGER AS place
        FROM rolled_up_site_counts p JOIN event_names n USING (name_id)
        WHERE p.run_number IN ({_numbers(numbers)})
        QUALIFY place < {LEAD_SITES}
        ORDER BY p.run_number, place
        """
    )


def _forward_counts(con: Any, runs: list[_Run]) -> None:
    """The runs' backward events counted at their forward ops (none without autograd's backward
    work: the check reads only their events, the views of it every run's)."""
    # Whether any of them has backward work: a materialized list of their op events' attributes,
    # searched after (DuckDB 1.5 pushed a JSON test on `attrs` into the scan and cast it wrongly).
    numbers = _numbers(r.run_number for r in runs)
    con.execute(
        f"""
        CREATE OR REPLACE TEMP TABLE retain_op_attrs AS
        SELECT CAST(e.attrs AS VARCHAR) AS attrs FROM event_rows e JOIN event_names n USING (name_id)
        WHERE e.run_number IN ({numbers}) AND n.kind = 'op'
        """
    )
    backward = query_value(
        con, "SELECT count(*) FROM retain_op_attrs WHERE json_extract_string(attrs, '$.bwd_seq') IS NOT NULL"
    )
    con.execute("DROP TABLE retain_op_attrs")
    if not backward:
        return
    ids = ", ".join("?" * len(runs))
    con.execute(
        f"""
        INSERT INTO rolled_up_forward_counts BY NAME
        SELECT r.run_number, n.name_id, b.stack_id, b.forward_stack_id, count(*)::BIGINT AS events
        FROM backward_forward_ops b
        JOIN runs r ON r.run_id = b.run_id
        JOIN event_names n ON n.kind = b.kind AND n.name = b.name
        WHERE b.run_id IN ({ids}) AND b.forward_stack_id IS NOT NULL
        GROUP BY ALL
        """,
        [r.run_id for r in runs],
    )


def roll_up(con: Any, runs: list[_Run], hooks: RetainHooks | None = None) -> list[RolledUpRun]:
    """Rolls `runs` up in one transaction on `con` (read-write, the ingest lock held); returns what went."""
    hooks = hooks or RetainHooks()
    numbers = [r.run_number for r in runs]
    con.execute("BEGIN TRANSACTION")
    counted = None
    try:
        _delete_orphans(con)
        counted = _count_events(con, numbers)
        gpu = _per_run(con, "gpu_activity", numbers)
        store_rolled_up(
            con,
            f"{counted.prefix}counts",
            f"{counted.prefix}threads",
            {n: (*counted.per_run.get(n, (0, None, None))[1:], gpu.get(n, 0)) for n in numbers},
        )
        _forward_counts(con, runs)
        events = _per_run(con, "event_counts", numbers, "sum(events)")
        for table in ("event_rows", "gpu_activity", "event_counts", "site_counts"):
            con.execute(f"DELETE FROM {table} WHERE run_number IN ({_numbers(numbers)})")
        con.execute(f"UPDATE runs SET rolled_up_at = now() WHERE run_number IN ({_numbers(numbers)})")
        keep_leads(con, numbers)
        _drop(con, counted.tables)
        if hooks.before_commit is not None:
            hooks.before_commit()
        con.execute("COMMIT")
    except BaseException:
        _rollback(con)
        raise
    return [
        RolledUpRun(r.run_id, r.run_number, r.started_at, (), events.get(r.run_number, 0), gpu.get(r.run_number, 0))
        for r in runs
    ]


# ------------------------------------------------------------------------------------------ space


def used_bytes(con: Any) -> int:
    """The bytes of the database file in use (its blocks that are not free)."""
    row = query_rows(
        con, "SELECT block_size * used_blocks FROM pragma_database_size() WHERE database_name = current_database()"
    )
    return int(row[0][0]) if row else 0


def _table_bytes(con: Any, table: str) -> int:
    """The blocks a table's columns occupy, in bytes (its indexes not included)."""
    size = query_value(con, "SELECT block_size FROM pragma_database_size() WHERE database_name = current_database()")
    blocks = query_value(
        con,
        f"SELECT count(DISTINCT block_id) FROM pragma_storage_info('{table}') WHERE persistent AND block_id >= 0",
    )
    return int(blocks or 0) * int(size or 0)


def estimate_freed(con: Any, numbers: list[int]) -> int:
    """About the bytes a roll-up of these runs frees: each table's share of its blocks for the rows
    it lets go (what it keeps of them, about a byte and a half per stack and thread, subtracted)."""
    if not numbers:
        return 0
    total = 0
    for table in ("event_rows", "gpu_activity", "event_counts", "site_counts"):
        rows = int(query_value(con, f"SELECT count(*) FROM {table}") or 0)
        if rows:
            total += _table_bytes(con, table) * sum(_per_run(con, table, numbers).values()) // rows
    kept_rows = sum(_per_run(con, "event_counts", numbers).values())
    return max(0, total - kept_rows * 3 // 2)


# ------------------------------------------------------------------------------------------ the command's library call


def retain(
    db_path: Path | str | None,
    policy: RetainPolicy,
    *,
    dry_run: bool = False,
    wait_s: float = 600.0,
    hooks: RetainHooks | None = None,
    now: datetime | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> RetainResult:
    """Rolls up the runs `policy` does not keep, in the database at `db_path` (dry: says which and
    about how much space it would free, and changes nothing)."""
    policy.check()
    path = resolve_db_path(db_path)
    with ingest_lock(path, wait_s, on_wait):
        con = open_database(path, read_only=False, wait_s=wait_s, on_wait=on_wait)
        try:
            chosen, kept, already = runs_to_roll_up(con, policy, now)
            groups = {r.run_id: tuple(r.labels.get(k) for k in policy.by) for r in chosen}

            if dry_run:
                numbers = [r.run_number for r in chosen]
                events, gpu = _per_run(con, "event_rows", numbers), _per_run(con, "gpu_activity", numbers)
                runs = [
                    RolledUpRun(r.run_id, r.run_number, r.started_at, groups[r.run_id], events.get(r.run_number, 0),
                                gpu.get(r.run_number, 0))
                    for r in chosen
                ]  # fmt: skip
                freed = estimate_freed(con, numbers)
                return RetainResult(path, policy, True, runs, kept, already, freed, _orphans(con))
            orphans = _orphans(con)
            if not chosen and not orphans:
                return RetainResult(path, policy, False, [], kept, already, 0)
            con.execute("CHECKPOINT")
            before = used_bytes(con)
            rolled = roll_up(con, chosen, hooks) if chosen else _only_orphans(con, hooks)
            con.execute("CHECKPOINT")  # the deleted rows' blocks freed for the next ingests
            freed = before - used_bytes(con)
            runs = [replace(r, group=groups[r.run_id]) for r in rolled]
            return RetainResult(path, policy, False, runs, kept, already, freed, orphans)
        finally:
            con.close()


def _only_orphans(con: Any, hooks: RetainHooks | None) -> list[RolledUpRun]:
    con.execute("BEGIN TRANSACTION")
    try:
        _delete_orphans(con)
        if hooks is not None and hooks.before_commit is not None:
            hooks.before_commit()
        con.execute("COMMIT")
    except BaseException:
        _rollback(con)
        raise
    return []


def _rollback(con: Any) -> None:
    """ROLLBACK, unless the failure ended the transaction already (a failed COMMIT rolls back itself)."""

    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass


# ------------------------------------------------------------------------------------------ folders


@dataclass(frozen=True)
class FolderPolicy:
    """Folders aged out beside the roll-up; each rule is off unless given."""

    uploads: Path | None = None  # the service's uploads folder (`<db>.uploads` by default)
    keep_quarantined_days: float | None = None  # quarantined uploads (and unfinished ones) older than this go
    run_roots: tuple[Path, ...] = ()  # folders whose run folders may go once ingested (watched, uploads)
    delete_ingested_after_days: float | None = None  # run folders ingested this long ago, unchanged since, go

    def check(self) -> None:
        for name, days in (("--keep-quarantined-days", self.keep_quarantined_days),
                           ("--delete-ingested-runs-after-days", self.delete_ingested_after_days)):  # fmt: skip
            if days is not None and days < 0:
                raise UsageError(f"{name} must be 0 or more, not {days:g}")
        if self.delete_ingested_after_days is not None and not self.run_roots:
            raise UsageError(
                "--delete-ingested-runs-after-days deletes run folders only under the folders named by --runs-dir"
            )

    @property
    def active(self) -> bool:
        return self.keep_quarantined_days is not None or self.delete_ingested_after_days is not None


@dataclass(frozen=True)
class AgedOut:
    path: Path
    what: str  # 'quarantined upload', 'unfinished upload', 'ingested run folder'
    bytes: int


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _remove(path: Path) -> None:

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` is strictly inside `root` (both resolved: a link cannot lead out)."""
    try:
        resolved, base = path.resolve(), root.resolve()
    except OSError:
        return False
    return resolved != base and base in resolved.parents


def _quarantined(policy: FolderPolicy, cutoff: float) -> list[AgedOut]:
    """Quarantined uploads (`quarantine/<id>/`, aged by their `reason.txt`) and archives an upload
    left in `incoming/` (a service killed while receiving it), older than the cutoff."""
    found: list[AgedOut] = []
    uploads = policy.uploads
    if uploads is None or not uploads.is_dir():
        return found
    quarantine = uploads / "quarantine"
    if quarantine.is_dir():
        for entry in sorted(quarantine.iterdir()):
            marker = entry / "reason.txt"
            stamp = (marker if marker.is_file() else entry).stat().st_mtime
            if stamp < cutoff:
                found.append(AgedOut(entry, "quarantined upload", _size(entry)))
    incoming = uploads / "incoming"
    if incoming.is_dir():
        for entry in sorted(incoming.iterdir()):
            if entry.is_file() and entry.stat().st_mtime < cutoff:
                found.append(AgedOut(entry, "unfinished upload", _size(entry)))
    return found


def _ingested(con: Any, policy: FolderPolicy, cutoff: datetime) -> list[AgedOut]:
    """Run folders under `policy.run_roots` that the database ingested before the cutoff and that
    have not changed since (the same run id, the same parts: what `tbpipe ingest` keys a run on)."""

    found: list[AgedOut] = []
    rows = query_rows(
        con,
        "SELECT run_id, source_dir, parts FROM runs WHERE ingested_at < ? ORDER BY ingested_at",
        [cutoff],
    )
    for run_id, source_dir, parts in rows:
        folder = Path(source_dir)
        if folder.is_symlink() or not folder.is_dir() or not any(_inside(folder, root) for root in policy.run_roots):
            continue
        try:
            manifest = read_manifest(folder)
            if manifest.get("run_id") != run_id or parts_fingerprint(folder, manifest) != parts:
                continue  # changed since (a run written again, another run in its place): kept
        except (DamagedRunError, OSError):
            continue
        found.append(AgedOut(folder, "ingested run folder", _size(folder)))
    return found


def _remove_empty_parents(path: Path, roots: Sequence[Path]) -> None:
    """Folders left empty above a deleted run folder (an upload's own folder), up to its root."""
    parent = path.parent
    while any(_inside(parent, root) for root in roots):
        try:
            parent.rmdir()  # only when empty
        except OSError:
            return
        parent = parent.parent


def age_out_folders(
    con: Any | None, policy: FolderPolicy, *, dry_run: bool = False, now: datetime | None = None
) -> list[AgedOut]:
    """Deletes (dry: lists) the quarantined uploads and the ingested run folders the policy ages out."""
    policy.check()
    moment = now or datetime.now(timezone.utc)
    found: list[AgedOut] = []
    if policy.keep_quarantined_days is not None:
        found += _quarantined(policy, (moment - timedelta(days=policy.keep_quarantined_days)).timestamp())
    if policy.delete_ingested_after_days is not None and con is not None:
        found += _ingested(con, policy, moment - timedelta(days=policy.delete_ingested_after_days))
    if not dry_run:
        roots = [*policy.run_roots, *([policy.uploads] if policy.uploads else [])]
        for entry in found:
            _remove(entry.path)
            if entry.what == "ingested run folder":
                _remove_empty_parents(entry.path, roots)
    return found
