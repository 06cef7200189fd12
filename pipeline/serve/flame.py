"""Icicle trees: stacks merged into a tree of frames, weighted by events, for the pages' icicle graphs.

- `run_tree`      a run's events, outermost frame at the root, the event (kernel, op) as the leaf
- `diff_tree`     the same over a comparison's baseline and candidate runs: each node has both weights
- `callers_tree`  every stack path into one kernel or op (the "sandwich" view's callers): the event at
                  the root, the frame that launched it below, its callers further down

Nodes are merged by (kind, function, file): one box per function however many lines of it appear.
Only the heaviest `MAX_STACKS` (kind, name, stack) triples are expanded and nodes thinner than
`MIN_FRACTION` of the root are cut, so the tree stays small enough for a browser; the root's weight
is the true total.
"""

from __future__ import annotations

import os
from typing import Any

from tbpipe.pipeline.db.connection import query_arrow, query_rows

MAX_STACKS = 3000
MAX_DEPTH = 160
MIN_FRACTION = 0.0005


class _Node:
    __slots__ = ("name", "kind", "file", "line", "value", "base", "children")

    def __init__(self, name: str, kind: str, file: str | None, line: int | None):
        self.name, self.kind, self.file, self.line = name, kind, file, line
        self.value = 0.0
        self.base = 0.0
        self.children: dict[tuple, _Node] = {}

    def child(self, key: tuple, name: str, kind: str, file: str | None, line: int | None) -> _Node:
        node = self.children.get(key)
        if node is None:
            node = self.children[key] = _Node(name, kind, file, line)
        return node

    def to_json(self, floor: float, diff: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "value": _number(self.value)}
        if self.file:
            out["file"] = self.file
        if self.line is not None:
            out["line"] = self.line
        if diff:
            out["base"] = _number(self.base)
        kept = [c for c in self.children.values() if max(c.value, c.base) >= floor]
        kept.sort(key=lambda c: -max(c.value, c.base))
        if kept:
            out["children"] = [c.to_json(floor, diff) for c in kept]
        return out


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 4)


def _frame_label(kind: str, function: str | None, module: str | None, address: int | None) -> str:
    if kind == "marker":
        return function or "<native walk stopped>"
    if function:
        return function
    base = os.path.basename(module) if module else "??"
    return f"{base}+0x{address:x}" if address is not None else base


def _frames(cursor: Any, stack_ids: list[int]) -> dict[int, list[tuple]]:
    """{stack_id: [(kind, label, file, line), ...] innermost first}."""
    if not stack_ids:
        return {}
    table = query_arrow(
        cursor,
        f"""
        SELECT stack_id, kind, function, file, line, module, address
        FROM stack_frames
        WHERE stack_id IN (SELECT unnest(?::BIGINT[])) AND depth < {MAX_DEPTH}
        ORDER BY stack_id, depth
        """,
        [stack_ids],
    )
    columns = [table[c].to_pylist() for c in ("stack_id", "kind", "function", "file", "line", "module", "address")]
    out: dict[int, list[tuple]] = {}
    for stack_id, kind, function, file, line, module, address in zip(*columns):
        out.setdefault(stack_id, []).append((kind, _frame_label(kind, function, module, address), file, line))
    return out


def _weights(cursor: Any, run_numbers: list[int], kinds: list[str] | None, name: str | None) -> tuple[list, float]:
    """The heaviest (kind, name, stack_id, events) rows of these runs, and the events of all of them."""
    where = ["c.run_number IN (SELECT unnest(?::INTEGER[]))"]
    params: list[Any] = [run_numbers]
    if kinds:
        where.append("list_contains(?, n.kind)")
        params.append(list(kinds))
    if name is not None:
        where.append("n.name = ?")
        params.append(name)
    rows = query_rows(
        cursor,
        f"""
        SELECT n.kind, n.name, c.stack_id, sum(c.events)::DOUBLE AS events, sum(sum(c.events)) OVER ()::DOUBLE AS total
        FROM event_counts c JOIN event_names n USING (name_id)
        WHERE {" AND ".join(where)}
        GROUP BY ALL
        ORDER BY events DESC, c.stack_id
        LIMIT {MAX_STACKS}
        """,
        params,
    )
    total = rows[0][4] if rows else 0.0
    return [row[:4] for row in rows], total


def _finish(root: _Node, total_value: float, total_base: float, diff: bool, **extra: Any) -> dict[str, Any]:
    root.value, root.base = total_value, total_base
    floor = max(root.value, root.base) * MIN_FRACTION
    out = {"tree": root.to_json(floor, diff), **extra}
    return out


def run_tree(cursor: Any, run_numbers: list[int], kinds: list[str] | None = None) -> dict[str, Any]:
    weights, total = _weights(cursor, run_numbers, kinds, None)
    frames = _frames(cursor, sorted({row[2] for row in weights if row[2] is not None}))
    root = _Node("all events", "root", None, None)
    for kind, name, stack_id, events in weights:
        _add_path(root, reversed(frames.get(stack_id, [])), (kind, name), events, 0.0)
    return _finish(root, total, 0.0, False, stacks_shown=len(weights))


def diff_tree(
    cursor: Any, candidate: list[int], baseline_sets: list[list[int]], kinds: list[str] | None = None
) -> dict[str, Any]:
    """Candidate weights against the baseline's (the mean over its sets, for a window)."""
    cand_weights, cand_total = _weights(cursor, candidate, kinds, None)
    base_rows: dict[tuple, float] = {}
    base_total = 0.0
    for run_set in baseline_sets:
        rows, total = _weights(cursor, run_set, kinds, None)
        base_total += total / len(baseline_sets)
        for kind, name, stack_id, events in rows:
            key = (kind, name, stack_id)
            base_rows[key] = base_rows.get(key, 0.0) + events / len(baseline_sets)
    cand_rows = {(k, n, s): e for k, n, s, e in cand_weights}
    keys = sorted(set(cand_rows) | set(base_rows), key=lambda k: -max(cand_rows.get(k, 0.0), base_rows.get(k, 0.0)))
    keys = keys[:MAX_STACKS]
    frames = _frames(cursor, sorted({k[2] for k in keys if k[2] is not None}))
    root = _Node("all events", "root", None, None)
    for key in keys:
        kind, name, stack_id = key
        _add_path(
            root, reversed(frames.get(stack_id, [])), (kind, name), cand_rows.get(key, 0.0), base_rows.get(key, 0.0)
        )
    return _finish(root, cand_total, base_total, True, stacks_shown=len(keys))


def callers_tree(cursor: Any, name: str, kinds: list[str] | None, run_numbers: list[int] | None) -> dict[str, Any]:
    """Every stack path into the events named `name`, innermost frame first below the event."""
    if run_numbers is None:
        run_numbers = [r[0] for r in query_rows(cursor, "SELECT run_number FROM runs")]
    weights, total = _weights(cursor, run_numbers, kinds, name)
    frames = _frames(cursor, sorted({row[2] for row in weights if row[2] is not None}))
    root = _Node(name, "event", None, None)
    paths = []
    for _kind, _name, stack_id, events in weights:
        path = frames.get(stack_id, [])
        _add_path(root, iter(path), None, events, 0.0)
        paths.append({"stack_id": stack_id, "events": _number(events), "frames": len(path)})
    return {**_finish(root, total, 0.0, False, stacks_shown=len(weights)), "stacks": paths}


def _add_path(root: _Node, frames, leaf: tuple[str, str] | None, value: float, base: float) -> None:
    node = root
    node.value += value
    node.base += base
    for kind, label, file, line in frames:
        node = node.child((kind, label, file), label, kind, file, line)
        node.value += value
        node.base += base
    if leaf is not None:
        kind, name = leaf
        node = node.child(("event", kind, name), name, "event", None, None)
        node.value += value
        node.base += base
