"""The ingest's flow: find run folders, and per run read, lay out and load it in one transaction.

Per run: validate it (`rawrun`: manifest, every part's footer, schema and page checksums; a
damaged run is quarantined and the others go on), skip it when the database already has it (a
run ingested while incomplete is loaded again once its files changed), flatten and hash its
stacks (`stacks.flatten`), find which stacks the database does not know yet, symbolize their new
addresses (`symbols`), lay out their frames (`stacks.layout`), then insert everything (`rows`)
and site the new stacks (`siting`) in one transaction. A kill at any point leaves the database as
it was before that run's transaction; the ingest lock keeps two ingests apart.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db.connection import (
    ingest_lock,
    open_database,
    query_arrow,
    query_rows,
    query_value,
    resolve_db_path,
)
from tbpipe.pipeline.db.ingest import rows as run_rows
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary, RunOutcome, UnsymbolizedGroup
from tbpipe.pipeline.db.ingest.siting import parse_user_code, site_stacks, store_user_code
from tbpipe.pipeline.db.ingest.symbols import SymbolLoader
from tbpipe.pipeline.db.ingest.tables import IngestDb, QuarantineRun, sql_text
from tbpipe.pipeline.errors import first_line
from tbpipe.pipeline.progress import RunProgress
from tbpipe.pipeline.rawrun import (
    DamagedRunError,
    MissingManifestError,
    find_run_dirs,
    part_files,
    parts_fingerprint,
    read_manifest,
    read_tables,
    recovered_manifest,
    reference_problems,
    verify_part,
)
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.stacks.flatten import FlatRun, flatten_run


def ingest_runs(
    roots: Sequence[Path],
    options: IngestOptions | None = None,
    *,
    on_message: Callable[[str], None] | None = None,
) -> IngestSummary:
    """Ingests every run directory under `roots` into the database; see the module docstring."""
    options = options or IngestOptions()
    started = time.monotonic()
    db_path = resolve_db_path(options.db_path)
    rules = parse_user_code(options.user_code)
    run_dirs = find_run_dirs([Path(r) for r in roots])
    say = on_message or (lambda text: print(f"tbpipe: {text}", file=sys.stderr))
    summary = IngestSummary(db_path=db_path)
    with ingest_lock(db_path, options.wait_s, on_wait=say):
        con = open_database(db_path, wait_s=options.wait_s, on_wait=say)
        loader = RunLoader(IngestDb(con), options, summary)
        try:
            store_user_code(loader.db, rules)
            summary.user_code = rules
            loader.symbols.refresh_improved_modules()
            with RunProgress(options.progress, len(run_dirs)) as progress:
                for run_dir in run_dirs:
                    progress.start(run_dir)
                    outcome = loader.ingest_run(run_dir, progress)
                    summary.outcomes.append(outcome)
                    progress.finish(outcome.events)
        finally:
            loader.symbols.close()
            con.close()
    summary.seconds = time.monotonic() - started
    return summary


class RunLoader:
    def __init__(self, db: IngestDb, options: IngestOptions, summary: IngestSummary):
        self.db = db
        self.options = options
        self.summary = summary
        self.symbols = SymbolLoader(db, options, summary)
        # Checkpointing after every run's commit would rewrite the growing tables 40 times for 40
        # runs; the WAL holds the committed runs until the checkpoint that closing the database does.
        db.con.execute("SET checkpoint_threshold = '4GB'")

    def ingest_run(self, run_dir: Path, progress: RunProgress) -> RunOutcome:
        notes = []
        try:
            try:
                manifest = read_manifest(run_dir)
            except MissingManifestError:
                if not self.options.recover_manifests:
                    raise
                manifest = recovered_manifest(run_dir)
                notes.append("manifest.json was missing: recovered from the run's parts (no labels, argv or versions)")
            fingerprint = parts_fingerprint(run_dir, manifest)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", reason=str(error))
        run_id = manifest["run_id"]
        rows = query_rows(self.db.con, "SELECT complete, parts FROM runs WHERE run_id = ?", [run_id])
        existing = rows[0] if rows else None
        if existing is not None and (existing[0] or existing[1] == fingerprint):
            return RunOutcome(run_dir, "present", run_id=run_id, complete=existing[0])
        try:
            data = self._read(run_dir, manifest, fingerprint, progress, notes)
            progress.describe(f"loading {data.events:,} events")
            return self._load(data, replace=existing is not None)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", run_id=run_id, reason=str(error))
        except QuarantineRun as error:
            return RunOutcome(run_dir, "quarantined", run_id=run_id, reason=f"{run_dir}: {error}")

    # ---------------------------------------------------------------- reading and laying out

    def _read(
        self, run_dir: Path, manifest: dict[str, Any], fingerprint: str, progress: RunProgress, notes: list[str]
    ) -> run_rows.RunData:
        files = part_files(run_dir, manifest)
        event_files = [(path, verify_part(path, "events")) for path in files["events"]]
        tables = read_tables(files, ("stacks", "modules", "code"))
        notes = notes + reference_problems(tables)
        progress.describe(f"hashing {tables['stacks'].num_rows:,} stacks")
        flat = flatten_run(tables)
        stack_ids, new_ids = self._stack_ids(flat)
        dangling = self._dangling_events(event_files, flat, stack_ids)
        if dangling:
            notes.append(f"{dangling} events refer to stacks the run does not hold: their stack is NULL")
        if notes and manifest.get("complete"):
            raise DamagedRunError(f"{run_dir}: {'; '.join(notes)}")

        new_order = np.flatnonzero(new_ids >= 0)
        new_order = new_order[np.argsort(new_ids[new_order], kind="stable")]
        frames = problems = symbols = statuses = None
        if len(new_order):
            slots, shapes = self._slots(flat, new_ids, new_order)
            progress.describe(f"symbolizing the frames of {len(new_order):,} new stacks")
            known, symbols, statuses = self.symbols.symbols_for(slots)
            frames = layout.expand(slots, known)
            problems = shapes.problem
        return run_rows.RunData(
            run_dir,
            manifest,
            fingerprint,
            event_files,
            flat,
            stack_ids,
            new_ids,
            frames,
            problems,
            new_order,
            symbols,
            statuses,
            notes,
        )

    def _stack_ids(self, flat: FlatRun) -> tuple[np.ndarray, np.ndarray]:
        """Per distinct raw stack: its database stack_id, and the id again where this run brings it in (else -1)."""
        db = self.db
        hashes, first, inverse = np.unique(flat.hashes, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
        db.register("ingest_hashes", pa.table({"stack_hash": pa.array(hashes, pa.uint64())}))
        try:
            known = query_arrow(
                db.con,
                "SELECT stack_hash, stack_id FROM stacks WHERE stack_hash IN (SELECT stack_hash FROM ingest_hashes)",
            )
        finally:
            db.unregister("ingest_hashes")
        ids = np.full(len(hashes), -1, dtype=np.int64)
        if known.num_rows:
            ids[np.searchsorted(hashes, known["stack_hash"].to_numpy())] = known["stack_id"].to_numpy()
        missing = np.flatnonzero(ids < 0)
        # New ids follow the order the raw stacks come in, so each run's frames are stored by stack id.
        missing = missing[np.argsort(first[missing], kind="stable")]
        base = query_value(db.con, "SELECT coalesce(max(stack_id), 0) + 1 FROM stacks")
        ids[missing] = base + np.arange(len(missing), dtype=np.int64)
        new = np.full(len(flat.hashes), -1, dtype=np.int64)
        # One raw stack stands for each new hash (two raw stacks of a run may mean the same stack).
        new[first[missing]] = ids[missing]
        return ids[inverse], new

    def _dangling_events(self, event_files: list[tuple[Path, int]], flat: FlatRun, stack_ids: np.ndarray) -> int:
        """Events whose stack the run does not hold (a killed process flushed the events, not the stack)."""
        if not event_files:
            return 0
        import duckdb

        files = "[" + ", ".join(sql_text(str(path)) for path, _rows in event_files) + "]"
        self.db.register("ingest_stack_map", run_rows.stack_map(flat, stack_ids))
        try:
            return int(
                query_value(
                    self.db.con,
                    f"""
                    SELECT count(*) FROM read_parquet({files}) e
                    WHERE e.stack_id IS NOT NULL
                      AND e.stack_id NOT IN (SELECT raw_id FROM ingest_stack_map)
                    """,
                )
                or 0
            )
        except duckdb.Error as error:
            raise DamagedRunError(f"{event_files[0][0].parent}: events unreadable ({first_line(error)})") from None
        finally:
            self.db.unregister("ingest_stack_map")

    def _slots(self, flat: FlatRun, new_ids: np.ndarray, new_order: np.ndarray):
        """Slots of the new stacks (by stack id)."""
        native, python = flat.native, flat.python
        native_rows = _frames_of(flat.native_lengths, new_order)
        python_rows = _frames_of(flat.python_lengths, new_order)
        return layout.combined_slots(
            stack_ids=new_ids[new_order],
            status=flat.status[new_order],
            native_lengths=flat.native_lengths[new_order],
            python_lengths=flat.python_lengths[new_order],
            native_ref=native.ref[native_rows],
            native_address=native.value[native_rows],
            native_flags=native.flags[native_rows],
            python_ref=python.ref[python_rows],
            python_line=python.value[python_rows],
            python_flags=python.flags[python_rows],
            modules=flat.modules,
            code=flat.code,
        )

    # ---------------------------------------------------------------- the transaction

    def _load(self, data: run_rows.RunData, replace: bool) -> RunOutcome:
        manifest = data.manifest
        run_id = manifest["run_id"]
        db = self.db
        with db.transaction() as con:
            numbers = query_rows(con, "SELECT run_number FROM runs WHERE run_id = ?", [run_id])
            run_number = (
                numbers[0][0] if numbers else query_value(con, "SELECT coalesce(max(run_number), 0) + 1 FROM runs")
            )
            if replace:
                con.execute("DELETE FROM event_counts WHERE run_number = ?", [run_number])
                for table in ("events", "run_modules", "runs"):
                    con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
            if data.symbols is not None and data.symbols.num_rows:
                db.insert("INSERT INTO symbols BY NAME SELECT * FROM {}", data.symbols)
            run_rows.insert_modules(db, data, run_id)
            if data.frames is not None:
                run_rows.insert_stacks(db, data, run_id)
                site_stacks(db, from_stack=int(data.new_ids[data.new_order].min()))
            run_rows.insert_events(db, data, run_id, run_number)
            stacks_used = query_value(
                con, "SELECT count(DISTINCT stack_id) FROM event_counts WHERE run_number = ?", [run_number]
            )
            run_rows.insert_run(db, data, run_number, stacks_used or 0)
            _before_commit(run_id)
        if data.frames is not None:
            self._count_frames(data.frames.table)
        return RunOutcome(
            data.run_dir,
            "updated" if replace else "ingested",
            run_id=run_id,
            complete=bool(manifest.get("complete")),
            events=data.events,
            new_stacks=len(data.new_order),
            notes=data.notes,
        )

    def _count_frames(self, table: pa.Table) -> None:
        """Adds the new stacks' native frames to the summary: symbolized, or unsymbolized by reason."""
        self.db.register("ingest_new_frames", table)
        try:
            rows = query_rows(
                self.db.con,
                """
                SELECT symbolized, reason_category(coalesce(reason, 'not symbolized')) AS reason, module_key,
                       module, frames
                FROM (
                    SELECT function IS NOT NULL AS symbolized, reason, module_key, any_value(module) AS module,
                           count(*) AS frames
                    FROM ingest_new_frames
                    WHERE kind = 'native' AND chain_depth = 0
                    GROUP BY ALL
                )
                """,
            )
        finally:
            self.db.unregister("ingest_new_frames")
        summary = self.summary
        for symbolized, reason, module_key, module, count in rows:
            if symbolized:
                summary.frames_symbolized += count
                continue
            summary.frames_unsymbolized += count
            group = summary.unsymbolized.setdefault(reason, UnsymbolizedGroup(reason))
            group.frames += count
            group.modules[module_key or "?"] = module or "?"


def _frames_of(lengths: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Indices of the frames of lists `chosen` (in that order), lists laid end to end with `lengths`."""
    lengths = lengths.astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    picked = lengths[chosen]
    within = np.arange(int(picked.sum()), dtype=np.int64) - np.repeat(np.cumsum(picked) - picked, picked)
    return np.repeat(starts[chosen], picked) + within


def _before_commit(run_id: str) -> None:
    """Test seam: the last moment of a run's transaction (tests kill the ingest here)."""
