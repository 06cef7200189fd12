"""Which Python files are user code, the call site of every stack, and what names a site.

The rules live in the `user_code` table (`--user-code PREFIX` / `!PREFIX`, plus tbpipe's own
source folders) and the `generated_code` table. The siting rule, a stack's call site under them
(its innermost user frame, else its innermost symbolized frame that is neither generated code nor
the recording machinery of `stacks.focus`, else its innermost symbolized frame that is not
generated code):

- Reference: `stack_sites_from` (sql/call_sites.sql), called with the machinery's patterns by
  `reference_sites`. `site_stacks` applies it to every stack when the rules change; the lake's
  Spark job applies it too, in an in-memory DuckDB.
- Fast path: `sites_of_laid_out`, numpy over a batch's freshly laid-out frames: the ingest sites
  new stacks with it without scanning the stored frames.

tests/test_rules.py holds the fast path to the reference on random stacks and rules. The answer is
stored in `sites` / `stack_sites` for the views to read; events are counted per site by
`site_counts` (its own rule and module).

A site's key must not change when the same code runs from another checkout folder, so each Python
file is also named relative to the import root that held it (`source_files`): the run's sys.path
entries and working folder, the longest that contains the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_arrow, query_rows, query_value
from tbpipe.pipeline.db.ingest.pending import site_identity_backfilled
from tbpipe.pipeline.db.ingest.site_counts import count_sites
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.db.ingest.user_code import (  # noqa: F401 - parse_user_code: the lake's job takes it from here
    parse_user_code,
    rules_hash,
    sited_with,
    tbpipe_source_dirs,
)
from tbpipe.pipeline.stacks import focus


def store_user_code(db: IngestDb, rules: list[tuple[str, bool]]) -> None:
    """Stores the rules; when what is user code changed (here or by hand), every stack is sited again."""
    with db.transaction() as con:
        for prefix in tbpipe_source_dirs():
            con.execute("INSERT INTO user_code VALUES (?, false, 'tbpipe', now()) ON CONFLICT DO NOTHING", [prefix])
        for prefix, is_user in rules:
            con.execute("INSERT OR REPLACE INTO user_code VALUES (?, ?, 'user', now())", [prefix, is_user])
        stored_hash = rules_hash(con)
        if sited_with(con) != stored_hash:
            site_stacks(db, from_stack=None)
            con.execute("INSERT OR REPLACE INTO settings VALUES ('sited_with_rules', ?)", [stored_hash])


def generated_code_rows(manifests: Sequence[dict[str, Any]]) -> dict[str, tuple[str, str | None]]:
    """{prefix: (generator, first run id)} of the folders of generated code the manifests name, the
    first manifest naming a folder giving its row."""
    rows: dict[str, tuple[str, str | None]] = {}
    for manifest in manifests:
        for generator, folder in (manifest.get("generated_code") or {}).items():
            if isinstance(folder, str) and folder.startswith("/") and folder.rstrip("/"):
                rows.setdefault(folder.rstrip("/") + "/", (str(generator), manifest.get("run_id")))
    return rows


def store_generated_code(db: IngestDb, manifests: Sequence[dict[str, Any]]) -> None:
    """`generated_code` rows for the folders of generated code that the runs' manifests name; when a
    new one holds Python files or modules of stored stacks, every stack is sited again."""
    rows = generated_code_rows(manifests)
    if not rows:
        return
    with db.transaction() as con:
        known = {
            prefix
            for (prefix,) in query_rows(
                con, "SELECT prefix FROM generated_code WHERE list_contains(?, prefix)", [list(rows)]
            )
        }
        new = {prefix: value for prefix, value in rows.items() if prefix not in known}
        if not new:
            return
        for prefix, (generator, run_id) in new.items():
            con.execute(
                "INSERT INTO generated_code VALUES (?, ?, ?) ON CONFLICT DO NOTHING", [prefix, generator, run_id]
            )
        stored = query_value(
            con,
            """
            SELECT EXISTS (SELECT 1 FROM source_files s, unnest(?) AS t(p) WHERE starts_with(s.file, t.p))
                OR EXISTS (SELECT 1 FROM modules m, unnest(?) AS t(p) WHERE starts_with(m.path, t.p))
            """,
            [list(new), list(new)],
        )
        if stored:
            site_stacks(db, from_stack=None)


def reference_sites(con: Any, first_stack_id: int) -> pa.Table:
    """`stack_sites_from`'s rows for stacks >= first_stack_id, by stack, with the recording
    machinery's patterns of `stacks.focus` (the one home of which frames those are)."""
    return query_arrow(
        con,
        "SELECT * FROM stack_sites_from(?, ?, ?) ORDER BY stack_id",
        [first_stack_id, focus.RECORDING_FUNCTION.pattern, focus.RECORDING_MODULE.pattern],
    )


def site_stacks(db: IngestDb, from_stack: int | None) -> None:
    """Fills `stack_sites` (and `sites`) for stacks >= from_stack; None: all stacks, anew."""
    if from_stack is None:
        db.delete("DELETE FROM stack_sites")
        db.delete("DELETE FROM sites")
    sites = reference_sites(db.con, from_stack or 0)
    stack_sites, new_sites = number_sites(db, sites, np.zeros(sites.num_rows, dtype=np.int64))
    insert_sites(db, new_sites.drop_columns(["site_order"]), stack_sites)
    if from_stack is None:
        db.delete("DELETE FROM site_counts")
        count_sites(db, None)


def sites_of_laid_out(db: IngestDb, frames: Any, stack_ids: np.ndarray, portable: dict[str, str]) -> pa.Table:
    """The fast path: `stack_sites_from`'s answer for freshly laid-out stacks (`layout.Frames`),
    computed from their frames in memory.

    The innermost Python frame of a user file (a '<string>' frame inside generated code only when
    its caller is user code), else the innermost symbolized frame that is neither generated code
    nor recording machinery, else the innermost symbolized frame that is not generated code; the
    key by `site_identity_key`. Only the distinct files and modules are classified and the distinct
    site frames keyed in DuckDB, so a batch of small runs is sited without scanning the stored
    frames. `stack_ids` are the stacks to site (increasing; a stack without frames has no site),
    `portable` names the frames' Python files.
    """
    rows, table = frames.rows, frames.frames
    frame_of_row = rows["frame"].to_numpy()
    row_stack = rows["stack_id"].to_numpy()
    row_depth = rows["depth"].to_numpy()
    kind = _FrameKinds.of(db, table)
    stacks = np.asarray(stack_ids, dtype=np.int64)
    user_row = kind.user[frame_of_row] if len(frame_of_row) else np.zeros(0, bool)
    if len(frame_of_row) and kind.anonymous.any():
        user_row = user_row & ~_lent_rows(frame_of_row, row_stack, row_depth, kind)
    user_depth = _first_depth_per_stack(stacks, row_stack, row_depth, np.flatnonzero(user_row))
    fallback = kind.symbolized & ~kind.generated
    fallback_depth = np.full(len(stacks), -1, dtype=np.int64)
    for allowed in (fallback & ~kind.machinery, fallback):  # the program's own frames first
        chosen = allowed[frame_of_row] if len(frame_of_row) else np.zeros(0, bool)
        found = _first_depth_per_stack(stacks, row_stack, row_depth, np.flatnonzero(chosen))
        fallback_depth = np.where(fallback_depth >= 0, fallback_depth, found)
    depth = np.where(user_depth >= 0, user_depth, fallback_depth)
    sited = depth >= 0
    first_row = np.searchsorted(row_stack, stacks)  # rows are by stack, then depth
    site_frame = np.where(
        sited,
        frame_of_row[np.minimum(first_row + np.maximum(depth, 0), len(frame_of_row) - 1)] if len(frame_of_row) else -1,
        -1,
    )
    return _keyed_sites(db, table, stacks, depth, site_frame, user_depth >= 0, portable)


@dataclass(frozen=True)
class _FrameKinds:
    """Per distinct frame of a layout, what siting asks of it."""

    python: np.ndarray  # a Python frame of a code object the run described (its file known)
    user: np.ndarray  # a Python frame of a user file (`python_file_is_user`)
    generated: np.ndarray  # a Python frame or native frame of generated code (`is_generated_path`)
    anonymous: np.ndarray  # a user Python frame of code run from a string ('<string>')
    symbolized: np.ndarray  # a frame with a function name (markers never count)
    machinery: np.ndarray  # a native frame of the recording machinery (`focus.is_recording_machinery`)

    @classmethod
    def of(cls, db: IngestDb, table: pa.Table) -> _FrameKinds:
        """The frames' files and modules classified by the database's macros, each distinct one once."""
        kinds = table["kind"]
        python_mask, native_mask = pc.equal(kinds, "python"), pc.equal(kinds, "native")
        python_files = pc.unique(table["file"].filter(python_mask)).drop_null().cast(pa.string())
        native_modules = pc.unique(table["module"].filter(native_mask)).drop_null().cast(pa.string())
        classified = _classified_paths(db, python_files, native_modules)
        path, is_python, is_generated = classified["path"], classified["python"], classified["is_generated"]

        def member(column: str, values: pa.ChunkedArray) -> np.ndarray:
            found = pc.is_in(table[column], value_set=values.combine_chunks().cast(pa.string()))
            return pc.fill_null(found, False).to_numpy(zero_copy_only=False)

        python = _numpy_bools(python_mask) & _numpy_bools(pc.is_valid(table["file"]))
        user = python & member("file", path.filter(classified["is_user"]))
        return cls(
            python=python,
            user=user,
            generated=(python & member("file", path.filter(pc.and_(is_python, is_generated))))
            | (_numpy_bools(native_mask) & member("module", path.filter(pc.and_(pc.invert(is_python), is_generated)))),
            anonymous=user & _numpy_bools(pc.fill_null(pc.equal(table["file"], "<string>"), False)),
            symbolized=_numpy_bools(pc.not_equal(kinds, "marker")) & _numpy_bools(pc.is_valid(table["function"])),
            machinery=_numpy_bools(native_mask) & _machinery(table),
        )


def _machinery(table: pa.Table) -> np.ndarray:
    """Per frame: whether its function or its module is the recording machinery's
    (`focus.is_recording_machinery`), each distinct function and module tested once."""
    out = np.zeros(table.num_rows, dtype=bool)
    for column, test in (("function", lambda f: focus.is_recording_machinery(f, None)),
                         ("module", lambda m: focus.is_recording_machinery(None, m))):  # fmt: skip
        values = pc.unique(table[column]).drop_null().to_pylist()
        hits = [value for value in values if test(value)]
        if hits:
            found = pc.is_in(table[column], value_set=pa.array(hits, table[column].type))
            out |= pc.fill_null(found, False).to_numpy(zero_copy_only=False)
    return out


def _classified_paths(db: IngestDb, python_files: pa.Array, native_modules: pa.Array) -> pa.Table:
    """(path, python, is_user, is_generated) of Python files and native modules, by the macros."""
    paths = pa.table(
        {
            "path": pa.concat_arrays([python_files, native_modules]),
            "python": pa.array([True] * len(python_files) + [False] * len(native_modules), pa.bool_()),
        }
    )
    if not paths.num_rows:
        return paths.append_column("is_user", pa.array([], pa.bool_())).append_column(
            "is_generated", pa.array([], pa.bool_())
        )
    db.register("ingest_site_paths", paths)
    try:
        return query_arrow(
            db.con,
            "SELECT path, python, python AND python_file_is_user(path) AS is_user, "
            "coalesce(is_generated_path(path), false) AS is_generated FROM ingest_site_paths",
        )
    finally:
        db.unregister("ingest_site_paths")


def _numpy_bools(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return values.to_numpy(zero_copy_only=False)


def _keyed_sites(
    db: IngestDb,
    table: pa.Table,
    stacks: np.ndarray,
    depth: np.ndarray,
    site_frame: np.ndarray,
    is_user: np.ndarray,
    portable: dict[str, str],
) -> pa.Table:
    """Rows shaped like `stack_sites_from`'s: each stack's site frame (a row of `table`, -1 none)
    at `depth`, with its key and portable file."""
    sited = depth >= 0
    take = pa.array(np.where(sited, site_frame, 0), pa.int64(), mask=~sited)  # null: no site (or no frames at all)
    site_kind = table["kind"].take(take)
    site_file = table["file"].take(take)
    portable_file = pc.if_else(
        pc.equal(site_kind, "python"),
        pa.array([portable.get(f, f) if f is not None else None for f in site_file.to_pylist()], pa.string()),
        pa.scalar(None, pa.string()),
    )
    located = pa.table(
        {
            "stack_id": pa.array(stacks, pa.int64()),
            "site_depth": pa.array(depth, pa.int32(), mask=~sited),
            "site_kind": site_kind,
            "site_function": table["function"].take(take),
            "site_file": site_file,
            "site_line": table["line"].take(take),
            "site_first_line": table["first_line"].take(take),
            "site_module": table["module"].take(take),
            "site_portable_file": portable_file,
            "site_is_user": pa.array(is_user, pa.bool_()),
            "sited": pa.array(sited, pa.bool_()),
        }
    )
    db.register("ingest_located", located)
    try:
        return query_arrow(
            db.con,
            """
            SELECT stack_id,
                   site_depth,
                   CASE WHEN sited THEN site_kind END AS site_kind,
                   CASE WHEN sited THEN site_function END AS site_function,
                   CASE WHEN sited THEN site_file END AS site_file,
                   CASE WHEN sited THEN site_line END AS site_line,
                   CASE WHEN sited AND site_kind = 'python' THEN site_portable_file END AS site_portable_file,
                   CASE WHEN sited AND site_kind = 'python' THEN site_line - site_first_line END AS site_line_offset,
                   CASE WHEN sited AND site_kind = 'native' THEN site_module END AS site_module,
                   site_is_user,
                   CASE WHEN sited THEN site_identity_key(site_kind, site_function, site_portable_file, site_line,
                                                          site_first_line, site_module) END AS site_key
            FROM ingest_located
            """,
        )
    finally:
        db.unregister("ingest_located")


def _first_depth_per_stack(
    stacks: np.ndarray, row_stack: np.ndarray, row_depth: np.ndarray, chosen_rows: np.ndarray
) -> np.ndarray:
    """Per stack of `stacks`: the depth of its first (innermost) row among `chosen_rows`, -1 when none."""
    depth = np.full(len(stacks), -1, dtype=np.int64)
    if len(chosen_rows):
        with_row, first = np.unique(row_stack[chosen_rows], return_index=True)
        depth[np.searchsorted(stacks, with_row)] = row_depth[chosen_rows[first]]
    return depth


def _lent_rows(frame_of_row: np.ndarray, row_stack: np.ndarray, row_depth: np.ndarray, kind: _FrameKinds) -> np.ndarray:
    """Rows of '<string>' frames that belong to their caller: inside generated code (a generated Python
    frame further out) and called by a Python frame that is not user code (`stack_sites_from`'s `lent`;
    the caller is the next Python frame out whose file is known)."""
    python_rows = np.flatnonzero(kind.python[frame_of_row])
    lent = np.zeros(len(frame_of_row), dtype=bool)
    if not len(python_rows):
        return lent
    caller = np.full(len(python_rows), -1, dtype=np.int64)
    same_stack = row_stack[python_rows[1:]] == row_stack[python_rows[:-1]]
    caller[:-1] = np.where(same_stack, python_rows[1:], -1)
    # Outermost generated Python frame of each stack (rows are by stack, then depth).
    generated_rows = python_rows[kind.generated[frame_of_row[python_rows]]]
    outermost = {}
    for row in generated_rows.tolist():
        outermost[int(row_stack[row])] = int(row_depth[row])
    anonymous = np.flatnonzero(kind.anonymous[frame_of_row[python_rows]])
    for index in anonymous.tolist():
        row, by = python_rows[index], caller[index]
        if by < 0 or kind.user[frame_of_row[by]]:
            continue
        if outermost.get(int(row_stack[row]), -1) > row_depth[row]:
            lent[row] = True
    return lent


def number_sites(db: IngestDb, sites: pa.Table, site_order: np.ndarray) -> tuple[pa.Table, pa.Table]:
    """From rows shaped like `stack_sites_from`'s: their `stack_sites` rows, each with the id of its
    site, and the `sites` rows of the keys the table lacks, with the `site_order` of the first row
    that has each (read-only). New sites are numbered after the stored ones by `site_order` (the
    index of the run bringing in the stack: a batch numbers its sites as its runs loaded one by
    one would), then by key."""
    keys = sites["site_key"].combine_chunks().cast(pa.string())
    db.register("ingest_site_keys", pa.table({"site_key": pc.unique(keys).drop_null()}))
    try:
        stored = query_arrow(db.con, "SELECT site_key, site_id FROM sites SEMI JOIN ingest_site_keys USING (site_key)")
        start = query_value(db.con, "SELECT coalesce(max(site_id), 0) + 1 FROM sites")
    finally:
        db.unregister("ingest_site_keys")
    numbered = pa.table(
        {"site_key": stored["site_key"].cast(pa.string()), "site_id": stored["site_id"].cast(pa.int64())}
    )
    at = pc.fill_null(pc.index_in(keys, value_set=numbered["site_key"].combine_chunks()), -1).to_numpy(
        zero_copy_only=False
    )
    new_rows = np.flatnonzero(pc.is_valid(keys).to_numpy(zero_copy_only=False) & (at < 0))
    firsts = np.zeros(0, np.int64)
    if len(new_rows):
        # Each new key's first row among those of its smallest site_order; numbered by (site_order, key).
        by_order = new_rows[np.argsort(site_order[new_rows], kind="stable")]
        codes = pc.dictionary_encode(keys.take(by_order)).indices.to_numpy(zero_copy_only=False)
        firsts = by_order[np.unique(codes, return_index=True)[1]]
        ranked = pa.table({"order": site_order[firsts], "key": keys.take(firsts)})
        firsts = firsts[pc.sort_indices(ranked, [("order", "ascending"), ("key", "ascending")]).to_numpy()]
        site_ids = pa.array(np.arange(start, start + len(firsts)), pa.int64())
        numbered = pa.concat_tables([numbered, pa.table({"site_key": keys.take(firsts), "site_id": site_ids})])
        at = pc.fill_null(pc.index_in(keys, value_set=numbered["site_key"].combine_chunks()), -1).to_numpy(
            zero_copy_only=False
        )
    new = sites.take(pa.array(firsts, pa.int64()))
    new_sites = pa.table(
        {
            "site_id": pa.array(np.arange(start, start + len(firsts)), pa.int64()),
            "site_key": new["site_key"],
            "function": new["site_function"],
            "file": new["site_file"],
            "line": new["site_line"],
            "kind": new["site_kind"],
            "portable_file": new["site_portable_file"],
            "line_offset": new["site_line_offset"],
            "module": pc.replace_substring_regex(new["site_module"], "^.*/", ""),  # the file name
            "site_order": pa.array(site_order[firsts], pa.int64()),
        }
    )
    stack_sites = pa.table(
        {
            "stack_id": sites["stack_id"],
            "site_id": numbered["site_id"].take(pa.array(at, pa.int64(), mask=at < 0)),
            "site_depth": sites["site_depth"],
            "site_kind": sites["site_kind"],
            "site_is_user": sites["site_is_user"],
            "site_file": sites["site_file"],
            "site_line": sites["site_line"],
        }
    )
    return stack_sites, new_sites


def insert_sites(db: IngestDb, new_sites: pa.Table, stack_sites: pa.Table) -> None:
    """`sites` rows and `stack_sites` rows, as `number_sites` gave them."""
    if new_sites.num_rows:
        db.insert("INSERT INTO sites BY NAME SELECT * FROM {}", new_sites)
    if stack_sites.num_rows:
        db.insert("INSERT INTO stack_sites BY NAME SELECT * FROM {}", stack_sites)


# ------------------------------------------------------------------------------------------ portable file names


def import_roots(manifest: dict[str, Any]) -> list[str]:
    """The folders a run's Python files are named relative to, longest first: the run's sys.path as
    the capture recorded it, the script's folder (what CPython puts first on sys.path) and the
    working folder (runs captured before the capture recorded sys.path have only these two)."""
    roots = list(manifest.get("sys_path") or [])
    cwd = manifest.get("cwd")
    argv = manifest.get("argv") or []
    if cwd and argv and argv[0] and not argv[0].startswith("-"):
        roots.append(os.path.dirname(os.path.join(cwd, argv[0])))
    if cwd:
        roots.append(cwd)
    cleaned = {os.path.normpath(root) for root in roots if isinstance(root, str) and root.startswith("/")}
    return sorted((root for root in cleaned if root != "/"), key=len, reverse=True)


def portable_file(file: str, roots: Sequence[str]) -> tuple[str, str | None]:
    """(the file's name relative to the longest root holding it, that root); the file itself, None when
    no root does. Installed packages are named from their site-packages folder even without a root."""
    if not file.startswith("/"):
        return file, None  # '<frozen os>', '<string>', an FX pseudo-file: already free of checkout paths
    for root in roots:
        if file.startswith(root + "/"):
            return file[len(root) + 1 :], root
    for marker in ("/site-packages/", "/dist-packages/"):
        at = file.rfind(marker)
        if at >= 0:
            return file[at + len(marker) :], file[: at + len(marker) - 1]
    return file, None


def record_source_files(db: IngestDb, files: Sequence[str], roots: Sequence[str]) -> None:
    """`source_files` rows for those of `files` the table lacks, named relative to `roots`."""
    record_portable_files(db, {file: portable_file(file, roots) for file in files})


def record_portable_files(db: IngestDb, named: dict[str, tuple[str, str | None]]) -> None:
    """`source_files` rows for the files of {file: (portable file, root)} that the table lacks."""
    if not named:
        return
    table = pa.table(
        {
            "file": pa.array(list(named), pa.string()),
            "portable_file": pa.array([portable for portable, _root in named.values()], pa.string()),
            "root": pa.array([root for _portable, root in named.values()], pa.string()),
        }
    )
    db.insert("INSERT INTO source_files BY NAME SELECT * FROM {} ANTI JOIN source_files USING (file)", table)


# ------------------------------------------------------------------------------------------ older databases


def backfill_site_identity(db: IngestDb, read_first_lines) -> None:
    """Once, for a database upgraded from schema 2: name the old runs' files (`source_files`) and give
    their Python frames their functions' first lines where the run folders still have them.

    `read_first_lines(run_dir)` -> {(file, qualname): first_line} from a run folder's code parts
    (None when it cannot be read). Frames left without a first line keep keys over their absolute
    line: comparable with runs of the same lines only. Sites are then recomputed by the ingest.
    """
    con = db.con
    if site_identity_backfilled(con):
        return
    runs = query_rows(
        con,
        """
        SELECT r.run_id, r.source_dir, CAST(r.manifest AS VARCHAR)
        FROM runs r
        WHERE EXISTS (SELECT 1 FROM stacks s WHERE s.first_run_id = r.run_id)
        ORDER BY r.run_number
        """,
    )
    with db.transaction():
        for run_id, source_dir, manifest_text in runs:
            manifest = json.loads(manifest_text) if manifest_text else {}
            _backfill_run(db, run_id, Path(source_dir) if source_dir else None, manifest, read_first_lines)
        con.execute(
            """
            UPDATE frames SET frame_hash = frame_hash(kind, function, file, line, first_line, module, module_key,
                                                      address, exact, inlined, reason)
            WHERE kind = 'python'
            """
        )
        con.execute("INSERT OR REPLACE INTO settings VALUES ('site_identity_backfilled', '1')")


def _backfill_run(
    db: IngestDb, run_id: str, source_dir: Path | None, manifest: dict[str, Any], read_first_lines
) -> None:
    """`backfill_site_identity` for the stacks one old run brought in."""
    con = db.con
    files = [
        row[0]
        for row in query_rows(
            con,
            """
            SELECT DISTINCT f.file FROM stack_frames f JOIN stacks s USING (stack_id)
            WHERE s.first_run_id = ? AND f.kind = 'python' AND f.file IS NOT NULL
            """,
            [run_id],
        )
    ]
    record_source_files(db, files, import_roots(manifest))
    missing = query_value(
        con,
        """
        SELECT count(*) FROM stack_frames f JOIN stacks s USING (stack_id)
        WHERE s.first_run_id = ? AND f.kind = 'python' AND f.first_line IS NULL
        """,
        [run_id],
    )
    first_lines = read_first_lines(source_dir) if missing and source_dir else None
    if not first_lines:
        return
    table = pa.table(
        {
            "file": pa.array([k[0] for k in first_lines], pa.string()),
            "function": pa.array([k[1] for k in first_lines], pa.string()),
            "first_line": pa.array(list(first_lines.values()), pa.int32()),
        }
    )
    db.register("ingest_first_lines", table)
    try:
        # Frames are shared by stacks; equal frames of other runs get the same first line.
        con.execute(
            """
            UPDATE frames SET first_line = l.first_line
            FROM ingest_first_lines l
            WHERE frames.kind = 'python' AND frames.first_line IS NULL
              AND frames.file = l.file AND frames.function = l.function
            """
        )
    finally:
        db.unregister("ingest_first_lines")
