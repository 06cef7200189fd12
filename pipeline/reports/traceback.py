"""`tbpipe show`: one event, stack or call site with its combined traceback (`format_frames`), focused
by a mode of `stacks.focus` (program, python, native, all)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from tbpipe.pipeline.db import read
from tbpipe.pipeline.reports.units import format_duration
from tbpipe.pipeline.stacks import focus
from tbpipe.pipeline.stacks.render import format_frames


def focused_text(con: Any, frames: list[dict[str, Any]], mode: str) -> str:
    """`format_frames` of the frames `mode` shows; the start-up frames folded into one line."""
    if mode == "all":
        return format_frames(frames)
    lines = []
    for frame in focus.focus_frames(frames, mode, read.focus_rules(con)):
        lines.append(frame.text if isinstance(frame, focus.StartUp) else format_frames([frame]))
    return "\n".join(lines)


def _traceback(console: Console, con: Any, stack_id: int, mode: str = focus.DEFAULT_MODE) -> None:
    text = focused_text(con, read.stack_frames(con, stack_id), mode)
    console.print(text, highlight=False, markup=False, soft_wrap=True)


_NOUNS = {"kernel": "kernel", "memcpy": "copy", "memset": "set", "sync": "synchronization"}


def gpu_time_lines(times: list[read.GpuTime]) -> list[str]:
    """`# GPU time ...` lines: what was launched, then what was captured into graphs replayed elsewhere."""
    lines = []
    for role in ("launch", "capture"):
        parts = [
            f"{format_duration(t.gpu_time_ns)} in {t.executions:,} {_NOUNS.get(t.kind, t.kind)}"
            f"{'s' if t.executions != 1 else ''}"
            for t in times
            if t.role == role
        ]
        if parts:
            where = "launched here" if role == "launch" else "kernels of CUDA graphs captured here, replayed elsewhere"
            lines.append(f"# GPU time ({where}): {', '.join(parts)}")
    return lines


def _print_gpu_time(console: Console, times: list[read.GpuTime]) -> None:
    for line in gpu_time_lines(times):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def show_event(con: Any, event_id: int, console: Console, mode: str = focus.DEFAULT_MODE) -> None:
    info = read.event(con, event_id)
    thread = f"{info.thread_id}" + (f" ({info.thread_name})" if info.thread_name else "")
    console.print(f"# event {info.event_id}: {info.kind} {info.name}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"# run {info.run_id}, thread {thread}, at {info.ts}", highlight=False, markup=False, soft_wrap=True)
    if info.attrs:
        console.print(f"# attrs {info.attrs}", highlight=False, markup=False, soft_wrap=True)
    gpu = read.event_gpu_time(con, event_id)
    if gpu is not None:
        console.print(
            f"# GPU time {format_duration(gpu.gpu_time_ns)} in {gpu.executions:,} "
            f"activit{'y' if gpu.executions == 1 else 'ies'} it caused",
            highlight=False,
            markup=False,
        )
    if info.stack_id is None:
        console.print("# no stack was recorded for this event", highlight=False, markup=False)
        return
    console.print(f"# stack {info.stack_id}", highlight=False, markup=False)
    note = _enclosing_op_note(con, info)
    if note:
        console.print(note, highlight=False, markup=False, soft_wrap=True)
    _traceback(console, con, info.stack_id, mode)


def _enclosing_op_note(con: Any, info: read.EventInfo) -> str | None:
    """For an op of an op_stacks=outermost run called by another op: whose stack it has."""
    caller = read.calling_op(con, info)
    if caller is None:
        return None
    if caller.event_id is None:  # the calling op's event is not in the run: the stacks cannot be compared
        return (
            f"# called by op {caller.op_id} of this thread, recorded with op_stacks=outermost: unless Python code "
            "ran between the two ops, this is the stack of the outermost of them (no frames between)"
        )
    called_by = f"# called by op {caller.op_id} of this thread (event {caller.event_id}, {caller.name})"
    if caller.shares_stack:
        return (
            f"{called_by}; recorded with op_stacks=outermost, it has that op's stack: the frames between the two "
            "ops are not in it"
        )
    return f"{called_by}; Python code ran between the two ops, so it has a stack of its own"


def show_forward_of_event(con: Any, event_id: int, console: Console, mode: str = focus.DEFAULT_MODE) -> None:
    """A backward event sited at its forward op: the event, then the forward op's traceback."""
    info = read.event(con, event_id)
    forward = read.forward_op(con, event_id)
    console.print(f"# event {info.event_id}: {info.kind} {info.name}", highlight=False, markup=False, soft_wrap=True)
    console.print(
        f"# ran in the backward of {forward.bwd_node} (sequence number {forward.bwd_seq}); sited at its forward op, "
        f"event {forward.event_id} {forward.name}, at {forward.site}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if forward.stack_id is None:
        console.print("# no stack was recorded for the forward op", highlight=False, markup=False)
        return
    console.print(f"# stack {forward.stack_id} (the forward op's)", highlight=False, markup=False)
    _traceback(console, con, forward.stack_id, mode)


def show_stack(con: Any, stack_id: int, console: Console, mode: str = focus.DEFAULT_MODE) -> None:
    frames = read.stack_frames(con, stack_id)
    shown = "" if mode == "all" else f" ({mode} frames shown)"
    console.print(f"# stack {stack_id}: {len(frames)} frames, innermost first{shown}", highlight=False, markup=False)
    _print_gpu_time(console, read.stack_gpu_time(con, stack_id))
    console.print(focused_text(con, frames, mode), highlight=False, markup=False, soft_wrap=True)


def show_site(con: Any, site_key: str, limit: int, console: Console, mode: str = focus.DEFAULT_MODE) -> None:
    info = read.site(con, site_key, limit)
    # The newest run's place: the sites row keeps the one the site was first recorded at, and a site
    # keeps its key while its line moves within its function.
    newest = read.site_newest_place(con, info.site_id)
    file, line = newest if newest is not None else (info.file, info.line)
    where = f"{file or '??'}:{line if line is not None else '?'}:{info.function}"
    kind = "user frame" if info.is_user else "no user frame; innermost symbolized frame"
    console.print(
        f"# call site {info.site_key}: {where} ({kind}; {'in the newest run' if newest else 'where first recorded'})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    console.print(
        f"# {info.events:,} events from {info.stack_count} stack{'s' if info.stack_count != 1 else ''}"
        + (f"; the {len(info.stacks)} heaviest follow" if info.stack_count > len(info.stacks) else ""),
        highlight=False,
        markup=False,
    )
    _print_gpu_time(console, read.site_gpu_time(con, site_key))
    for entry in info.stacks:
        console.print()
        console.print(
            f"# stack {entry.stack_id}: {entry.events:,} events ({', '.join(entry.names)})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        _print_gpu_time(console, read.stack_gpu_time(con, entry.stack_id))
        _traceback(console, con, entry.stack_id, mode)
