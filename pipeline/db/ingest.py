"""`tbpipe ingest`: run directories into the database, one transaction per run.

For each run directory found: validate it (rawrun: manifest, every part's footer and schema;
a damaged run is quarantined and the others go on), skip it when the database already has it (a
run ingested while incomplete is loaded again once its files changed), hash and flatten its
stacks (prepare), find which stacks and native addresses the database does not know yet,
symbolize those addresses (the symbol store makes each (build-ID, address) cost once ever), lay
out the new stacks' frames (frames), then in one transaction insert the symbols, stacks, frames,
the events (DuckDB reads the events Parquet itself) and the run. A kill at any point leaves the
database as it was before that run's transaction; the ingest lock keeps two ingests apart.

When the symbolizer finds better debug info for a module than the database's frames were made
with, the module's stored addresses are symbolized again and the stacks using them rebuilt, so
old runs get better, never worse.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db import frames as framing
from tbpipe.pipeline.db.connection import (
    DatabaseError,
    ingest_lock,
    open_database,
    query_arrow,
    query_rows,
    query_value,
    resolve_db_path,
)
from tbpipe.pipeline.db.prepare import PreparedRun, prepare_run
from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.rawrun import (
    DamagedRunError,
    check_part,
    find_run_dirs,
    part_files,
    parts_fingerprint,
    read_manifest,
    read_tables,
    reference_problems,
)

DEFAULT_WAIT_S = 600.0
SYMBOLS_COLUMNS = ["build_id", "address", "exact", "depth", "function", "file", "line", "inlined", "reason"]


@dataclass
class IngestOptions:
    db_path: Path | None = None  # None: $TBPIPE_DB or ./tbpipe.duckdb
    debug_dirs: Sequence[Path] = ()
    cache_dir: Path | None = None  # the symbol store; None: $TBPIPE_CACHE_DIR or the user cache dir
    user_code: Sequence[str] = ()  # PREFIX (user code) or !PREFIX (not user code), kept in the database
    wait_s: float = DEFAULT_WAIT_S  # how long to wait for another ingest holding the database
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    jobs: int | None = None  # symbolizer worker processes (None: all CPUs)


@dataclass
class RunOutcome:
    path: Path
    status: str  # 'ingested', 'updated' (an incomplete run loaded again), 'present' or 'quarantined'
    run_id: str | None = None
    complete: bool | None = None
    events: int = 0
    new_stacks: int = 0
    reason: str | None = None  # why it was quarantined
    notes: list[str] = field(default_factory=list)


@dataclass
class UnsymbolizedGroup:
    """Unsymbolized native frames (of the stacks this ingest added) that share a reason."""

    reason: str
    frames: int = 0
    modules: dict[str, str] = field(default_factory=dict)  # build-ID -> path


@dataclass
class IngestSummary:
    db_path: Path
    outcomes: list[RunOutcome] = field(default_factory=list)
    frames_symbolized: int = 0
    frames_unsymbolized: int = 0
    unsymbolized: dict[str, UnsymbolizedGroup] = field(default_factory=dict)
    refreshed_modules: list[str] = field(default_factory=list)  # build-IDs re-symbolized with better debug info
    user_code: list[tuple[str, bool]] = field(default_factory=list)  # rules set by this ingest
    seconds: float = 0.0

    def _count(self, *statuses: str) -> int:
        return sum(1 for o in self.outcomes if o.status in statuses)

    @property
    def ingested(self) -> int:
        return self._count("ingested", "updated")

    @property
    def present(self) -> int:
        return self._count("present")

    @property
    def incomplete(self) -> int:
        return sum(1 for o in self.outcomes if o.status in ("ingested", "updated") and not o.complete)

    @property
    def quarantined(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if o.status == "quarantined"]

    @property
    def events(self) -> int:
        return sum(o.events for o in self.outcomes)

    @property
    def new_stacks(self) -> int:
        return sum(o.new_stacks for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not self.quarantined


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
        loader = _Loader(con, options, summary)
        try:
            summary.user_code = loader.set_user_code(rules)
            loader.refresh_improved_modules()
            with _Progress(options.progress, len(run_dirs)) as progress:
                for run_dir in run_dirs:
                    progress.start(run_dir)
                    outcome = loader.ingest_run(run_dir, progress)
                    summary.outcomes.append(outcome)
                    progress.finish(outcome)
        finally:
            loader.close()
            con.close()
    summary.seconds = time.monotonic() - started
    return summary


def parse_user_code(values: Sequence[str]) -> list[tuple[str, bool]]:
    """`--user-code` values -> (prefix, is_user); '!PREFIX' marks a prefix as not user code."""
    rules = []
    for value in values:
        is_user = not value.startswith("!")
        prefix = value[1:] if not is_user else value
        if not prefix.strip():
            raise UsageError(f"--user-code {value!r}: give a path prefix, e.g. /srv/app/ or mylib/")
        rules.append((prefix, is_user))
    return rules


def _tbpipe_source_dirs() -> list[str]:
    """tbpipe's own package folders here: in an editable install they are not under site-packages."""
    import tbpipe.capture
    import tbpipe.pipeline
    import tbpipe.schemas

    return sorted(
        {str(Path(m.__file__).resolve().parent) + "/" for m in (tbpipe.capture, tbpipe.pipeline, tbpipe.schemas)}
    )


def _sql_text(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class _QuarantineRun(Exception):
    """The run's data cannot be loaded (found while loading, e.g. attributes that are not JSON)."""


@dataclass
class _RunData:
    """One run, read and laid out, ready for its transaction."""

    run_dir: Path
    manifest: dict[str, Any]
    fingerprint: str
    event_files: list[tuple[Path, int]]  # events parts and their row counts, in order
    prepared: PreparedRun
    stack_ids: np.ndarray  # database stack id per distinct raw stack
    new_ids: np.ndarray  # database stack id where this run brings the stack in, else -1
    frames: framing.Frames | None
    problems: pa.Array | None  # per new stack (order of `new_order`)
    new_order: np.ndarray  # distinct raw stack indices of the new stacks, by stack id
    symbols: pa.Table | None  # new `symbols` rows
    statuses: pa.Table | None  # `modules` rows of the modules just symbolized
    notes: list[str]


class _Loader:
    def __init__(self, con: Any, options: IngestOptions, summary: IngestSummary):
        self.con = con
        self.options = options
        self.summary = summary
        self._symbolizer: Any = None
        self._refreshed: set[str] = set()
        # Checkpointing after every run's commit would rewrite the growing tables 40 times for 40
        # runs; the WAL holds the committed runs until the checkpoint that closing the database does.
        con.execute("SET checkpoint_threshold = '4GB'")

    def close(self) -> None:
        if self._symbolizer is not None:
            self._symbolizer.close()

    @property
    def symbolizer(self) -> Any:
        if self._symbolizer is None:
            from tbpipe.pipeline.symbols import Symbolizer

            self._symbolizer = Symbolizer(
                cache_dir=self.options.cache_dir,
                debug_dirs=list(self.options.debug_dirs),
                jobs=self.options.jobs,
                progress=False,
            )
        return self._symbolizer

    def _register(self, name: str, table: pa.Table) -> None:
        self.con.register(name, table)

    def _unregister(self, name: str) -> None:
        # Inside a failed transaction DuckDB refuses even this; the name is registered anew
        # (replacing the view) the next time it is used, so leaving it is harmless.
        try:
            self.con.unregister(name)
        except _duckdb_error():
            pass

    def _transaction(self):
        return _Transaction(self.con)

    # ---------------------------------------------------------------- settings

    def set_user_code(self, rules: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """Stores the rules; when what is user code changed (here or by hand), every stack is sited again."""
        with self._transaction() as con:
            for prefix in _tbpipe_source_dirs():
                con.execute("INSERT INTO user_code VALUES (?, false, 'tbpipe', now()) ON CONFLICT DO NOTHING", [prefix])
            for prefix, is_user in rules:
                con.execute("INSERT OR REPLACE INTO user_code VALUES (?, ?, 'user', now())", [prefix, is_user])
            rules_hash = query_value(
                con,
                "SELECT md5(coalesce(string_agg(prefix || '=' || is_user, chr(30) ORDER BY prefix), '')) FROM user_code",
            )
            sited_with = query_value(con, "SELECT value FROM settings WHERE key = 'sited_with_rules'")
            if sited_with != rules_hash:
                self._site_stacks(from_stack=None)
                con.execute("INSERT OR REPLACE INTO settings VALUES ('sited_with_rules', ?)", [rules_hash])
        return rules

    def _site_stacks(self, from_stack: int | None) -> None:
        """Fills `stack_sites` (and `sites`) for stacks >= from_stack; None: all stacks, anew."""
        con = self.con
        if from_stack is None:
            con.execute("DELETE FROM stack_sites")
            con.execute("DELETE FROM sites")
        con.execute("CREATE OR REPLACE TEMP TABLE ingest_sites AS SELECT * FROM stack_sites_from(?)", [from_stack or 0])
        try:
            con.execute(
                """
                INSERT INTO sites
                SELECT (SELECT coalesce(max(site_id), 0) FROM sites) + row_number() OVER (ORDER BY site_key),
                       site_key, site_function, site_file, site_line
                FROM (
                    SELECT site_key, any_value(site_function) AS site_function, any_value(site_file) AS site_file,
                           any_value(site_line) AS site_line
                    FROM ingest_sites
                    WHERE site_key IS NOT NULL AND site_key NOT IN (SELECT site_key FROM sites)
                    GROUP BY site_key
                )
                """
            )
            con.execute(
                """
                INSERT INTO stack_sites
                SELECT i.stack_id, t.site_id, i.site_depth, i.site_kind, i.site_is_user
                FROM ingest_sites i LEFT JOIN sites t USING (site_key)
                """
            )
        finally:
            con.execute("DROP TABLE IF EXISTS temp.ingest_sites")

    # ---------------------------------------------------------------- one run

    def ingest_run(self, run_dir: Path, progress: _Progress) -> RunOutcome:
        try:
            manifest = read_manifest(run_dir)
            fingerprint = parts_fingerprint(run_dir, manifest)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", reason=str(error))
        run_id = manifest["run_id"]
        rows = query_rows(self.con, "SELECT complete, parts FROM runs WHERE run_id = ?", [run_id])
        existing = rows[0] if rows else None
        if existing is not None and (existing[0] or existing[1] == fingerprint):
            return RunOutcome(run_dir, "present", run_id=run_id, complete=existing[0])
        try:
            data = self._read(run_dir, manifest, fingerprint, progress)
            progress.describe(f"loading {sum(n for _p, n in data.event_files):,} events")
            return self._load(data, replace=existing is not None)
        except DamagedRunError as error:
            return RunOutcome(run_dir, "quarantined", run_id=run_id, reason=str(error))
        except _QuarantineRun as error:
            return RunOutcome(run_dir, "quarantined", run_id=run_id, reason=f"{run_dir}: {error}")

    def _read(self, run_dir: Path, manifest: dict[str, Any], fingerprint: str, progress: _Progress) -> _RunData:
        files = part_files(run_dir, manifest)
        event_files = [(path, check_part(path, "events")) for path in files["events"]]
        tables = read_tables(files, ("stacks", "modules", "code"))
        notes = reference_problems(tables)
        progress.describe(f"hashing {tables['stacks'].num_rows:,} stacks")
        prepared = prepare_run(tables, self.con)
        stack_ids, new_ids = self._stack_ids(prepared)
        dangling = self._dangling_events(event_files, prepared, stack_ids)
        if dangling:
            notes.append(f"{dangling} events refer to stacks the run does not hold: their stack is NULL")
        if notes and manifest.get("complete"):
            raise DamagedRunError(f"{run_dir}: {'; '.join(notes)}")

        new_order = np.flatnonzero(new_ids >= 0)
        new_order = new_order[np.argsort(new_ids[new_order], kind="stable")]
        frames = problems = symbols = statuses = None
        if len(new_order):
            slots, shapes = self._slots(prepared, new_ids, new_order)
            progress.describe(f"symbolizing the frames of {len(new_order):,} new stacks")
            known, symbols, statuses = self._symbols_for(slots)
            frames = framing.expand(slots, known)
            problems = shapes.problem
        return _RunData(
            run_dir,
            manifest,
            fingerprint,
            event_files,
            prepared,
            stack_ids,
            new_ids,
            frames,
            problems,
            new_order,
            symbols,
            statuses,
            notes,
        )

    def _stack_ids(self, prepared: PreparedRun) -> tuple[np.ndarray, np.ndarray]:
        """Per distinct raw stack: its database stack_id, and the id again where this run brings it in (else -1)."""
        con = self.con
        hashes, first, inverse = np.unique(prepared.hashes, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
        self._register("ingest_hashes", pa.table({"stack_hash": pa.array(hashes, pa.uint64())}))
        try:
            known = query_arrow(
                con,
                "SELECT stack_hash, stack_id FROM stacks WHERE stack_hash IN (SELECT stack_hash FROM ingest_hashes)",
            )
        finally:
            self._unregister("ingest_hashes")
        ids = np.full(len(hashes), -1, dtype=np.int64)
        if known.num_rows:
            ids[np.searchsorted(hashes, known["stack_hash"].to_numpy())] = known["stack_id"].to_numpy()
        missing = np.flatnonzero(ids < 0)
        # New ids follow the order the raw stacks come in, so each run's frames are stored by stack id.
        missing = missing[np.argsort(first[missing], kind="stable")]
        base = query_value(con, "SELECT coalesce(max(stack_id), 0) + 1 FROM stacks")
        ids[missing] = base + np.arange(len(missing), dtype=np.int64)
        new = np.full(len(prepared.hashes), -1, dtype=np.int64)
        # One raw stack stands for each new hash (two raw stacks of a run may mean the same stack).
        new[first[missing]] = ids[missing]
        return ids[inverse], new

    def _stack_map(self, prepared: PreparedRun, stack_ids: np.ndarray) -> pa.Table:
        return pa.table(
            {"raw_id": pa.array(prepared.raw_ids, pa.uint64()), "stack_id": pa.array(stack_ids, pa.int64())}
        )

    def _dangling_events(
        self, event_files: list[tuple[Path, int]], prepared: PreparedRun, stack_ids: np.ndarray
    ) -> int:
        """Events whose stack the run does not hold (a killed process flushed the events, not the stack)."""
        if not event_files:
            return 0
        self._register("ingest_stack_map", self._stack_map(prepared, stack_ids))
        try:
            return int(
                query_value(
                    self.con,
                    f"""
                    SELECT count(*) FROM read_parquet({_file_list(event_files)}) e
                    WHERE e.stack_id IS NOT NULL
                      AND e.stack_id NOT IN (SELECT raw_id FROM ingest_stack_map)
                    """,
                )
                or 0
            )
        except _duckdb_error() as error:
            raise DamagedRunError(f"{event_files[0][0].parent}: events unreadable ({_first_line(error)})") from None
        finally:
            self._unregister("ingest_stack_map")

    def _slots(self, prepared: PreparedRun, new_ids: np.ndarray, new_order: np.ndarray):
        """Slots of the new stacks (by stack id)."""
        native, python = prepared.native, prepared.python
        native_rows = _frames_of(prepared.native_lengths, new_order)
        python_rows = _frames_of(prepared.python_lengths, new_order)
        return framing.combined_slots(
            stack_ids=new_ids[new_order],
            status=prepared.status[new_order],
            native_lengths=prepared.native_lengths[new_order],
            python_lengths=prepared.python_lengths[new_order],
            native_ref=native.ref[native_rows],
            native_address=native.value[native_rows],
            native_flags=native.flags[native_rows],
            python_ref=python.ref[python_rows],
            python_line=python.value[python_rows],
            python_flags=python.flags[python_rows],
            modules=prepared.modules,
            code=prepared.code,
        )

    # ---------------------------------------------------------------- symbols

    def _symbols_for(self, slots: framing.Slots) -> tuple[pa.Table, pa.Table | None, pa.Table | None]:
        """(every `symbols` row the slots need, the new ones among them, `modules` rows of the modules symbolized)."""
        native = slots.kind == framing.NATIVE
        keys = pa.table(
            {
                "build_id": slots.build_id.filter(pa.array(native)),
                "module": slots.module.filter(pa.array(native)),
                "address": pa.array(slots.address[native], pa.uint64()),
                "exact": pa.array(slots.exact[native], pa.bool_()),
            }
        )
        con = self.con
        self._register("ingest_keys", keys)
        try:
            wanted = query_arrow(
                con,
                """
                WITH needed AS (
                    SELECT build_id, address, exact, any_value(module) AS module
                    FROM ingest_keys WHERE build_id IS NOT NULL
                    GROUP BY build_id, address, exact
                ), fresh AS (
                    SELECT n.* FROM needed n
                    ANTI JOIN (SELECT build_id, address, exact FROM symbols WHERE depth = 0) s
                        ON s.build_id = n.build_id AND s.address = n.address AND s.exact = n.exact
                )
                SELECT build_id, any_value(module) AS path,
                       list(address ORDER BY address, exact) AS addresses, list(exact ORDER BY address, exact) AS exact
                FROM fresh
                GROUP BY build_id
                ORDER BY build_id
                """,
            )
            symbols = statuses = None
            if wanted.num_rows:
                symbols, statuses = self._symbolize(_requests(wanted))
            # Better debug info noticed while symbolizing redoes the stored rows first, so the
            # rows read next are the improved ones.
            self._refresh_upgraded()
            known = query_arrow(
                con,
                """
                SELECT s.* FROM symbols s
                SEMI JOIN (SELECT DISTINCT build_id, address, exact FROM ingest_keys WHERE build_id IS NOT NULL) k
                    ON s.build_id = k.build_id AND s.address = k.address AND s.exact = k.exact
                """,
            ).select(SYMBOLS_COLUMNS)
        finally:
            self._unregister("ingest_keys")
        if symbols is None:
            return known, None, None
        return pa.concat_tables([known, symbols.cast(known.schema)]), symbols, statuses

    def _symbolize(self, requests: dict[str, tuple[str | None, np.ndarray, np.ndarray]]) -> tuple[pa.Table, pa.Table]:
        """`symbols` rows for {module key: (path, addresses, exact)}, and the modules' `modules` rows."""
        from tbpipe.pipeline.symbols import ModuleRef

        symbolizer = self.symbolizer
        plain = {k: v for k, v in requests.items() if not k.startswith(("path:", "invalid:"))}
        tables = []
        if plain:
            refs = {ModuleRef(k, path): (addresses, exact) for k, (path, addresses, exact) in plain.items()}
            tables.append(_as_symbols_rows(symbolizer.symbolize_arrow(refs, dictionary=False), None))
        for key, (path, addresses, exact) in requests.items():
            if key in plain:
                continue
            # Keyed by path, or a garbage build-ID: one call each, so rows map back to our key.
            ref = ModuleRef(_symbolizer_build_id(key), path)
            tables.append(
                _as_symbols_rows(symbolizer.symbolize_arrow({ref: (addresses, exact)}, dictionary=False), key)
            )
        return pa.concat_tables(tables), self._statuses(requests)

    def _statuses(self, requests: dict[str, tuple[str | None, Any, Any]]) -> pa.Table:
        rows: dict[str, list] = {
            k: [] for k in ("build_id", "path", "quality", "reason", "debug_file", "found_via", "checked_at")
        }
        for key, (path, _addresses, _exact) in requests.items():
            status = self.symbolizer.module_status(_symbolizer_build_id(key), path)
            rows["build_id"].append(key)
            rows["path"].append(path)
            rows["quality"].append(status.quality.value)
            rows["reason"].append(status.reason)
            rows["debug_file"].append(status.debug_file)
            rows["found_via"].append(status.found_via)
            rows["checked_at"].append(float(status.checked_at or time.time()))
        return pa.table(rows)

    # ---------------------------------------------------------------- the transaction

    def _load(self, data: _RunData, replace: bool) -> RunOutcome:
        manifest = data.manifest
        run_id = manifest["run_id"]
        prepared = data.prepared
        events_total = sum(rows for _path, rows in data.event_files)
        new_stacks = len(data.new_order)
        with self._transaction() as con:
            numbers = query_rows(con, "SELECT run_number FROM runs WHERE run_id = ?", [run_id])
            run_number = (
                numbers[0][0] if numbers else query_value(con, "SELECT coalesce(max(run_number), 0) + 1 FROM runs")
            )
            if replace:
                con.execute("DELETE FROM event_counts WHERE run_number = ?", [run_number])
                for table in ("events", "run_modules", "runs"):
                    con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
            if data.symbols is not None and data.symbols.num_rows:
                self._insert("INSERT INTO symbols SELECT * FROM {}", data.symbols)
            self._upsert_modules(prepared.modules, data.statuses, run_id)
            if data.frames is not None:
                self._insert_stacks(data, run_id)
                self._site_stacks(from_stack=int(data.new_ids[data.new_order].min()))
            self._insert_events(data, run_id, run_number)
            stacks_used = query_value(
                con, "SELECT count(DISTINCT stack_id) FROM event_counts WHERE run_number = ?", [run_number]
            )
            self._insert_run(data, run_number, events_total, stacks_used or 0, new_stacks)
            _before_commit(run_id)
        if data.frames is not None:
            self._count_frames(data.frames.table)
        return RunOutcome(
            data.run_dir,
            "updated" if replace else "ingested",
            run_id=run_id,
            complete=bool(manifest.get("complete")),
            events=events_total,
            new_stacks=new_stacks,
            notes=data.notes,
        )

    def _insert(self, sql: str, table: pa.Table) -> None:
        self._register("ingest_rows", table)
        try:
            self.con.execute(sql.format("ingest_rows"))
        finally:
            self._unregister("ingest_rows")

    def _upsert_modules(self, modules: pa.Table, statuses: pa.Table | None, run_id: str) -> None:
        if statuses is not None and statuses.num_rows:
            self._insert(
                "INSERT OR REPLACE INTO modules SELECT build_id, path, quality, reason, debug_file, found_via, "
                "to_timestamp(checked_at) FROM {}",
                statuses,
            )
        self._insert(
            f"INSERT INTO run_modules SELECT {_sql_text(run_id)}, module_index, build_id, path, load_bias, exec_ranges FROM {{}}",
            modules,
        )
        # Every module a run loaded has a row, even one none of whose addresses needed symbols yet.
        self.con.execute(
            """
            INSERT INTO modules
            SELECT build_id, any_value(path), NULL, NULL, NULL, NULL, NULL
            FROM run_modules r
            WHERE run_id = ? AND NOT EXISTS (SELECT 1 FROM modules m WHERE m.build_id = r.build_id)
            GROUP BY build_id
            """,
            [run_id],
        )

    def _insert_stacks(self, data: _RunData, run_id: str) -> None:
        prepared, order, frames = data.prepared, data.new_order, data.frames
        ids = data.new_ids[order]
        counts = np.zeros(len(order), dtype=np.int64)
        symbolized_depth = np.full(len(order), -1, dtype=np.int32)
        position = np.searchsorted(ids, frames.stack_order)
        counts[position] = frames.per_stack_frames
        symbolized_depth[position] = frames.symbolized_depth
        stacks = pa.table(
            {
                "stack_id": pa.array(ids, pa.int64()),
                "stack_hash": pa.array(prepared.hashes[order], pa.uint64()),
                "status": pa.array(prepared.status[order], pa.uint32()),
                "native_frames": pa.array(prepared.native_lengths[order], pa.int32()),
                "python_frames": pa.array(prepared.python_lengths[order], pa.int32()),
                "frames": pa.array(counts, pa.int32()),
                "problem": data.problems,
                "symbolized_depth": pa.array(symbolized_depth, pa.int32(), mask=symbolized_depth < 0),
            }
        )
        self._insert(f"INSERT INTO stacks SELECT *, {_sql_text(run_id)} FROM {{}}", stacks)
        self._insert("INSERT INTO stack_frames SELECT * FROM {}", frames.table)

    def _insert_events(self, data: _RunData, run_id: str, run_number: int) -> None:
        """Events straight from the run's Parquet (DuckDB reads it faster than a detour through Arrow)."""
        con = self.con
        if not data.event_files:
            return
        self._register("ingest_stack_map", self._stack_map(data.prepared, data.stack_ids))
        try:
            first = int(query_value(con, "SELECT coalesce(max(event_id), 0) + 1 FROM events"))
            # One statement per part: event ids follow the parts' order and their rows' order.
            for path, rows in data.event_files:
                con.execute(
                    f"""
                    INSERT INTO events
                    SELECT {first} + e.file_row_number, {_sql_text(run_id)}, e.ts, e.thread_id,
                           e.kind, e.name, m.stack_id, e.attrs
                    FROM read_parquet({_sql_text(str(path))}, file_row_number = true) e
                    LEFT JOIN ingest_stack_map m ON m.raw_id = e.stack_id
                    """
                )
                first += rows
            con.execute(
                """
                INSERT INTO event_names
                SELECT (SELECT coalesce(max(name_id), 0) FROM event_names) + row_number() OVER (ORDER BY kind, name),
                       kind, name
                FROM (SELECT DISTINCT kind, name FROM events WHERE run_id = ?) e
                ANTI JOIN event_names n USING (kind, name)
                """,
                [run_id],
            )
            con.execute(
                """
                INSERT INTO event_counts
                SELECT ?, n.name_id, e.stack_id, count(*)
                FROM events e JOIN event_names n USING (kind, name)
                WHERE e.run_id = ?
                GROUP BY n.name_id, e.stack_id
                """,
                [run_number, run_id],
            )
        finally:
            self._unregister("ingest_stack_map")

    def _insert_run(self, data: _RunData, run_number: int, events: int, stacks: int, new_stacks: int) -> None:
        m = data.manifest
        labels = m.get("labels") or {}
        threads = m.get("threads") or {}
        counters = m.get("counters") or {}
        self.con.execute(
            """
            INSERT INTO runs VALUES (
                ?, ?, ?, CAST(? AS TIMESTAMPTZ), CAST(? AS TIMESTAMPTZ), ?, ?, ?, CAST(? AS VARCHAR[]), ?,
                map(CAST(? AS VARCHAR[]), CAST(? AS VARCHAR[])), ?, ?, ?, ?, CAST(? AS VARCHAR[]), CAST(? AS JSON),
                map(CAST(? AS BIGINT[]), CAST(? AS VARCHAR[])), ?, ?, ?, ?, ?, CAST(? AS VARCHAR[]),
                CAST(? AS VARCHAR[]), ?, ?, now(), CAST(? AS JSON)
            )
            """,
            [
                m["run_id"],
                run_number,
                m.get("parent_run_id"),
                m.get("started_at"),
                m.get("ended_at"),
                bool(m.get("complete")),
                m.get("host"),
                m.get("pid"),
                list(m.get("argv") or []),
                m.get("cwd"),
                list(labels.keys()),
                list(labels.values()),
                m.get("python_version"),
                m.get("python_implementation"),
                m.get("torch_version"),
                m.get("tbpipe_version"),
                list(m.get("sources") or []),
                json.dumps(m.get("capture") or {}),
                [int(k) for k in threads.keys()],
                list(threads.values()),
                counters.get("events_recorded"),
                counters.get("events_dropped"),
                events,
                stacks,
                new_stacks,
                list(m.get("errors") or []),
                data.notes,
                str(data.run_dir.resolve()),
                data.fingerprint,
                json.dumps(m),
            ],
        )

    def _count_frames(self, table: pa.Table) -> None:
        self._register("ingest_new_frames", table)
        try:
            rows = query_rows(
                self.con,
                """
                SELECT symbolized, reason_category(coalesce(reason, 'not symbolized')) AS reason, build_id, module, frames
                FROM (
                    SELECT function IS NOT NULL AS symbolized, reason, build_id, any_value(module) AS module,
                           count(*) AS frames
                    FROM ingest_new_frames
                    WHERE kind = 'native' AND chain_depth = 0
                    GROUP BY ALL
                )
                """,
            )
        finally:
            self._unregister("ingest_new_frames")
        summary = self.summary
        for symbolized, reason, build_id, module, count in rows:
            if symbolized:
                summary.frames_symbolized += count
                continue
            summary.frames_unsymbolized += count
            group = summary.unsymbolized.setdefault(reason, UnsymbolizedGroup(reason))
            group.frames += count
            group.modules[build_id or "?"] = module or "?"

    # ---------------------------------------------------------------- better debug info later

    def refresh_improved_modules(self) -> None:
        """Re-checks modules stored without DWARF: debug info may have appeared since (e.g. --debug-dir)."""
        rows = query_rows(
            self.con,
            "SELECT build_id, path FROM modules WHERE quality IS NOT NULL AND quality <> 'dwarf' "
            "AND NOT starts_with(build_id, 'invalid:')",
        )
        if not rows:
            return
        for build_id, path in rows:
            self.symbolizer.module_status(_symbolizer_build_id(build_id), path)
        self._refresh_upgraded()

    def _refresh_upgraded(self) -> None:
        if self._symbolizer is None:
            return
        upgraded = sorted(set(self._symbolizer.upgraded_build_ids()) - self._refreshed)
        if not upgraded:
            return
        self._refreshed.update(upgraded)
        con = self.con
        self._register("ingest_upgraded", pa.table({"build_id": pa.array(upgraded, pa.string())}))
        try:
            wanted = query_arrow(
                con,
                """
                SELECT s.build_id, any_value(m.path) AS path,
                       list(s.address ORDER BY s.address, s.exact) AS addresses,
                       list(s.exact ORDER BY s.address, s.exact) AS exact
                FROM symbols s JOIN modules m USING (build_id)
                WHERE s.depth = 0 AND s.build_id IN (SELECT build_id FROM ingest_upgraded)
                GROUP BY s.build_id
                """,
            )
        finally:
            self._unregister("ingest_upgraded")
        if wanted.num_rows == 0:
            return
        requests = _requests(wanted)
        symbols, statuses = self._symbolize(requests)
        refreshed = pa.table({"build_id": pa.array(list(requests), pa.string())})
        with self._transaction() as con:
            self._register("ingest_refreshed", refreshed)
            try:
                con.execute("DELETE FROM symbols WHERE build_id IN (SELECT build_id FROM ingest_refreshed)")
                self._insert("INSERT INTO symbols SELECT * FROM {}", symbols)
                self._insert(
                    "INSERT OR REPLACE INTO modules SELECT build_id, path, quality, reason, debug_file, found_via, "
                    "to_timestamp(checked_at) FROM {}",
                    statuses,
                )
                if self._rebuild_stacks_using("ingest_refreshed"):
                    self._site_stacks(from_stack=None)
            finally:
                self._unregister("ingest_refreshed")
        self.summary.refreshed_modules.extend(requests)

    def _rebuild_stacks_using(self, build_ids_view: str) -> bool:
        """Re-expands the inline chains of every stack with a frame in the given modules; False when none has."""
        con = self.con
        slot_rows = query_arrow(
            con,
            f"""
            SELECT stack_id, slot, kind, function, file, line, module, build_id, address, exact, reason
            FROM stack_frames
            WHERE chain_depth = 0 AND stack_id IN (
                SELECT DISTINCT stack_id FROM stack_frames WHERE build_id IN (SELECT build_id FROM {build_ids_view})
            )
            ORDER BY stack_id, slot
            """,
        )
        if slot_rows.num_rows == 0:
            return False
        slots = framing.slots_from_table(slot_rows)
        known, _new, _statuses = self._symbols_for(slots)
        rebuilt = framing.expand(slots, known)
        self._register("ingest_rebuilt", pa.table({"stack_id": pa.array(rebuilt.stack_order, pa.int64())}))
        try:
            con.execute("DELETE FROM stack_frames WHERE stack_id IN (SELECT stack_id FROM ingest_rebuilt)")
            self._insert("INSERT INTO stack_frames SELECT * FROM {}", rebuilt.table)
            self._insert(
                """
                UPDATE stacks SET frames = r.frames, symbolized_depth = r.symbolized_depth
                FROM {} r WHERE stacks.stack_id = r.stack_id
                """,
                pa.table(
                    {
                        "stack_id": pa.array(rebuilt.stack_order, pa.int64()),
                        "frames": pa.array(rebuilt.per_stack_frames, pa.int32()),
                        "symbolized_depth": pa.array(
                            rebuilt.symbolized_depth, pa.int32(), mask=rebuilt.symbolized_depth < 0
                        ),
                    }
                ),
            )
        finally:
            self._unregister("ingest_rebuilt")
        return True


class _Transaction:
    """BEGIN ... COMMIT, or ROLLBACK on any exception (data errors quarantine the run)."""

    def __init__(self, con: Any):
        self.con = con

    def __enter__(self) -> Any:
        self.con.execute("BEGIN TRANSACTION")
        return self.con

    def __exit__(self, kind, error, _traceback) -> None:
        if error is None:
            self.con.execute("COMMIT")
            return
        self.con.execute("ROLLBACK")
        _raise_for_data_error(error)


def _frames_of(lengths: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Indices of the frames of lists `chosen` (in that order), lists laid end to end with `lengths`."""
    lengths = lengths.astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    picked = lengths[chosen]
    within = np.arange(int(picked.sum()), dtype=np.int64) - np.repeat(np.cumsum(picked) - picked, picked)
    return np.repeat(starts[chosen], picked) + within


def _requests(wanted: pa.Table) -> dict[str, tuple[str | None, np.ndarray, np.ndarray]]:
    """Rows of (build_id, path, addresses list, exact list) -> {build_id: (path, addresses, exact)}."""
    out = {}
    for i in range(wanted.num_rows):
        out[wanted["build_id"][i].as_py()] = (
            wanted["path"][i].as_py(),
            wanted["addresses"][i].values.to_numpy(zero_copy_only=False),
            wanted["exact"][i].values.to_numpy(zero_copy_only=False),
        )
    return out


def _symbolizer_build_id(key: str) -> str:
    """Our module key -> what the symbolizer takes as build-ID ('' for a module known by path only)."""
    if key.startswith("path:"):
        return ""
    if key.startswith("invalid:"):
        return key[len("invalid:") :]
    return key


def _as_symbols_rows(table: pa.Table, key: str | None) -> pa.Table:
    """The symbolizer's Arrow rows shaped as the `symbols` table (build_id replaced by our key if given)."""
    if key is not None:
        table = table.set_column(0, "build_id", pa.array([key] * table.num_rows, pa.string()))
    return table.select(SYMBOLS_COLUMNS)


def _file_list(files: list[tuple[Path, int]]) -> str:
    return "[" + ", ".join(_sql_text(str(path)) for path, _rows in files) + "]"


def _duckdb_error() -> type:
    import duckdb

    return duckdb.Error


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _raise_for_data_error(error: BaseException) -> None:
    """Errors that come from the run's data (not the database) quarantine the run."""
    import duckdb

    text = _first_line(error)
    if isinstance(error, (duckdb.ConversionException, duckdb.InvalidInputException)) and "JSON" in text:
        raise _QuarantineRun(f"events have attributes that are not JSON ({text})") from None
    if isinstance(error, (duckdb.IOException, duckdb.InvalidInputException)) and ".parquet" in str(error).lower():
        raise _QuarantineRun(f"events unreadable ({text})") from None
    if isinstance(error, (duckdb.ConversionException, duckdb.InvalidInputException)):
        raise _QuarantineRun(f"cannot load the run's data ({text})") from None
    if isinstance(error, duckdb.Error):
        raise DatabaseError(f"the database failed while loading a run: {text}") from None


def _before_commit(run_id: str) -> None:
    """Test seam: the last moment of a run's transaction (tests kill the ingest here)."""


# ------------------------------------------------------------------------------------------ progress


class _Progress:
    """A rich progress bar over runs (stderr), shown when stderr is a terminal or when asked to."""

    def __init__(self, enabled: bool | None, total: int):
        self.enabled = (sys.stderr.isatty() if enabled is None else enabled) and total > 0
        self.total = total
        self._progress: Any = None
        self._task: Any = None
        self._events = 0

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]ingest[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("runs · {task.fields[events]} events · {task.fields[doing]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("ingest", total=self.total, events="0", doing="")
        return self

    def start(self, run_dir: Path) -> None:
        self.describe(f"reading {run_dir.name}")

    def describe(self, doing: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, doing=doing)

    def finish(self, outcome: RunOutcome) -> None:
        self._events += outcome.events
        if self._progress is not None:
            self._progress.update(self._task, advance=1, events=f"{self._events:,}", doing="")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
