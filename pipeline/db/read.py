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
    rows = query_rows(
        con,
        """
        SELECT kind, function, file, line, module, address, inlined,
               kind <> 'marker' AND coalesce(is_generated_path(CASE WHEN kind = 'python' THEN file ELSE module END), false)
        FROM stack_frames WHERE stack_id = ? ORDER BY depth
        """,
        [stack_id],
    )
    problem = query_rows(con, "SELECT problem FROM stacks WHERE stack_id = ?", [stack_id])
    if not problem:
        raise NotFoundError(f"no stack {stack_id} in the database")
    frames = []
    for kind, function, file, line, module, address, inlined, generated in rows:
        if kind == "native":
            name = _native_name(function, module, address)
            frames.append(frame("native", name, file, line, module, bool(inlined), bool(generated)))
        elif kind == "marker":
            frames.append(frame("marker", function or "<native walk stopped>", None, None, None))
        else:
            # An inlined Python frame: a user line that torch.compile compiled into the generated frame outside it.
            name = function or "<unknown code>"
            frames.append(frame("python", name, file, line, None, bool(inlined), bool(generated)))
    if problem[0][0]:
        frames.append(frame("marker", f"<{problem[0][0]}>", None, None, None))
    return frames


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
