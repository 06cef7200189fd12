"""Symbols for the ingest: each new (module, address) symbolized once, and old frames redone when
better debug info turns up.

The `symbols` table is the database's copy of the symbol store's answers. For a run's new stacks,
`SymbolLoader.symbols_for` asks the symbolizer only for addresses the table lacks. When the
symbolizer finds better debug info for a module than it had (a `--debug-dir`, a debug package
installed since), the module's stored addresses are symbolized again and every stack using them is
laid out and sited anew, so old runs get better, never worse.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db.connection import query_arrow
from tbpipe.pipeline.db.ingest.debug_info import IngestSymbolizer
from tbpipe.pipeline.db.ingest.frames import store_all_frame_rows
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary
from tbpipe.pipeline.db.ingest.siting import site_stacks
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.stacks import layout
from tbpipe.pipeline.symbols import ModuleRef, Symbolizer
from tbpipe.schemas.modulekey import KeyKind, ModuleKey

# Columns of `symbols`, in the symbolizer's Arrow rows (where the module key is called build_id).
SYMBOLS_COLUMNS = ["module_key", "address", "exact", "depth", "function", "file", "line", "inlined", "reason"]

# {module key: (path, addresses, exact)}: what to symbolize
Requests = dict[str, tuple[str | None, np.ndarray, np.ndarray]]


class SymbolLoader:
    """`symbolizer`: the ingest's, made and closed by the flow (it checks the modules stored without
    DWARF before any stage runs)."""

    def __init__(self, db: IngestDb, options: IngestOptions, summary: IngestSummary, symbolizer: IngestSymbolizer):
        self.db = db
        self.options = options
        self.summary = summary
        self._symbolizing = symbolizer
        self._refreshed: set[str] = set()

    @property
    def symbolizer(self) -> Symbolizer:
        return self._symbolizing.get()

    # ---------------------------------------------------------------- new frames

    def symbols_for(
        self, slots: layout.Slots, first_uses: np.ndarray | None = None
    ) -> tuple[pa.Table, pa.Table | None, pa.Table | None]:
        """(every `symbols` row the slots need, the new ones among them, `modules` rows of the modules
        symbolized); `first_uses`: `layout.distinct_native_slots(slots)` when the caller has it."""
        # Each (module key, address, exact) once, of a module the run describes: the SQL below needs
        # no grouping of its own.
        rows = layout.distinct_native_slots(slots) if first_uses is None else first_uses
        keys = pa.table(
            {
                "module_key": slots.module_key.take(pa.array(rows)),
                "module": slots.module.take(pa.array(rows)),
                "address": pa.array(slots.address[rows], pa.uint64()),
                "exact": pa.array(slots.exact[rows], pa.bool_()),
            }
        )
        con = self.db.con
        self.db.register("ingest_keys", keys)
        try:
            wanted = query_arrow(
                con,
                """
                WITH fresh AS (
                    SELECT n.* FROM ingest_keys n
                    ANTI JOIN (SELECT module_key, address, exact FROM symbols WHERE depth = 0) s
                        ON s.module_key = n.module_key AND s.address = n.address AND s.exact = n.exact
                )
                SELECT module_key, any_value(module) AS path,
                       list(address ORDER BY address, exact) AS addresses, list(exact ORDER BY address, exact) AS exact
                FROM fresh
                GROUP BY module_key
                ORDER BY module_key
                """,
            )
            symbols = statuses = None
            if wanted.num_rows:
                symbols, statuses = self._symbolize(_requests(wanted))
            # Better debug info noticed while symbolizing redoes the stored rows first, so the
            # rows read next are the improved ones.
            self.refresh_upgraded()
            known = query_arrow(
                con,
                """
                SELECT s.* FROM symbols s
                SEMI JOIN ingest_keys k
                    ON s.module_key = k.module_key AND s.address = k.address AND s.exact = k.exact
                """,
            ).select(SYMBOLS_COLUMNS)
        finally:
            self.db.unregister("ingest_keys")
        if symbols is None:
            return known, None, None
        return pa.concat_tables([known, symbols.cast(known.schema)]), symbols, statuses

    def _symbolize(self, requests: Requests) -> tuple[pa.Table, pa.Table]:
        """`symbols` rows for the requests, and the modules' `modules` rows."""

        symbolizer = self.symbolizer
        keys = {text: ModuleKey.parse(text) for text in requests}
        by_build_id = {text: request for text, request in requests.items() if keys[text].kind is KeyKind.BUILD_ID}
        tables = []
        if by_build_id:
            refs = {ModuleRef(k, path): (addresses, exact) for k, (path, addresses, exact) in by_build_id.items()}
            tables.append(_as_symbols_rows(symbolizer.symbolize_arrow(refs, dictionary=False), None))
        for text, (path, addresses, exact) in requests.items():
            if text in by_build_id:
                continue
            # Known by path, or a garbage build-ID: one call each, so rows map back to our key.
            ref = ModuleRef(keys[text].symbolizer_build_id, path)
            rows = symbolizer.symbolize_arrow({ref: (addresses, exact)}, dictionary=False)
            tables.append(_as_symbols_rows(rows, text))
        return pa.concat_tables(tables), self._statuses(requests)

    def _statuses(self, requests: Requests) -> pa.Table:
        columns = ("module_key", "build_id", "path", "quality", "reason", "debug_file", "found_via", "checked_at")
        rows: dict[str, list] = {name: [] for name in columns}
        for text, (path, _addresses, _exact) in requests.items():
            key = ModuleKey.parse(text)
            status = self.symbolizer.module_status(key.symbolizer_build_id, path)
            rows["module_key"].append(text)
            rows["build_id"].append(key.build_id)
            rows["path"].append(path)
            rows["quality"].append(status.quality.value)
            rows["reason"].append(status.reason)
            rows["debug_file"].append(status.debug_file)
            rows["found_via"].append(status.found_via)
            rows["checked_at"].append(float(status.checked_at or time.time()))
        return pa.table(rows, schema=_STATUS_SCHEMA)

    # ---------------------------------------------------------------- better debug info later

    def refresh_improved_modules(self) -> None:
        """Re-checks modules stored without DWARF: debug info may have appeared since (e.g. --debug-dir)."""
        self._symbolizing.check_modules_without_dwarf(self.db.con)
        self.refresh_upgraded()

    def refresh_upgraded(self) -> None:
        """Redoes the stored symbols (and the stacks using them) of modules whose debug info got better."""
        made = self._symbolizing.made
        if made is None:
            return
        upgraded = sorted(set(made.upgraded_build_ids()) - self._refreshed)
        if not upgraded:
            return
        self._refreshed.update(upgraded)
        db = self.db
        db.register("ingest_upgraded", pa.table({"module_key": pa.array(upgraded, pa.string())}))
        try:
            wanted = query_arrow(
                db.con,
                """
                SELECT s.module_key, any_value(m.path) AS path,
                       list(s.address ORDER BY s.address, s.exact) AS addresses,
                       list(s.exact ORDER BY s.address, s.exact) AS exact
                FROM symbols s JOIN modules m USING (module_key)
                WHERE s.depth = 0 AND s.module_key IN (SELECT module_key FROM ingest_upgraded)
                GROUP BY s.module_key
                """,
            )
        finally:
            db.unregister("ingest_upgraded")
        if wanted.num_rows == 0:
            return
        requests = _requests(wanted)
        symbols, statuses = self._symbolize(requests)
        refreshed = pa.table({"module_key": pa.array(list(requests), pa.string())})
        with db.transaction():
            db.register("ingest_refreshed", refreshed)
            try:
                db.delete("DELETE FROM symbols WHERE module_key IN (SELECT module_key FROM ingest_refreshed)")
                db.insert("INSERT INTO symbols BY NAME SELECT * FROM {}", symbols)
                upsert_module_statuses(db, statuses)
                if self._rebuild_stacks_using("ingest_refreshed"):
                    site_stacks(db, from_stack=None)
            finally:
                db.unregister("ingest_refreshed")
        self.summary.refreshed_modules.extend(requests)

    def _rebuild_stacks_using(self, module_keys_view: str) -> bool:
        """Re-expands the inline chains of every stack with a frame in the given modules; False when none has."""
        db = self.db
        slot_rows = query_arrow(
            db.con,
            f"""
            SELECT stack_id, slot, kind, function, file, line, first_line, module, module_key, address, exact, reason,
                   inlined
            FROM stack_frames
            WHERE chain_depth = 0 AND stack_id IN (
                SELECT DISTINCT stack_id FROM stack_frames
                WHERE module_key IN (SELECT module_key FROM {module_keys_view})
            )
            ORDER BY stack_id, slot
            """,
        )
        if slot_rows.num_rows == 0:
            return False
        slots = layout.slots_from_table(slot_rows)
        known, _new, _statuses = self.symbols_for(slots)
        rebuilt = layout.expand(slots, known)
        db.register("ingest_rebuilt", pa.table({"stack_id": pa.array(rebuilt.stack_order, pa.int64())}))
        try:
            db.delete("DELETE FROM stack_frame_rows WHERE stack_id IN (SELECT stack_id FROM ingest_rebuilt)")
            store_all_frame_rows(db, rebuilt)
            db.insert(
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
            db.unregister("ingest_rebuilt")
        return True


_STATUS_SCHEMA = pa.schema(
    [
        ("module_key", pa.string()),
        ("build_id", pa.string()),
        ("path", pa.string()),
        ("quality", pa.string()),
        ("reason", pa.string()),
        ("debug_file", pa.string()),
        ("found_via", pa.string()),
        ("checked_at", pa.float64()),
    ]
)


def upsert_module_statuses(db: IngestDb, statuses: pa.Table) -> None:
    """`modules` rows for modules just symbolized (what debug info was found), replacing older ones."""
    db.insert(
        "INSERT OR REPLACE INTO modules BY NAME "
        "SELECT * EXCLUDE (checked_at), to_timestamp(checked_at) AS checked_at FROM {}",
        statuses,
    )


def _requests(wanted: pa.Table) -> Requests:
    """Rows of (module_key, path, addresses list, exact list) -> {module key: (path, addresses, exact)}."""
    out = {}
    for i in range(wanted.num_rows):
        out[wanted["module_key"][i].as_py()] = (
            wanted["path"][i].as_py(),
            wanted["addresses"][i].values.to_numpy(zero_copy_only=False),
            wanted["exact"][i].values.to_numpy(zero_copy_only=False),
        )
    return out


def _as_symbols_rows(table: pa.Table, key: str | None) -> pa.Table:
    """The symbolizer's Arrow rows shaped as the `symbols` table (module key replaced by `key` if given)."""
    table = table.rename_columns(["module_key" if name == "build_id" else name for name in table.column_names])
    if key is not None:
        index = table.column_names.index("module_key")
        table = table.set_column(index, "module_key", pa.array([key] * table.num_rows, pa.string()))
    return table.select(SYMBOLS_COLUMNS)
