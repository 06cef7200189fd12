"""Damaged runs: each kind of damage (`support.damage.DAMAGE`) quarantines its run with a reason that
names the folder and the damage, while good runs beside them go in and nothing of the damaged ones
does; the CLI's exit status and messages; a run without its manifest, reported and recovered on request."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import TBPIPE
from support.damage import DAMAGE
from support.ingest import _copy, ingest, rows
from support.runs import read_run


def test_damaged_runs_are_quarantined_and_good_ones_go_in(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    good = [_copy(good_run, runs, "good1"), _copy(good_run, runs, "good2")]
    damaged = {}
    for name, (damage, _reason) in DAMAGE.items():
        damaged[name] = _copy(good_run, runs, name)
        damage(damaged[name])
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    reasons = {o.path.name: o.reason for o in summary.quarantined}
    let_in = sorted(set(DAMAGE) - set(reasons))
    assert not let_in, f"damaged runs that were not quarantined: {let_in}"
    assert sorted(reasons) == sorted(DAMAGE)
    wrong = {
        name: reasons[name]
        for name, (_damage, expected) in DAMAGE.items()
        if str(damaged[name]) not in reasons[name] or expected not in reasons[name]
    }
    assert not wrong, f"quarantined for another reason than their damage: {wrong}"
    assert summary.ingested == 2
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted(
        json.loads((g / "manifest.json").read_text())["run_id"] for g in good
    )
    # Nothing of the quarantined runs got in: two copies of one workload, events and all.
    assert rows(db, "SELECT count(*) FROM events") == [(2 * read_run(good_run).tables["events"].num_rows,)]
    # The runs are laid out in one batch: stacks a quarantined run would have brought in (the
    # damaged copies sort before the good ones) were brought in by the good runs instead.
    assert rows(
        db, "SELECT count(*) FROM events e ANTI JOIN stacks s USING (stack_id) WHERE e.stack_id IS NOT NULL"
    ) == [(0,)]
    assert rows(db, "SELECT count(*) FROM stacks s ANTI JOIN stack_sites USING (stack_id)") == [(0,)]
    assert rows(db, "SELECT count(DISTINCT first_run_id) FROM stacks") == [(1,)]
    # What the ingest keeps between runs (next run number and event id, module keys stored) was
    # forgotten with each rolled-back run: "attrs" failed inside its transaction before the good runs.
    assert rows(db, "SELECT list(run_number ORDER BY run_number) FROM runs") == [([1, 2],)]
    assert rows(db, "SELECT min(event_id), max(event_id) = count(*) FROM event_rows") == [(1, True)]
    assert rows(db, "SELECT count(*) FROM run_modules ANTI JOIN modules USING (module_key)") == [(0,)]
    assert rows(db, "SELECT count(*) FROM run_modules") != [(0,)]


def test_cli_exit_status_and_messages_for_quarantined_runs(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    _copy(good_run, runs, "fine")
    broken = _copy(good_run, runs, "broken")
    (broken / "manifest.json").write_text("[]")
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="200")
    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(tmp_path / "t.duckdb")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"quarantined {broken}/manifest.json: not a tbpipe-raw manifest" in result.stdout
    assert "runs ingested" in result.stdout and "quarantined" in result.stdout
    result = subprocess.run(
        [*TBPIPE, "ingest", str(tmp_path / "nowhere"), "--db", str(tmp_path / "t.duckdb")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2 and "no such folder" in result.stderr and "Traceback" not in result.stderr


def test_a_run_without_its_manifest_is_reported_and_can_be_recovered(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    _copy(good_run, runs, "fine")
    lost = _copy(good_run, runs, "lost")
    manifest = json.loads((lost / "manifest.json").read_text())
    (lost / "manifest.json").unlink()
    before = sorted(p.name for p in lost.iterdir())
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="300")
    db = tmp_path / "t.duckdb"
    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(db)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 1, result.stderr
    assert f"quarantined {lost}/manifest.json: manifest is missing" in result.stdout
    assert "--recover-manifests" in result.stdout
    fine_id = json.loads((runs / "fine" / "manifest.json").read_text())["run_id"]
    assert [r[0] for r in rows(db, "SELECT run_id FROM runs")] == [fine_id]

    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(db), "--recover-manifests"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ((run_id, complete, labels, events, notes),) = rows(
        db, "SELECT run_id, complete, labels, events, ingest_notes FROM runs WHERE run_id = 'lost'"
    )
    assert (complete, labels) == (False, {})
    assert events == manifest["counters"]["events_written"] > 0
    assert any("manifest.json was missing" in note for note in notes)
    # Counted per site like the run it was copied from; the folder itself is left as found.
    per_site = "SELECT site_key, name, events FROM call_sites WHERE run_id = ? ORDER BY ALL"
    assert rows(db, per_site, ["lost"]) == rows(db, per_site, [fine_id])
    assert sorted(p.name for p in lost.iterdir()) == before
