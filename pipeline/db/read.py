"""Reading the database for people: stacks as frames, events, call sites, runs.

Frames come back as `tbpipe.pipeline.stacks.Frame` dicts, so `format_frames` prints a stack from
the database exactly as it prints one symbolized in-process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.stacks.render import Frame, frame


class NotFoundError(UsageError):
    """An event, stack or call site the database does not have."""


def _native_name(function: str | None, module: str | None, address: int | None) -> str:
    if function:
        return function
    base = os.path.basename(module) if module else "??"
    return f"{base}+0x{address:x}" if address is not None else base


def stack_frames(con: Any, stack_id: int) -> list[Frame]:
    """The stack's frames, innermost first, with its combined-order problem (if any) as a last marker."""
    frames = stacks_frames(con, [stack_id]).get(stack_id)
    if frames is None:
        raise NotFoundError(f"no stack {stack_id} in the database")
    return frames


def stacks_frames(con: Any, stack_ids: list[int]) -> dict[int, list[Frame]]:
    """`stack_frames` of several stacks in two queries; stacks the database lacks are left out."""
    if not stack_ids:
        return {}
    # The stacks' rows first, then only their frames: joined through the `stack_frames` view, a few
    # stacks' frames cost a scan of the whole `frames` table.
    ids = [int(i) for i in stack_ids]
    wanted = ", ".join("?" * len(ids))
    rows = query_rows(
        con,
        f"""
        WITH r AS (SELECT stack_id, depth, frame_id FROM stack_frame_rows WHERE stack_id IN ({wanted}))
        SELECT r.stack_id, f.kind, f.function, f.file, f.line, f.module, f.address, f.inlined,
               f.kind <> 'marker'
                   AND coalesce(is_generated_path(CASE WHEN f.kind = 'python' THEN f.file ELSE f.module END), false)
        FROM r JOIN frames f ON f.frame_id = r.frame_id AND f.frame_id IN (SELECT frame_id FROM r)
        ORDER BY r.stack_id, r.depth
        """,
        ids,
    )
    problems = dict(query_rows(con, f"SELECT stack_id, problem FROM stacks WHERE stack_id IN ({wanted})", ids))
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


def event(con: Any, event_id: int) -> EventInfo:
    rows = query_rows(
        con,
        """
        SELECT e.event_id, e.run_id, strftime(e.ts AT TIME ZONE 'UTC', '%Y-%m-%d %H:%M:%S.%f UTC'), e.thread_id,
               r.threads[e.thread_id], e.kind, e.name, e.stack_id, e.attrs
        FROM events e LEFT JOIN runs r USING (run_id)
        WHERE e.event_id = ?
        """,
        [event_id],
    )
    if not rows:
        raise NotFoundError(f"no event {event_id} in the database")
    return EventInfo(*rows[0])


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


def site(con: Any, site_key: str, limit: int) -> SiteInfo:
    """A call site by its key: where it is, how many events, and its heaviest stacks."""
    heads = query_rows(
        con,
        """
        SELECT t.function, t.file, t.line, bool_or(s.site_is_user), count(*)
        FROM sites t JOIN stack_sites s USING (site_id)
        WHERE t.site_key = ?
        GROUP BY ALL
        """,
        [site_key],
    )
    if not heads:
        raise NotFoundError(f"no call site with key {site_key!r} in the database (keys are in `call_sites.site_key`)")
    function, file, line, is_user, stack_count = heads[0]
    stacks = query_rows(
        con,
        """
        SELECT c.stack_id, sum(c.events)::BIGINT AS events, list(DISTINCT n.name ORDER BY n.name) AS names
        FROM event_counts c
        JOIN event_names n USING (name_id)
        JOIN stack_sites s USING (stack_id)
        JOIN sites t USING (site_id)
        WHERE t.site_key = ?
        GROUP BY c.stack_id
        ORDER BY events DESC, c.stack_id
        """,
        [site_key],
    )
    total = sum(row[1] for row in stacks)
    return SiteInfo(
        site_key,
        function,
        file,
        line,
        bool(is_user),
        total,
        [SiteStack(stack_id, events, list(names)) for stack_id, events, names in stacks[:limit]],
        stack_count,
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


def runs(con: Any, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every run (matching all `labels`), oldest first."""
    where, params = [], []
    for key, value in (labels or {}).items():
        where.append("labels[?] = ?")
        params += [key, value]
    rows = query_rows(
        con,
        f"""
        -- As UTC wall-clock times: a TIMESTAMPTZ fetched into Python needs pytz with DuckDB 1.x.
        SELECT run_id, started_at AT TIME ZONE 'UTC', ended_at AT TIME ZONE 'UTC', complete, host, pid, argv, labels,
               events, stacks, new_stacks,
               python_version, torch_version, ingest_notes
        FROM runs
        {"WHERE " + " AND ".join(where) if where else ""}
        ORDER BY started_at, run_id
        """,
        params,
    )
    keys = (
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
    )
    return [dict(zip(keys, row)) for row in rows]
