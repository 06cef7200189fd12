"""An ingest with nothing to load (an empty folder, runs the database holds, runs quarantined for
their manifests) decides so from the run folders and the database alone: it imports neither numpy
nor pyarrow nor the stages that read runs, gives the outcomes the stages would, and changes nothing.
A run to load brings the stages in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.ingest import _copy, ingest, snapshot

from tbpipe.schemas import raw
from tbpipe.schemas.format import TABLE_SINCE

# What only reading a run needs (pandas: pyarrow's conversions import it where it is installed).
READING_RUNS = ("numpy", "pandas", "pyarrow", "tbpipe.pipeline.db.ingest.stages")

CLI = f"""
import json, sys
from tbpipe.pipeline.cli import main
sys.argv = ["tbpipe", "ingest", *sys.argv[1:]]
try:
    main()
    code = 0
except SystemExit as exit:
    code = exit.code
print("RESULT", json.dumps({{"exit": code, "imported": [m for m in {READING_RUNS!r} if m in sys.modules]}}))
"""


def _cli_ingest(folder: Path, db: Path, cache: Path) -> dict:
    """`tbpipe ingest FOLDER` in a fresh interpreter: its exit status and which of READING_RUNS it imported."""
    args = [str(folder), "--db", str(db), "--cache-dir", str(cache), "--no-progress"]
    result = subprocess.run(
        [sys.executable, "-c", CLI, *args], capture_output=True, text=True, timeout=120, cwd=folder.parent
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout + result.stderr
    return json.loads(lines[-1].removeprefix("RESULT "))


def _damaged_manifest(run_dir: Path) -> None:
    (run_dir / "manifest.json").write_text("{not json")


def test_an_ingest_with_nothing_to_load_imports_no_numpy_nor_pyarrow(tmp_path, good_run, symbol_cache) -> None:
    runs, empty, db = tmp_path / "runs", tmp_path / "empty", tmp_path / "t.duckdb"
    empty.mkdir()
    _copy(good_run, runs, "a")
    _damaged_manifest(_copy(good_run, runs, "b"))
    assert ingest(db, runs, cache=symbol_cache).ingested == 1

    assert _cli_ingest(empty, db, symbol_cache) == {"exit": 0, "imported": []}
    # Run b stays quarantined: the exit status says so, as it did when the stages read it.
    assert _cli_ingest(runs, db, symbol_cache) == {"exit": 1, "imported": []}

    # A run to load: the stages come in.
    _copy(good_run, runs, "c")
    loaded = _cli_ingest(runs, db, symbol_cache)
    assert loaded["exit"] == 1 and {"numpy", "pyarrow", "tbpipe.pipeline.db.ingest.stages"} <= set(loaded["imported"])


def test_runs_found_without_reading_have_the_outcomes_the_stages_give(tmp_path, good_run, symbol_cache) -> None:
    runs, db = tmp_path / "runs", tmp_path / "t.duckdb"
    _copy(good_run, runs, "a")
    _damaged_manifest(_copy(good_run, runs, "b"))
    lost = _copy(good_run, runs, "c")
    (lost / next(lost.glob("events-*.parquet")).name).unlink()  # listed in the manifest, gone
    by_stages = ingest(db, runs, cache=symbol_cache)
    before = snapshot(db)

    unread = ingest(db, runs, cache=symbol_cache)
    assert [(o.path.name, o.status) for o in unread.outcomes] == [
        ("a", "present"),
        ("b", "quarantined"),
        ("c", "quarantined"),
    ]
    assert unread.outcomes[1:] == by_stages.outcomes[1:]
    assert "manifest is not JSON" in unread.outcomes[1].reason
    assert "files listed in the manifest are missing" in unread.outcomes[2].reason
    assert snapshot(db) == before


def test_run_folders_name_the_tables_the_schemas_describe_in_their_order() -> None:
    # A run's parts fingerprint, kept in the database, lists its tables in this order.
    assert list(TABLE_SINCE) == list(raw.RUN_TABLES)
