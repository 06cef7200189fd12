"""Runs read without their frames: a run all of whose stacks (by the hash the capture writes) the
database holds, or a run loaded before it brings in, is not read for its frames and stores the same
rows as when read whole; it is still checked (references, page checksums, its written hashes), and
read whole after all when the run that was to bring its stacks fails. Which run claims a stack first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.damage import DAMAGE
from support.ingest import _copy, ingest, rows, snapshot

from tbpipe.pipeline.db.ingest import IngestHooks, IngestLimits
from tbpipe.pipeline.rawrun import find_run_dirs


def _frames_read() -> tuple[IngestHooks, list[str]]:
    """Hooks, and the run folders whose stacks the ingest reads with their frames (filled as it goes)."""
    read: list[str] = []
    return IngestHooks(run_read=lambda run_dir, whole: read.append(run_dir.name) if whole else None), read


def _content(db: Path) -> dict[str, tuple]:
    """What `snapshot` holds but the runs' file fingerprints, and the site counts."""
    content = snapshot(db, exclude_ingest_times=True)
    content["runs"] = rows(
        db, "SELECT count(*), sum(hash(t)) FROM (SELECT run_id, run_number, events, stacks, new_stacks FROM runs) t"
    )
    content["site_counts"] = rows(db, "SELECT count(*), sum(hash(t)) FROM site_counts t")
    return content


def test_runs_whose_stacks_are_stored_load_without_their_frames(tmp_path, symbol_cache) -> None:
    """The capture writes each stack's hash (raw schema 4): a run all of whose stacks the database
    holds, or that a run loaded before it brings in, is read without its frames. What is stored is
    the same as when every run is read whole (runs written without the hashes)."""
    from support.synthetic import SyntheticConfig, generate

    config = SyntheticConfig(
        runs=9, events=9000, unique_stacks=300, native_addresses=500, code_objects=100, max_modules=6
    )
    generate(tmp_path / "hashed", config)
    generate(tmp_path / "unhashed", SyntheticConfig(**{**config.__dict__, "written_hashes": False}))
    hooks, read = _frames_read()
    # Runs prepared one at a time: read side by side, a run may look before the one ahead of it
    # tells which stacks it brings in, and read its frames for nothing (which changes no row).
    options = {"cache": symbol_cache, "hooks": hooks, "limits": IngestLimits(read_threads=1)}
    first, rest = find_run_dirs([tmp_path / "hashed"])[:4], find_run_dirs([tmp_path / "hashed"])[4:]
    hashed = tmp_path / "hashed.duckdb"
    assert ingest(hashed, *first, runs_per_transaction=2, **options).ingested == 4
    assert ingest(hashed, *rest, **options).ingested == 5
    bringing = {path.rsplit("/", 1)[-1] for (path,) in rows(hashed, "SELECT source_dir FROM runs WHERE new_stacks > 0")}
    assert 0 < len(bringing) < 9
    assert sorted(read) == sorted(bringing), "frames are read for the runs that bring in stacks, and only for them"

    read.clear()
    unhashed = tmp_path / "unhashed.duckdb"
    assert (
        ingest(unhashed, *find_run_dirs([tmp_path / "unhashed"])[:4], runs_per_transaction=2, **options).ingested == 4
    )
    assert ingest(unhashed, *find_run_dirs([tmp_path / "unhashed"])[4:], **options).ingested == 5
    assert len(read) == 9
    assert _content(hashed) == _content(unhashed)


@pytest.mark.parametrize("merge_at", [4, 1 << 14])
def test_stack_claims_answer_as_a_claim_per_hash_would(merge_at) -> None:
    """Which run first claims each stack hash, asked by runs prepared out of order: the sorted arrays
    answer every question as a dictionary of hash -> first claiming run does (with and without
    merges of the small array into the big one), and end holding the same claims."""
    from tbpipe.pipeline.db.ingest.read_ahead import StackClaims

    rng = np.random.default_rng(7)
    for pool_size in (40, 3000):
        pool = rng.integers(0, 2**64, pool_size, dtype=np.uint64)
        positions = np.arange(300)
        swapped = np.flatnonzero(rng.random(150) < 0.5) * 2  # neighbours prepared in either order
        positions[swapped], positions[swapped + 1] = positions[swapped + 1], positions[swapped]
        expected: dict[int, int] = {}
        claims = StackClaims(merge_at=merge_at)
        answers = []
        for position in positions.tolist():
            hashes = rng.choice(pool, int(rng.integers(1, 200)))
            before = all(expected.get(h, position) < position for h in hashes.tolist())
            if not before:
                for h in hashes.tolist():
                    if expected.get(h, position + 1) > position:
                        expected[h] = position
            answers.append(before)
            assert claims.claimed_before(hashes, position) == before, position
        assert any(answers) and not all(answers)
        assert claims.claims() == expected


def test_runs_read_without_their_frames_are_still_checked(tmp_path, good_run, symbol_cache) -> None:
    """A run whose stacks are stored is still quarantined when its stacks refer to a module or code
    object it does not describe, when its events refer to stacks it does not hold, and when a page
    of a column it does not read is damaged."""
    runs = tmp_path / "runs"
    db = tmp_path / "t.duckdb"
    assert ingest(db, _copy(good_run, runs, "first"), cache=symbol_cache).ingested == 1
    later = tmp_path / "later"
    damage = {
        "nomodule": (DAMAGE["nomodule"][0], DAMAGE["nomodule"][1]),
        "nocode": (DAMAGE["nocode"][0], DAMAGE["nocode"][1]),
        "stacksbit": (DAMAGE["stacksbit"][0], DAMAGE["stacksbit"][1]),
        "dangling": (_events_without_their_stack, "events refer to stacks the run does not hold"),
    }
    for name, (change, _reason) in damage.items():
        change(_copy(good_run, later, name))
    _copy(good_run, later, "whole")
    hooks, read = _frames_read()
    summary = ingest(db, later, cache=symbol_cache, hooks=hooks)
    assert read == [], "every one of them was read without its frames"
    reasons = {outcome.path.name: outcome.reason for outcome in summary.quarantined}
    assert sorted(reasons) == sorted(damage)
    for name, (_change, reason) in damage.items():
        assert reason in reasons[name], (name, reasons[name])
    assert rows(db, "SELECT count(*) FROM runs") == [(2,)]
    assert rows(db, "SELECT sum(new_stacks) FROM runs WHERE run_id LIKE '%whole'") == [(0,)]


def _events_without_their_stack(run_dir: Path) -> None:
    """One event of the run's first events part names a stack the run does not hold."""

    def change(table: pa.Table) -> pa.Table:
        ids = table["stack_id"].to_pylist()
        ids[0] = 12345
        index = table.schema.get_field_index("stack_id")
        return table.set_column(index, table.schema.field(index), pa.array(ids, pa.uint64()))

    _rewrite_as_capture(run_dir / "events-000001.parquet", "events", change)


def _rewrite_as_capture(part: Path, table_name: str, change) -> None:
    """The part rewritten with `change`, with the capture's write options (page checksums)."""
    from support.synthetic import write_part

    write_part(part.parent, table_name, int(part.stem.rsplit("-", 1)[1]), change(pq.read_table(part)))


def test_a_run_read_without_frames_brings_its_stacks_when_the_one_before_fails(
    tmp_path, good_run, symbol_cache
) -> None:
    """The run that was to bring in the stacks fails as it loads (its events name a stack it does not
    hold): the next one, read without its frames as its stacks were to come first, is read whole
    and brings them in itself."""
    runs = tmp_path / "runs"
    _events_without_their_stack(_copy(good_run, runs, "a-fails"))
    _copy(good_run, runs, "b-whole")
    db = tmp_path / "t.duckdb"
    hooks, read = _frames_read()
    one_reader = IngestLimits(read_threads=1)  # a-fails is looked at first
    summary = ingest(db, runs, cache=symbol_cache, hooks=hooks, limits=one_reader)
    assert [outcome.path.name for outcome in summary.quarantined] == ["a-fails"]
    assert read == ["a-fails", "b-whole"], "b-whole was read without its frames first"
    assert summary.ingested == 1 and summary.new_stacks > 0
    alone = tmp_path / "alone.duckdb"
    assert ingest(alone, _copy(good_run, tmp_path / "alone", "b-whole"), cache=symbol_cache).ingested == 1
    assert {k: v for k, v in _content(db).items() if k != "runs"} == {
        k: v for k, v in _content(alone).items() if k != "runs"
    }


def test_a_written_stack_hash_unlike_its_frames_quarantines_the_run(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"

    def wrong(table: pa.Table) -> pa.Table:
        hashes = table["stack_hash"].to_pylist()
        hashes[-1] ^= 1
        index = table.schema.get_field_index("stack_hash")
        return table.set_column(index, table.schema.field(index), pa.array(hashes, pa.uint64()))

    _rewrite_as_capture(_copy(good_run, runs, "wrong") / "stacks-000001.parquet", "stacks", wrong)
    summary = ingest(tmp_path / "t.duckdb", runs, cache=symbol_cache)
    (outcome,) = summary.quarantined
    assert "1 stacks' stack_hash differs from the hash of their frames" in outcome.reason


def test_module_references_are_shown_described_by_statistics_only_when_they_are(tmp_path) -> None:
    """A run read without its frames skips decoding its native frames' module references when the
    footer's statistics show each one described (`_references_described`): every value between a
    row group's min and max must be a described module, and a part without statistics is decoded."""
    import numpy as np

    from tbpipe.pipeline.rawrun import _references_described

    def footer(groups: list[list[int]], statistics: bool = True) -> pq.FileMetaData:
        path = tmp_path / f"part-{len(list(tmp_path.iterdir()))}.parquet"
        table = pa.table({"module": pa.array([m for group in groups for m in group], pa.int32())})
        pq.write_table(table, path, row_group_size=len(groups[0]), write_statistics=statistics)
        return pq.read_metadata(path)

    described = np.arange(6)
    assert _references_described(footer([[0, 5, 2], [1, 1, 3]]), "module", described)
    assert not _references_described(footer([[0, 5, 2], [1, 6, 3]]), "module", described)  # 6: none
    assert not _references_described(footer([[0, -1, 2]]), "module", described)  # a marker's -1
    assert not _references_described(footer([[0, 5, 2]]), "module", np.array([0, 1, 2, 4, 5]))  # 3 lost
    assert _references_described(footer([[2, 4, 3]]), "module", np.array([0, 2, 3, 4]))
    assert not _references_described(footer([[0, 5, 2]], statistics=False), "module", described)
