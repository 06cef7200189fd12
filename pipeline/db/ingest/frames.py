"""Frames into the database: each distinct frame once (`frames`), stacks as rows of frame ids.

A frame's identity is its content (`frame_hash` in sql/stacks.sql): the frames of a run's new
stacks that the database already has (most of them, after the first night) are found by hash and
reused; only the others are inserted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe.pipeline.db.connection import query_arrow, query_value
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.stacks import layout


@dataclass
class FrameIds:
    """The database frame id of each distinct frame of a layout, decided before any insert."""

    ids: np.ndarray  # int64 per row of `Frames.frames`
    hashes: np.ndarray  # uint64 per row: `frame_hash`
    new: np.ndarray  # bool per row: the frame is not stored yet (the first row of each new hash)


def resolve_frames(db: IngestDb, frames: pa.Table) -> FrameIds:
    """Frame ids for distinct frames (read-only: the stored ones found by hash, the others numbered
    after the highest stored id, equal frames sharing one)."""
    db.register("ingest_frames_in", frames.append_column("local", pa.array(np.arange(frames.num_rows), pa.int64())))
    try:
        found = query_arrow(
            db.con,
            """
            WITH hashed AS (
                SELECT local, frame_hash(kind, function, file, line, first_line, module, module_key, address, exact,
                                         inlined, reason) AS frame_hash
                FROM ingest_frames_in
            )
            SELECT h.local, h.frame_hash, f.frame_id
            FROM hashed h LEFT JOIN frames f USING (frame_hash)
            ORDER BY h.local
            """,
        )
        base = int(query_value(db.con, "SELECT coalesce(max(frame_id), 0) + 1 FROM frames"))
    finally:
        db.unregister("ingest_frames_in")
    hashes = found["frame_hash"].to_numpy()
    ids = pc.fill_null(found["frame_id"], -1).to_numpy().astype(np.int64)
    missing = np.flatnonzero(ids < 0)
    distinct, first, inverse = np.unique(hashes[missing], return_index=True, return_inverse=True)
    ids[missing] = base + inverse.ravel()
    new = np.zeros(frames.num_rows, dtype=bool)
    new[missing[first]] = True
    return FrameIds(ids, hashes, new)


def insert_frame_rows(db: IngestDb, frames: layout.Frames, ids: FrameIds, rows: np.ndarray, store: np.ndarray) -> None:
    """The `stack_frame_rows` at `rows` of a layout, after storing the frames at `store` (new frames
    this transaction is the first to use) in `frames`."""
    if len(store):
        table = frames.frames.take(pa.array(store))
        table = table.append_column("frame_id", pa.array(ids.ids[store], pa.int32()))
        table = table.append_column("frame_hash", pa.array(ids.hashes[store], pa.uint64()))
        db.insert("INSERT INTO frames BY NAME SELECT * FROM {}", table)
    table = _rows_at(frames.rows, rows)
    local = table["frame"].to_numpy()
    db.insert(
        "INSERT INTO stack_frame_rows BY NAME SELECT * FROM {}",
        table.set_column(table.column_names.index("frame"), "frame_id", pa.array(ids.ids[local], pa.int32())),
    )


def _rows_at(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """table[rows] for increasing rows: a slice (no copy) when they are consecutive, as a run's rows
    are when it brings in stacks numbered one after another."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return table.slice(int(rows[0]), len(rows))
    return table.take(pa.array(rows))


def store_all_frame_rows(db: IngestDb, frames: layout.Frames) -> None:
    """Every row of a layout, storing its new frames: for stacks laid out again in one transaction."""
    ids = resolve_frames(db, frames.frames)
    insert_frame_rows(db, frames, ids, np.arange(frames.rows.num_rows), np.flatnonzero(ids.new))
