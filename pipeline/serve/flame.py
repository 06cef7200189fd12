"""Icicle trees: stacks merged into a tree of frames, weighted by events, for the pages' icicle graphs.

- `run_tree`      a run's events, outermost frame at the root, the event (kernel, op) as the leaf
- `diff_tree`     the same over a comparison's baseline and candidate runs: each node has both weights
- `callers_tree`  every stack path into one kernel or op (the "sandwich" view's callers): the event at
                  the root, the frame that launched it below, its callers further down
- `focused_frames` a combined traceback (the API's frames) focused the same way

Nodes are merged by (kind, function, file): one box per function however many lines of it appear.
Every tree is focused by a mode (`stacks.focus`: program, python, native, all) before it is merged;
focusing changes which boxes there are, never a weight.
Only the heaviest `MAX_STACKS` (kind, name, stack) triples are expanded and nodes thinner than
`MIN_FRACTION` of the root are cut, so the tree stays small enough for a browser; the root's weight
is the true total. The tree is built a level at a time over all stacks at once (numpy: a node is a
parent and a key), not a stack at a time: thousands of stacks of a hundred frames each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from tbpipe.pipeline.db import read
from tbpipe.pipeline.db.connection import query_arrow, query_rows
from tbpipe.pipeline.stacks import focus

MAX_STACKS = 3000
MAX_DEPTH = 160
MIN_FRACTION = 0.0005


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 4)


def _frame_label(kind: str, function: str | None, module: str | None, address: int | None) -> str:
    if kind == "marker":
        return function or "<native walk stopped>"
    if function:
        return function
    base = os.path.basename(module) if module else "??"
    return f"{base}+0x{address:x}" if address is not None else base


NO_LINE = -1


@dataclass
class _Paths:
    """Stacks as rows of node keys, in numpy arrays: `keys[i, j]` is the key of the j-th node on stack
    i's path (-1 past its end) and `lines[i, j]` its frame's line (NO_LINE: none); `labels[k]` is
    (name, kind, file) of key k."""

    keys: np.ndarray
    lines: np.ndarray
    labels: list[tuple[str, str, str | None]]


def rules_of(cursor: Any) -> focus.FrameRules:
    """The focus rules with this database's folders of tbpipe's own code (`read.focus_rules`)."""
    return read.focus_rules(cursor)


def _paths(
    cursor: Any,
    stack_ids: list[int],
    leaves: list[tuple[str, str] | None],
    outermost_first: bool,
    mode: str = focus.DEFAULT_MODE,
) -> _Paths:
    """The paths of `stack_ids` (in that order) focused by `mode` (`stacks.focus`), each ending in
    its leaf (kind, event name) if any. Frames are keyed by (kind, function, file): one box per
    function however many lines of it appear, and one per function across checkouts."""
    placed = query_arrow(
        cursor,
        f"""
        SELECT stack_id, depth, frame_id FROM stack_frame_rows
        WHERE stack_id IN (SELECT unnest(?::BIGINT[])) AND depth < {MAX_DEPTH}
        """,
        [stack_ids],
    )
    placed_frames = placed["frame_id"].to_numpy()
    # Selected again by stack: a list of every frame id as a parameter costs more to bind than this.
    # A Python frame's file is its portable name (relative to its import root), so that the same code
    # in two checkouts (last night's and tonight's) is one box, and a diff compares it with itself.
    described = query_arrow(
        cursor,
        f"""
        SELECT f.frame_id, f.kind, f.function,
               CASE WHEN f.kind = 'python' THEN coalesce(s.portable_file, f.file) ELSE f.file END AS file,
               f.line, f.module, f.address, f.file AS captured_file
        FROM frames f
        LEFT JOIN source_files s ON f.kind = 'python' AND s.file = f.file
        WHERE f.frame_id IN (
            SELECT frame_id FROM stack_frame_rows
            WHERE stack_id IN (SELECT unnest(?::BIGINT[])) AND depth < {MAX_DEPTH}
        )
        ORDER BY f.frame_id
        """,
        [stack_ids],
    )
    rules = rules_of(cursor)
    # One key per distinct (kind, label, file); each frame's focus class from its captured file.
    key_of: dict[tuple, int] = {}
    frame_keys = np.empty(len(described), dtype=np.int64)
    frame_lines = np.empty(len(described), dtype=np.int64)
    frame_classes = np.empty(len(described), dtype=np.int64)
    names = ("kind", "function", "file", "line", "module", "address", "captured_file")
    columns = [described[c].to_pylist() for c in names]
    for i, (kind, function, file, line, module, address, captured) in enumerate(zip(*columns)):
        frame_keys[i] = key_of.setdefault((kind, _frame_label(kind, function, module, address), file), len(key_of))
        frame_lines[i] = NO_LINE if line is None else line
        frame_classes[i] = rules.classify(kind, function, captured, module)
    # Each stack as a row of its frames (their rows in `described`), innermost first; a stack
    # weighted under several event names has a row per name.
    distinct = {stack_id: i for i, stack_id in enumerate(dict.fromkeys(stack_ids))}
    rows_stack = np.fromiter((distinct[s] for s in placed["stack_id"].to_pylist()), np.int64, len(placed))
    rows_depth = placed["depth"].to_numpy().astype(np.int64)
    described_at = np.searchsorted(described["frame_id"].to_numpy(), placed_frames)
    width = int(rows_depth.max(initial=-1)) + 1
    frame_at = np.full((len(distinct), width), -1, dtype=np.int64)
    frame_at[rows_stack, rows_depth] = described_at
    focused = focus.focus_matrix(np.where(frame_at >= 0, frame_classes[np.maximum(frame_at, 0)], focus.PAD), mode)
    shown = np.take_along_axis(frame_at, np.maximum(focused.columns, 0), axis=1)
    present = focused.columns >= 0
    # The start-up row (program mode) outermost; then each row's frames turned outermost first if asked.
    start_key = key_of.setdefault(("folded", focus.START_UP, None), len(key_of))
    folds = focused.start_up > 0
    lengths = focused.lengths + folds
    inner_keys = np.full((len(distinct), width + 1), -1, dtype=np.int64)
    inner_lines = np.full((len(distinct), width + 1), NO_LINE, dtype=np.int64)
    inner_keys[:, :width] = np.where(present, frame_keys[shown], -1)
    inner_lines[:, :width] = np.where(present, frame_lines[shown], NO_LINE)
    inner_keys[np.flatnonzero(folds), focused.lengths[folds]] = start_key
    positions = np.arange(width + 1)
    if outermost_first:
        source = np.where(positions[None, :] < lengths[:, None], lengths[:, None] - 1 - positions[None, :], width)
        inner_keys = np.take_along_axis(inner_keys, source, axis=1)
        inner_lines = np.take_along_axis(inner_lines, source, axis=1)
    keys = np.full((len(distinct), width + 2), -1, dtype=np.int64)  # and the leaf
    lines = np.full((len(distinct), width + 2), NO_LINE, dtype=np.int64)
    keys[:, : width + 1], lines[:, : width + 1] = inner_keys, inner_lines
    of_row = np.fromiter((distinct[s] for s in stack_ids), np.int64, len(stack_ids))
    keys, lines, lengths = keys[of_row], lines[of_row], lengths[of_row]
    for i, leaf in enumerate(leaves):
        if leaf is not None:
            keys[i, lengths[i]] = key_of.setdefault(("event", *leaf), len(key_of))
    labels = [(file, "event", None) if kind == "event" else (label, kind, file) for kind, label, file in key_of]
    return _Paths(keys, lines, labels)


def _tree(
    root_name: str,
    root_kind: str,
    paths: _Paths,
    values: np.ndarray,
    bases: np.ndarray | None,
    total_value: float,
    total_base: float,
) -> dict[str, Any]:
    """The paths merged into a tree, level by level (a node: a parent and a key), as the pages' JSON:
    {name, kind, value[, base][, file][, line][, children]}, children heaviest first, nodes thinner
    than MIN_FRACTION of the root left out. A node's line is its frame's in the heaviest stack through it."""
    diff = bases is not None
    stacks, width = paths.keys.shape
    parent, key, line, value, base = [-1], [-1], [NO_LINE], [total_value], [total_base]
    heaviest = [-1]  # the first (heaviest) stack through each node: ties in weight keep that order
    at = np.zeros(stacks, dtype=np.int64)  # each stack's node at the level above
    for level in range(width):
        active = np.flatnonzero(paths.keys[:, level] >= 0)
        if not len(active):
            break
        pairs = at[active] * (len(paths.labels) + 1) + paths.keys[active, level]
        unique, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
        ids = len(parent) + np.arange(len(unique))
        parent.extend(at[active][first].tolist())
        key.extend(paths.keys[active, level][first].tolist())
        line.extend(paths.lines[active, level][first].tolist())
        heaviest.extend(active[first].tolist())
        value.extend(np.bincount(inverse, weights=values[active], minlength=len(unique)).tolist())
        base.extend(
            np.bincount(inverse, weights=bases[active], minlength=len(unique)).tolist() if diff else [0.0] * len(unique)
        )
        at[active] = ids[inverse]
    floor = max(total_value, total_base) * MIN_FRACTION
    children: dict[int, list[int]] = {}
    for node in range(1, len(parent)):
        if max(value[node], base[node]) >= floor:
            children.setdefault(parent[node], []).append(node)

    def to_json(node: int) -> dict[str, Any]:
        if node == 0:
            name, kind, file = root_name, root_kind, None
        else:
            name, kind, file = paths.labels[key[node]]
        out: dict[str, Any] = {"name": name, "kind": kind, "value": _number(value[node])}
        if file:
            out["file"] = file
        if line[node] != NO_LINE:
            out["line"] = line[node]
        if diff:
            out["base"] = _number(base[node])
        kept = sorted(children.get(node, []), key=lambda c: (-max(value[c], base[c]), heaviest[c]))
        if kept:
            out["children"] = [to_json(c) for c in kept]
        return out

    return to_json(0)


def _weights(cursor: Any, run_numbers: list[int], kinds: list[str] | None, name: str | None) -> tuple[list, float]:
    """The heaviest (kind, name, stack_id, events) rows of these runs, and the events of all of them."""
    # The runs as literals: a constant filter reaches the rolled-up runs' blocks (sql/counts.sql).
    where = [f"c.run_number IN ({', '.join(str(int(n)) for n in run_numbers) or 'NULL'})"]
    params: list[Any] = []
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
        FROM run_stack_counts c JOIN event_names n USING (name_id)
        WHERE {" AND ".join(where)}
        GROUP BY ALL
        ORDER BY events DESC, c.stack_id
        LIMIT {MAX_STACKS}
        """,
        params,
    )
    total = rows[0][4] if rows else 0.0
    return [row[:4] for row in rows], total


def run_tree(
    cursor: Any, run_numbers: list[int], kinds: list[str] | None = None, mode: str = focus.DEFAULT_MODE
) -> dict[str, Any]:
    weights, total = _weights(cursor, run_numbers, kinds, None)
    paths = _paths(cursor, [row[2] for row in weights], [(kind, name) for kind, name, _, _ in weights], True, mode)
    values = np.array([row[3] for row in weights], dtype=np.float64)
    tree = _tree("all events", "root", paths, values, None, total, 0.0)
    return {"tree": tree, "stacks_shown": len(weights), "frames": mode}


def diff_tree(
    cursor: Any,
    candidate: list[int],
    baseline_sets: list[list[int]],
    kinds: list[str] | None = None,
    mode: str = focus.DEFAULT_MODE,
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
    paths = _paths(cursor, [k[2] for k in keys], [(k[0], k[1]) for k in keys], True, mode)
    values = np.array([cand_rows.get(k, 0.0) for k in keys], dtype=np.float64)
    bases = np.array([base_rows.get(k, 0.0) for k in keys], dtype=np.float64)
    tree = _tree("all events", "root", paths, values, bases, cand_total, base_total)
    return {"tree": tree, "stacks_shown": len(keys), "frames": mode}


def callers_tree(
    cursor: Any, name: str, kinds: list[str] | None, run_numbers: list[int] | None, mode: str = focus.DEFAULT_MODE
) -> dict[str, Any]:
    """Every stack path into the events named `name`, innermost frame first below the event."""
    if run_numbers is None:
        run_numbers = [r[0] for r in query_rows(cursor, "SELECT run_number FROM runs")]
    weights, total = _weights(cursor, run_numbers, kinds, name)
    paths = _paths(cursor, [row[2] for row in weights], [None] * len(weights), False, mode)
    values = np.array([row[3] for row in weights], dtype=np.float64)
    tree = _tree(name, "event", paths, values, None, total, 0.0)
    stacks = [
        {"stack_id": stack_id, "events": _number(events), "frames": int((paths.keys[i] >= 0).sum())}
        for i, (_kind, _name, stack_id, events) in enumerate(weights)
    ]
    return {"tree": tree, "stacks_shown": len(weights), "stacks": stacks, "frames": mode}


def focused_frames(cursor: Any, frames: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The API's frames of one traceback (innermost first) focused by `mode`; the start-up row as a
    frame of kind 'folded' that says how many frames it stands for."""
    if mode == "all":
        return frames
    out = []
    for frame in focus.focus_frames(frames, mode, rules_of(cursor)):
        if isinstance(frame, focus.StartUp):
            frame = {"kind": "folded", "function": frame.text, "file": None, "line": None, "module": None,
                     "inlined": False, "generated": False, "folded": frame.frames}  # fmt: skip
        out.append(frame)
    return out
