"""Top stacks of raw runs, read straight from the run folders (before any ingest)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console

from tbpipe.pipeline.rawrun import find_run_dirs, read_run
from tbpipe.pipeline.stacks import format_frames, symbolize_stacks


def print_top_stacks(out_dir: Path, kind: str, top: int, console: Console | None = None) -> None:
    from tbpipe.pipeline.symbols import Symbolizer

    console = console or Console()
    symbolizer = Symbolizer()
    for run_dir in find_run_dirs([out_dir]):
        run = read_run(run_dir)
        events = run.tables["events"].filter(pc.equal(run.tables["events"]["kind"], kind))
        counts = events.group_by(["stack_id", "name"]).aggregate([("stack_id", "count")])
        counts = counts.sort_by([("stack_id_count", "descending")]).slice(0, top)
        stacks = run.tables["stacks"]
        state = "complete" if run.complete else "incomplete"
        console.rule(f"run {run.run_id} ({state}): {events.num_rows} {kind} events")
        for row in counts.to_pylist():
            match = stacks.filter(pc.equal(stacks["stack_id"], pa.scalar(row["stack_id"], pa.uint64())))
            frames = symbolize_stacks(match.slice(0, 1), run.tables["modules"], run.tables["code"], symbolizer)[0]
            console.print(f"[bold]{row['stack_id_count']}× {row['name']}[/]")
            console.print(format_frames(frames), highlight=False, markup=False)
            console.print()
