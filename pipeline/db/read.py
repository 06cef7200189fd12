"""Reading the database for people: stacks as frames, events, call sites, runs.

Frames come back as `tbpipe.pipeline.stacks.Frame` dicts, so `format_frames` prints a stack from
the database exactly as it prints one symbolized in-process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.stacks import focus
from tbpipe.pipeline.stacks.render import Frame, frame


class NotFoundError(UsageError):
    """An event, stack or call site the database does not have."""


class RolledUpError(NotFoundError):
    """Something that needs a run's events, asked of a run `tbpipe retain` rolled up (its counts stay)."""


def _native_name(function: str | None, module: str | None, address: int | None) -> str:
    if function:
        return function
    base = os.path.basename(module) if module else "??"
    return f"{base}+0x{address:x}" if address is not None else base


def focus_rules(con: Any) -> focus.FrameRules:
    """The focus modes' rules with this database's folders of tbpipe's own code (`user_code` rows of
    origin 'tbpipe'), for every view that focuses stacks."""
    return focus.rules_from(r[0] for r in query_rows(con, "SELECT prefix FROM user_code WHERE origin = 'tbpipe'"))


def stack_frames(con: Any, stack_id: int) -> list[Frame]:
    """The stack's frames, innermost first, with its combined-order problem (if any) as a last marker."""
    frames = stacks_frames(con, [stack_id]).get(stack_id)
    if frames is None:
        raise NotFoundError(f"no stack {stack_id} in the database")
    return frames


def lookup(con: Any, table: str, columns: str, key: str, values: list) -> list[tuple]:
    """`columns` of the rows of `table` whose `key` is one of `values`, as a plain filter: DuckDB
    reads a few rows through the key's index only for a query that does nothing else (joined or
    aggregated, the same filter scans the table). Small results are then joined in Python."""
    if not values:
        return []
    return query_rows(con, f"SELECT {columns} FROM {table} WHERE {key} IN ({', '.join('?' * len(values))})", values)


def event_names(con: Any, name_ids: set[int]) -> dict[int, tuple[str, str]]:
    """{name_id: (kind, name)}."""
    rows = lookup(con, "event_names", "name_id, kind, name", "name_id", sorted(name_ids))
    return {name_id: (kind, name) for name_id, kind, name in rows}


class Lookups:
    """Small answers that many reads ask again: event names, whether a path is generated code, runs
    by number. Each is asked of the database once and kept, so an instance is only valid while the
    database stays as it is: the service keeps one per database state, everything else uses one per
    call. A read of a site asks ~10 small queries, and these were 4 of them (~40% of its time)."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[str, str]] = {}
        self._generated: dict[str, bool] = {}
        self._runs: dict[int, tuple] = {}
        self._rolled_up: bool | None = None

    @staticmethod
    def _fill(kept: dict, wanted: Any, fetch: Any) -> dict:
        missing = sorted({key for key in wanted if key not in kept})
        if missing:
            kept.update(fetch(missing))  # a race with another thread fetches twice, harmlessly
        return {key: kept[key] for key in wanted if key in kept}

    def event_names(self, con: Any, name_ids: Any) -> dict[int, tuple[str, str]]:
        """{name_id: (kind, name)}."""
        return self._fill(self._names, name_ids, lambda missing: event_names(con, set(missing)))

    def generated(self, con: Any, paths: Any) -> dict[str, bool]:
        """{path: whether it is generated code} (`is_generated_path`, sql/stacks.sql)."""

        def fetch(missing: list[str]) -> dict[str, bool]:
            sql = "SELECT p, coalesce(is_generated_path(p), false) FROM unnest(?::VARCHAR[]) AS t(p)"
            return dict(query_rows(con, sql, [missing]))

        return self._fill(self._generated, paths, fetch)

    def runs(self, con: Any, run_numbers: Any) -> dict[int, tuple]:
        """{run_number: (run_id, started_at in UTC, labels)}."""

        def fetch(missing: list[int]) -> dict[int, tuple]:
            # The labels as JSON text, parsed here: DuckDB's MAP made into dicts took most of a year's
            # 2,920 runs' read.
            columns = "run_number, run_id, started_at AT TIME ZONE 'UTC', to_json(labels)"
            if len(missing) > 256:  # a site's year of history: all of them, without a parameter per run
                rows = query_rows(con, f"SELECT {columns} FROM runs")
            else:
                rows = lookup(con, "runs", columns, "run_number", missing)
            return {
                number: (run_id, started, labels and json.loads(labels)) for number, run_id, started, labels in rows
            }

        return self._fill(self._runs, run_numbers, fetch)

    def any_rolled_up(self, con: Any) -> bool:
        """Whether `tbpipe retain` rolled up any run (then counts are read from its tables too)."""
        if self._rolled_up is None:
            self._rolled_up = any_rolled_up(con)
        return self._rolled_up


def any_rolled_up(con: Any) -> bool:
    return bool(query_rows(con, "SELECT 1 FROM runs WHERE rolled_up_at IS NOT NULL LIMIT 1"))


def _literals(values: Any) -> str:
    """Integers as a literal list for `IN (...)`: a constant filter reaches a table's zone maps
    through the views of sql/counts.sql, where a parameter list or a join would not."""
    return ", ".join(str(int(v)) for v in values) or "NULL"


def stack_counts(con: Any, stack_ids: list[int], lookups: Lookups | None = None) -> list[tuple[int, int, int]]:
    """(stack_id, name_id, events) rows of these stacks, a row per run and name, in every run: the
    ingest's `event_counts` through its index, and the rolled-up runs' counts (`rolled_up_stack_counts`,
    whose blocks are sorted by stack), the same rows as `run_stack_counts`."""
    rows = lookup(con, "event_counts", "stack_id, name_id, events", "stack_id", stack_ids)
    if stack_ids and (lookups or Lookups()).any_rolled_up(con):
        rows += query_rows(
            con,
            f"SELECT stack_id, name_id, events FROM rolled_up_stack_counts WHERE stack_id IN ({_literals(stack_ids)})",
        )
    return rows


def site_run_counts(con: Any, site_id: int, lookups: Lookups | None = None) -> list[tuple]:
    """(run_number, name_id, events, site_file, site_line) of a site in every run that has it: the
    ingest's `site_counts` through its index, and the rolled-up runs' (`rolled_up_site_counts`), the
    same rows as `run_site_counts`."""
    columns = "run_number, name_id, events::BIGINT, site_file, site_line"
    rows = lookup(con, "site_counts", columns, "site_id", [site_id])
    if (lookups or Lookups()).any_rolled_up(con):
        rows += query_rows(con, f"SELECT {columns} FROM rolled_up_site_counts WHERE site_id = ?", [site_id])
    return rows


def _frames_by_id(con: Any, frame_ids: set[int], lookups: Lookups) -> dict[int, tuple]:
    """{frame_id: (kind, function, file, line, module, address, inlined, generated)}."""
    if not frame_ids:
        return {}
    rows = lookup(
        con, "frames", "frame_id, kind, function, file, line, module, address, inlined", "frame_id", sorted(frame_ids)
    )

    # Whether each is generated code, asked of its path apart: the macro's subquery would turn the
    # lookup above into a scan.
    def path(kind: str, file: str | None, module: str | None) -> str:
        return (file if kind == "python" else module) or ""

    generated = lookups.generated(con, {path(row[1], row[3], row[5]) for row in rows})
    rows = [(*row, row[1] != "marker" and generated[path(row[1], row[3], row[5])]) for row in rows]
    return {row[0]: row[1:] for row in rows}


def stacks_frames(con: Any, stack_ids: list[int], lookups: Lookups | None = None) -> dict[int, list[Frame]]:
    """`stack_frames` of several stacks, read together; stacks the database lacks are left out."""
    if not stack_ids:
        return {}
    # The stacks' rows through their index (sql/migrations/007), then only their frames: joined in
    # one query, the rows of every stack are read.
    ids = [int(i) for i in stack_ids]
    placed = sorted(lookup(con, "stack_frame_rows", "stack_id, depth, frame_id", "stack_id", ids))
    frames_by_id = _frames_by_id(con, {frame_id for _, _, frame_id in placed}, lookups or Lookups())
    rows = [(stack_id, *frames_by_id[frame_id]) for stack_id, _depth, frame_id in placed]
    problems = dict(lookup(con, "stacks", "stack_id, problem", "stack_id", ids))
    out: dict[int, list[Frame]] = {stack_id: [] for stack_id in problems}
    for stack_id, kind, function, file, line, module, address, inlined, generated in rows:
        frames = out.get(stack_id)
        if frames is None:
            continue
        if kind == "native":
            name = _native_name(function, module, address)
            frames.append(frame("native", name, file, line, module, bool(inlined), bool(generated)))
        elif kind == "marker":
            frames.append(frame("marker", function or "<native walk stopped>", None, None, None))
        else:
            # An inlined Python frame: a user line that torch.compile compiled into the generated frame outside it.
            name = function or "<unknown code>"
            frames.append(frame("python", name, file, line, None, bool(inlined), bool(generated)))
    for stack_id, problem in problems.items():
        if problem:
            out[stack_id].append(frame("marker", f"<{problem}>", None, None, None))
    return out


@dataclass
class EventInfo:
    event_id: int
    run_id: str
    ts: str  # UTC
    thread_id: int
    thread_name: str | None
    kind: str
    name: str
    stack_id: int | None
    attrs: str | None
    op_stacks: str | None  # the run's capture setting (torch-ops: the stacks of ops called by ops)


def event(con: Any, event_id: int) -> EventInfo:
    rows = query_rows(
        con,
        """
        SELECT e.event_id, e.run_id, strftime(e.ts AT TIME ZONE 'UTC', '%Y-%m-%d %H:%M:%S.%f UTC'), e.thread_id,
               r.threads[e.thread_id], e.kind, e.name, e.stack_id, e.attrs,
               json_extract_string(r.capture, '$.op_stacks')
        FROM events e LEFT JOIN runs r USING (run_id)
        WHERE e.event_id = ?
        """,
        [event_id],
    )
    if not rows:
        rolled = query_rows(
            con,
            """
            SELECT r.run_id, strftime(r.rolled_up_at AT TIME ZONE 'UTC', '%Y-%m-%d %H:%M UTC')
            FROM rolled_up_runs u JOIN runs r USING (run_number)
            WHERE ? BETWEEN u.first_event_id AND u.last_event_id AND r.rolled_up_at IS NOT NULL
            """,
            [event_id],
        )
        if rolled:
            run_id, when = rolled[0]
            raise RolledUpError(
                f"event {event_id} was an event of run {run_id}, rolled up on {when} (`tbpipe retain`): its events "
                "are gone, its counts per stack and site remain (`tbpipe report`, `tbpipe show --site`, "
                "`tbpipe export -f pprof`)"
            )
        raise NotFoundError(f"no event {event_id} in the database")
    return EventInfo(*rows[0])


@dataclass
class CallingOp:
    """The op an op event was called by, in a run recorded with op_stacks=outermost (where the
    event may have taken that op's stack instead of gathering its own)."""

    op_id: int  # its `id` attribute (ops number themselves per thread)
    event_id: int | None  # its event, on the same thread of the same run; None when not recorded
    name: str | None
    shares_stack: bool | None  # the event has the calling op's stack; None when its event is missing


def calling_op(con: Any, info: EventInfo) -> CallingOp | None:
    """`CallingOp` of an op event of an op_stacks=outermost run that another op called; None for
    any other event. The same stack means nothing was walked for it: no Python code ran between the
    two ops, and the frames between them are not in it; a different one, that Python code ran
    between them. The calling op's event may be missing (not drawn below sample rate 1, dropped)."""
    if info.kind != "op" or info.op_stacks != "outermost" or not info.attrs:
        return None
    parent = json.loads(info.attrs).get("parent")
    if not isinstance(parent, int) or isinstance(parent, bool):
        return None
    rows = query_rows(
        con,
        """
        SELECT event_id, name, stack_id FROM events
        WHERE run_id = ? AND thread_id = ? AND kind = 'op' AND event_id < ?
          AND json_extract_string(attrs, '$.id') = ?  -- not `attrs ->> ...`: DuckDB 1.5 binds it looser than AND
        ORDER BY event_id DESC
        LIMIT 1
        """,
        [info.run_id, info.thread_id, info.event_id, str(parent)],
    )
    if not rows:
        return CallingOp(parent, None, None, None)
    event_id, name, stack_id = rows[0]
    return CallingOp(parent, event_id, name, stack_id == info.stack_id)


@dataclass
class ForwardOp:
    """The forward op a backward event is sited at (`backward_op_sites`)."""

    bwd_node: str | None
    bwd_seq: int
    event_id: int
    name: str
    stack_id: int | None
    site: str  # file:line:function of its call site


def forward_op(con: Any, event_id: int) -> ForwardOp:
    """The forward op of a backward op or of a kernel launched by one, or NotFoundError saying why not."""
    rows = query_rows(
        con,
        """
        SELECT bwd_node, bwd_seq, forward_event_id, forward_name, forward_stack_id,
               coalesce(forward_site_file, '??') || ':' || coalesce(CAST(forward_site_line AS VARCHAR), '?') || ':'
               || coalesce(forward_site_function, '??')
        FROM backward_op_sites WHERE event_id = ?
        """,
        [event_id],
    )
    if not rows:
        raise NotFoundError(
            f"event {event_id} did not run in autograd's backward (no `bwd_seq` from the torch-ops source)"
        )
    node, seq, forward_event_id, name, stack_id, site = rows[0]
    if forward_event_id is None:
        raise NotFoundError(
            f"event {event_id} ran in the backward of {node} (sequence number {seq}), whose forward op was not "
            "recorded (before the session, or left out by sampling)"
        )
    return ForwardOp(node, seq, forward_event_id, name, stack_id, site)


@dataclass
class GpuTime:
    """GPU time of a stack, an event or a site, by activity kind and role."""

    role: str  # 'launch': GPU work launched there; 'capture': kernels of graphs captured there, replayed elsewhere
    kind: str  # 'kernel', 'memcpy', 'memset', 'sync'
    executions: int
    gpu_time_ns: int


def stack_gpu_time(con: Any, stack_id: int) -> list[GpuTime]:
    """The GPU time a stack launched (and captured), summed over runs; empty without GPU activity."""
    rows = query_rows(
        con,
        """
        SELECT role, kind, sum(executions)::BIGINT, sum(gpu_time_ns)::BIGINT
        FROM stack_gpu_time WHERE stack_id = ? GROUP BY role, kind ORDER BY role DESC, kind
        """,
        [stack_id],
    )
    return [GpuTime(*row) for row in rows]


def event_gpu_time(con: Any, event_id: int) -> GpuTime | None:
    """The GPU time of the activity an event caused (a kernel, a graph replay's kernels, a copy); None when none."""
    rows = query_rows(con, "SELECT activities, gpu_time_ns FROM event_gpu_time WHERE event_id = ?", [event_id])
    return GpuTime("launch", "all", rows[0][0], rows[0][1]) if rows else None


def site_gpu_time(con: Any, site_key: str) -> list[GpuTime]:
    """GPU time launched at a site, and captured there (graph kernels replayed elsewhere), over all runs."""
    rows = query_rows(
        con,
        """
        SELECT 'launch' AS role, kind, sum(executions)::BIGINT, sum(gpu_time_ns)::BIGINT
        FROM gpu_time_sites WHERE site_key = ? GROUP BY kind
        UNION ALL
        SELECT 'capture', kind, sum(executions)::BIGINT, sum(gpu_time_ns)::BIGINT
        FROM gpu_time_sites WHERE capture_site_key = ? GROUP BY kind
        ORDER BY 1 DESC, 2
        """,
        [site_key, site_key],
    )
    return [GpuTime(*row) for row in rows]


@dataclass
class SiteStack:
    stack_id: int
    events: int
    names: list[str]


@dataclass
class SiteInfo:
    site_key: str
    function: str | None
    file: str | None
    line: int | None
    is_user: bool
    events: int
    stacks: list[SiteStack]  # the heaviest first
    stack_count: int
    site_id: int  # its row number in `sites`
    portable_file: str | None = None  # `file` relative to its import root: the same in every checkout


def _site_row(con: Any, site_key: str, columns: str) -> tuple:
    rows = query_rows(con, f"SELECT {columns} FROM sites WHERE site_key = ?", [site_key])
    if not rows:
        raise NotFoundError(f"no call site with key {site_key!r} in the database (keys are in `call_sites.site_key`)")
    return rows[0]


def site_newest_place(con: Any, site_id: int) -> tuple[str | None, int | None] | None:
    """Where the site was in the newest run that counts it (its file and line there: a site keeps its
    key while its line moves within its function); None when no run keeps its counts per site (every
    such run rolled up)."""
    rows = query_rows(
        con,
        """
        SELECT c.site_file, c.site_line FROM site_counts c JOIN runs r USING (run_number)
        WHERE c.site_id = ?
        ORDER BY r.started_at DESC, r.run_id DESC, c.events DESC LIMIT 1
        """,
        [site_id],
    )
    return rows[0] if rows else None


def site_id(con: Any, site_key: str) -> int:
    """The site's row number, by its key; NotFoundError when no site has that key."""
    return _site_row(con, site_key, "site_id")[0]


def site(con: Any, site_key: str, limit: int, lookups: Lookups | None = None) -> SiteInfo:
    """A call site by its key: where it is, how many events, and its heaviest stacks."""
    # Step by step, each a lookup by key or id through an index (sql/migrations/007): joined in one
    # query, the same answer scans the event counts of every stack.
    number, function, file, line, portable_file = _site_row(
        con, site_key, "site_id, function, file, line, portable_file"
    )
    members = query_rows(con, "SELECT stack_id, site_is_user FROM stack_sites WHERE site_id = ?", [number])
    events: dict[int, int] = {}
    names: dict[int, set[int]] = {}
    stack_ids = [stack_id for stack_id, _ in members]
    for stack_id, name_id, count in stack_counts(con, stack_ids, lookups):
        events[stack_id] = events.get(stack_id, 0) + count
        names.setdefault(stack_id, set()).add(name_id)
    heaviest = sorted(events, key=lambda stack_id: (-events[stack_id], stack_id))[:limit]
    texts = (lookups or Lookups()).event_names(con, set().union(*(names[stack_id] for stack_id in heaviest)))
    total = sum(events.values())
    return SiteInfo(
        site_key,
        function,
        file,
        line,
        any(is_user for _, is_user in members),
        total,
        [
            SiteStack(stack_id, events[stack_id], sorted({texts[name_id][1] for name_id in names[stack_id]}))
            for stack_id in heaviest
        ],
        len(members),
        number,
        portable_file,
    )


def top_sites(
    con: Any, kind: str | None, run_ids: list[str] | None, limit: int, *, name: str | None = None, offset: int = 0
) -> list[dict[str, Any]]:
    """The call sites with the most events (of `kind`, in `run_ids`, with `name` in the event name),
    summed over runs, from the `offset`-th on; each shown where most of its events were, by its file
    relative to its import root."""
    where, params = [], []
    if kind is not None:
        where.append("kind = ?")
        params.append(kind)
    if run_ids is not None:
        where.append("list_contains(?, run_id)")
        params.append(list(run_ids))
    if name is not None:
        where.append("contains(lower(name), lower(?))")
        params.append(name)
    rows = query_rows(
        con,
        f"""
        SELECT name, site_function, arg_max(coalesce(site_portable_file, site_file), events) AS site_file,
               arg_max(site_line, events) AS site_line, site_key, sum(events)::BIGINT AS events
        FROM call_sites
        {"WHERE " + " AND ".join(where) if where else ""}
        GROUP BY name, site_function, site_key
        ORDER BY events DESC, name, site_key
        LIMIT {int(limit)} OFFSET {int(offset)}
        """,
        params,
    )
    keys = ("name", "site_function", "site_file", "site_line", "site_key", "events")
    return [dict(zip(keys, row)) for row in rows]


_RUN_KEYS = (
    "run_id",
    "started_at",
    "ended_at",
    "complete",
    "host",
    "pid",
    "argv",
    "labels",
    "events",
    "stacks",
    "new_stacks",
    "python_version",
    "torch_version",
    "ingest_notes",
    "rolled_up_at",  # when `tbpipe retain` let its events go (UTC); None while it has them
)


def _runs_where(labels: dict[str, str] | None, complete: bool | None) -> tuple[str, list]:
    where, params = [], []
    for key, value in (labels or {}).items():
        where.append("labels[?] = ?")
        params += [key, value]
    if complete is not None:
        where.append("complete = ?")
        params.append(complete)
    return ("WHERE " + " AND ".join(where) if where else ""), params


def runs(
    con: Any,
    labels: dict[str, str] | None = None,
    *,
    complete: bool | None = None,
    newest_first: bool = False,
    limit: int | None = None,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """The runs matching all `labels` (and `complete`, when given), oldest first (or newest first),
    from the `offset`-th, at most `limit` of them."""
    where, params = _runs_where(labels, complete)
    order = "started_at DESC NULLS FIRST, run_id DESC" if newest_first else "started_at, run_id"
    page = f"LIMIT {int(limit)} OFFSET {int(offset)}" if limit is not None else ""
    rows = query_rows(
        con,
        f"""
        -- As UTC wall-clock times: a TIMESTAMPTZ fetched into Python needs pytz with DuckDB 1.x.
        SELECT run_id, started_at AT TIME ZONE 'UTC', ended_at AT TIME ZONE 'UTC', complete, host, pid, argv, labels,
               events, stacks, new_stacks,
               python_version, torch_version, ingest_notes, rolled_up_at AT TIME ZONE 'UTC'
        FROM runs
        {where}
        ORDER BY {order}
        {page}
        """,
        params,
    )
    return [dict(zip(_RUN_KEYS, row)) for row in rows]


def count_runs(con: Any, labels: dict[str, str] | None = None, *, complete: bool | None = None) -> int:
    """How many runs `runs` would list with these filters and no limit."""
    where, params = _runs_where(labels, complete)
    return int(query_rows(con, f"SELECT count(*) FROM runs {where}", params)[0][0])
