"""Frames into the database: each distinct frame once (`frames`), stacks as rows of frame ids.

A frame's identity is its content (`frame_hash` in sql/stacks.sql): the frames of a run's new
stacks that the database already has (most of them, after the first night) are found by hash and
reused; only the others are inserted.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tbpipe.pipeline.db.connection import query_arrow
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.stacks import layout


def insert_frame_rows(
    db: IngestDb, frames: layout.Frames, rows: np.ndarray | None = None, used: np.ndarray | None = None
) -> None:
    """`stack_frame_rows` of laid-out stacks (`rows` of them, all by default), adding to `frames` those
    of their frames (`used`, the distinct frames those rows refer to) that the database lacks."""
    table = frames.rows if rows is None else frames.rows.take(pa.array(rows))
    used = np.arange(frames.frames.num_rows) if used is None else used
    frame_ids = np.full(frames.frames.num_rows, -1, dtype=np.int64)
    frame_ids[used] = store_frames(db, frames.frames.take(pa.array(used)))
    local = table["frame"].to_numpy()
    db.insert(
        "INSERT INTO stack_frame_rows BY NAME SELECT * FROM {}",
        table.set_column(table.column_names.index("frame"), "frame_id", pa.array(frame_ids[local], pa.int32())),
    )


def store_frames(db: IngestDb, frames: pa.Table) -> np.ndarray:
    """The database's frame id of each row of `frames` (distinct frames), inserting the new ones."""
    con = db.con
    db.register("ingest_frames_in", frames.append_column("local", pa.array(np.arange(frames.num_rows), pa.int64())))
    try:
        con.execute(
            """
            CREATE OR REPLACE TEMP TABLE ingest_frames AS
            SELECT *, frame_hash(kind, function, file, line, first_line, module, module_key, address, exact, inlined,
                                 reason) AS frame_hash
            FROM ingest_frames_in
            """
        )
    finally:
        db.unregister("ingest_frames_in")
    try:
        con.execute(
            """
            INSERT INTO frames BY NAME
            SELECT (SELECT coalesce(max(frame_id), 0) FROM frames) + row_number() OVER (ORDER BY frame_hash) AS frame_id,
                   * EXCLUDE (local)
            FROM (
                SELECT DISTINCT ON (frame_hash) * FROM ingest_frames i
                ANTI JOIN frames f USING (frame_hash)
                ORDER BY frame_hash, local
            )
            """
        )
        mapping = query_arrow(
            con,
            """
            SELECT i.local, f.frame_id FROM ingest_frames i JOIN frames f USING (frame_hash)
            """,
        )
    finally:
        con.execute("DROP TABLE IF EXISTS temp.ingest_frames")
    ids = np.full(frames.num_rows, -1, dtype=np.int64)
    ids[mapping["local"].to_numpy()] = mapping["frame_id"].to_numpy()
    return ids
