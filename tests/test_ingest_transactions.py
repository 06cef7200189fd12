"""Transactions: runs sharing a transaction (within its row budget, or `runs_per_transaction`) store
what one transaction per run does, numbered as if loaded one by one, and a run failing inside one is
quarantined alone; the next transaction loading its events beside the one committing, on the other
connection, changes nothing stored, and is laid out again when the one before fails."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from conftest import TBPIPE
from support.damage import DAMAGE
from support.ingest import (
    _copy,
    _ingested_alone,
    _manifest,
    _rewrite,
    _run_ids,
    _synthetic_night,
    _words,
    ingest,
    rows,
    snapshot,
)
from support.runs import transaction_sizes

from tbpipe.pipeline.db.ingest import IngestHooks, IngestLimits
from tbpipe.pipeline.rawrun import find_run_dirs


def test_small_runs_share_a_transaction_up_to_its_events_and_a_big_run_goes_alone() -> None:
    """By default consecutive runs share a transaction while they load at most `rows_per_transaction`
    rows together; a run at or past it (or past what is left) starts one of its own, and runs
    without rows add none. `runs_per_transaction` overrides that with a count."""
    from tbpipe.pipeline.db.ingest.load import transaction_end
    from tbpipe.pipeline.db.ingest.tuning import IngestLimits

    def groups(events: list[int], per_transaction: int | None = None) -> list[int]:
        sizes, first = [], 0
        while first < len(events):
            end = transaction_end(events, first, budget, per_transaction)
            assert end > first
            sizes.append(end - first)
            first = end
        return sizes

    budget = IngestLimits().rows_per_transaction
    small = budget // 25
    assert groups([small] * 60) == [25, 25, 10]
    assert groups([small, budget, small, small]) == [1, 1, 2]
    assert groups([small, budget - small, 1, 0, 0]) == [2, 3]
    assert groups([budget * 4, small, small]) == [1, 2]
    assert groups([0] * 70) == [70]
    assert groups([small] * 7, 3) == [3, 3, 1]
    assert groups([budget * 4] * 3, 2) == [2, 1]
    assert groups([small] * 4, 1) == [1, 1, 1, 1]
    # The CLI's help (which does not import the ingest) says the same budget.
    shown = subprocess.run(
        [*TBPIPE, "ingest", "--help"], capture_output=True, text=True, env=dict(os.environ, COLUMNS="200")
    )
    assert f"share one up to {budget // 1000}k rows" in _words(shown.stdout.replace("│", " "))


def test_small_runs_share_transactions_by_default_and_load_as_runs_alone(tmp_path, symbol_cache) -> None:
    """The default ingest of a night of small runs loads them in shared transactions, and stores
    exactly what an ingest of one transaction per run does; with runs past the budget, each goes alone."""
    runs = tmp_path / "runs"
    _synthetic_night(runs, 7)  # 1,000 events a run
    hooks, groups = transaction_sizes()
    db = tmp_path / "default.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, hooks=hooks)
    assert summary.ok and summary.ingested == 7
    assert groups == [7]
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)
    groups.clear()
    small_budget = IngestLimits(rows_per_transaction=1500)
    assert (
        ingest(tmp_path / "small-budget.duckdb", runs, cache=symbol_cache, hooks=hooks, limits=small_budget).ingested
        == 7
    )
    assert groups == [1] * 7


def test_runs_sharing_a_transaction_load_as_runs_alone(tmp_path, symbol_cache) -> None:
    from support.synthetic import SyntheticConfig, generate

    runs = tmp_path / "runs"
    # Runs that bring in new stacks, symbols, modules and event names of their own, and share others.
    generate(
        runs,
        SyntheticConfig(runs=7, events=7000, unique_stacks=400, native_addresses=600, code_objects=120, max_modules=6),
    )
    hooks, groups = transaction_sizes()
    db = tmp_path / "grouped.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=3, hooks=hooks)
    assert summary.ok and summary.ingested == 7 and summary.events == 7000
    assert groups == [3, 3, 1]
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)
    assert rows(db, "SELECT count(*) FROM stacks s ANTI JOIN stack_sites USING (stack_id)") == [(0,)]
    assert rows(db, "SELECT list(run_number ORDER BY run_number) FROM runs") == [(list(range(1, 8)),)]


def test_runs_loaded_together_number_what_they_add_as_one_by_one(tmp_path, good_run, symbol_cache) -> None:
    """Runs, events and event names numbered as if loaded one by one, whichever runs share a
    transaction: a run loaded again (incomplete before) keeps its number, so the runs of a
    transaction need not be numbered in a row, and new runs beside it get numbers and event ids
    after the ones it held."""
    runs = tmp_path / "runs"
    grouped, alone = tmp_path / "grouped.duckdb", tmp_path / "alone.duckdb"

    def ingest_both(statuses: list[str]) -> None:
        summary = ingest(grouped, runs, cache=symbol_cache, runs_per_transaction=4)
        assert [o.status for o in summary.outcomes] == statuses
        ingest(alone, runs, cache=symbol_cache, runs_per_transaction=1)
        assert snapshot(grouped, exclude_ingest_times=True) == snapshot(alone, exclude_ingest_times=True)

    for name in ("a", "c"):
        _copy(good_run, runs, name)
    _manifest(runs / "c", complete=False)
    ingest_both(["ingested", "ingested"])
    # A new run before the one loaded again (which holds the highest event ids), and one after it;
    # both bring event names of their own.
    _manifest(runs / "c", complete=True)
    _rename_events(_copy(good_run, runs, "b"), "zzz-new-in-b")
    _rename_events(_copy(good_run, runs, "d"), "aaa-new-in-d")
    _manifest(runs / "d", complete=False)
    ingest_both(["present", "ingested", "updated", "ingested"])
    new_names = "SELECT name FROM event_names WHERE name LIKE '%-new-in-%' GROUP BY name ORDER BY min(name_id)"
    assert rows(grouped, new_names) == [("zzz-new-in-b",), ("aaa-new-in-d",)]
    # The run loaded again first in its transaction, holding the highest run number.
    _manifest(runs / "d", complete=True)
    _copy(good_run, runs, "e")
    ingest_both(["present", "present", "present", "updated", "ingested"])
    run_id = dict(zip("abcde", _run_ids(runs)))
    assert rows(grouped, "SELECT run_id, run_number FROM runs ORDER BY run_number") == [
        (run_id[name], number) for name, number in (("a", 1), ("c", 2), ("b", 3), ("d", 4), ("e", 5))
    ]
    assert rows(grouped, "SELECT count(DISTINCT event_id) = count(*) FROM event_rows") == [(True,)]


def _rename_events(run_dir: Path, name: str) -> None:
    for part in run_dir.glob("events-*.parquet"):
        _rewrite(
            part,
            lambda t: t.set_column(
                t.schema.get_field_index("name"), t.schema.field("name"), pa.array([name] * t.num_rows, pa.string())
            ),
        )


def test_cli_loads_runs_together_on_request(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        _copy(good_run, runs, name)
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="300")
    db = tmp_path / "t.duckdb"
    command = [*TBPIPE, "ingest", str(runs), "--db", str(db), "--runs-per-transaction"]
    refused = subprocess.run([*command, "0"], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "--runs-per-transaction" in _words(refused.stderr), refused.stderr
    assert not db.exists()
    result = subprocess.run([*command, "2"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((good_run / "manifest.json").read_text())
    threads = {int(k): v for k, v in manifest["threads"].items()}
    # The runs rows, built as the lake builds them: times, labels and thread names as the manifest says.
    assert rows(
        db,
        "SELECT run_id, labels, threads, started_at = CAST(? AS TIMESTAMPTZ) FROM runs ORDER BY 1",
        [manifest["started_at"]],
    ) == [(run_id, {"suite": "good"}, threads, True) for run_id in _run_ids(runs)]


def _thread_id_past_int64(run_dir: Path) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    _manifest(run_dir, threads={**manifest.get("threads", {}), "9999999999999999999": "huge"})


def test_a_run_that_fails_inside_a_shared_transaction_is_quarantined_alone(tmp_path, good_run, symbol_cache) -> None:
    """A shared transaction whose data fails is loaded again run by run: the run at fault is
    quarantined for its own reason, the others of its transaction go in, as they would alone."""
    runs = tmp_path / "runs"
    _copy(good_run, runs, "a-good")
    DAMAGE["attrs"][0](_copy(good_run, runs, "b-attrs"))
    _copy(good_run, runs, "c-good")
    _thread_id_past_int64(_copy(good_run, runs, "d-threads"))
    _copy(good_run, runs, "e-good")
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=5)
    alone = _ingested_alone(tmp_path, runs, symbol_cache)
    reasons = {o.path.name: o.reason for o in summary.quarantined}
    assert sorted(reasons) == ["b-attrs", "d-threads"]
    assert "attributes that are not JSON" in reasons["b-attrs"]
    assert "d-threads" in reasons["d-threads"] and "manifest values cannot be stored" in reasons["d-threads"]
    assert summary.ingested == 3
    assert snapshot(db, exclude_ingest_times=True) == snapshot(alone, exclude_ingest_times=True)
    assert rows(db, "SELECT list(run_number ORDER BY run_number) FROM runs") == [([1, 2, 3],)]
    assert rows(db, "SELECT count(*) FROM run_modules ANTI JOIN modules USING (module_key)") == [(0,)]


def test_a_transactions_share_of_its_batch_is_the_rows_of_its_runs() -> None:
    """`ByRun` gives each transaction the rows of its runs (one run, or several in a row), in the
    batch's order, as a scan of the whole batch would: rows and table rows alike, for runs in any
    order of the rows, runs without rows, and indices past the last run."""
    import numpy as np

    from tbpipe.pipeline.db.ingest.lay_out import ByRun

    generator = np.random.default_rng(7)
    run_of_row = generator.integers(0, 9, 500)
    run_of_row[run_of_row == 4] = 3  # run 4 has no rows
    table = pa.table({"row": np.arange(len(run_of_row)), "run": run_of_row})
    grouped = ByRun(run_of_row)
    for runs in [range(i, i + 1) for i in range(10)] + [range(0, 3), range(2, 6), range(5, 9), range(0, 9)]:
        expected = np.flatnonzero((run_of_row >= runs.start) & (run_of_row < runs.stop))
        assert grouped.rows_of(runs).tolist() == expected.tolist(), runs
        in_run_order = grouped.in_run_order(table)
        assert grouped.table_of(table, in_run_order, runs)["row"].to_pylist() == expected.tolist(), runs
    assert grouped.rows_of(range(4, 5)).tolist() == []


# --------------------------------------------------------------------------------------- transactions beside each other


def _ingested_one_by_one(tmp_path: Path, runs: Path, cache: Path, skip: tuple[str, ...] = ()) -> Path:
    """The runs ingested by one ingest each, in order: nothing else is under way while one loads."""
    db = tmp_path / "one-by-one.duckdb"
    for run_dir in find_run_dirs([runs]):
        if run_dir.name not in skip:
            assert ingest(db, run_dir, cache=cache).ingested == 1
    return db


def _stored_alike(db: Path, other: Path) -> None:
    """The two databases hold the same rows, but for the numbers given to frames (a batch of runs
    laid out together numbers its distinct frames in another order than its runs laid out alone)."""
    ours, theirs = snapshot(db, exclude_ingest_times=True), snapshot(other, exclude_ingest_times=True)
    ours.pop("stack_frames"), theirs.pop("stack_frames")
    assert ours == theirs
    frames = "SELECT count(*), sum(hash(t)) FROM (SELECT * EXCLUDE (frame_id) FROM stack_frames) t"
    assert rows(db, frames) == rows(other, frames)


def test_the_next_transaction_loading_beside_changes_nothing_stored(tmp_path, symbol_cache) -> None:
    """While a transaction inserts its stacks and sites and commits, the next one's events load on a
    second connection, which cannot see the first one's rows (it began before they were committed):
    the site counts of stacks the run before brought in, the event names and modules it added, the
    ids given after its own must still come out as when every run is ingested alone. A transaction
    per run, so that there is a next one for each run."""
    runs = tmp_path / "runs"
    _synthetic_night(runs, 7)
    threads = []
    hooks = IngestHooks(loading_events=lambda _ids: threads.append(threading.current_thread().name))
    db = tmp_path / "together.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=1, hooks=hooks)
    assert summary.ok and summary.ingested == 7
    # Every run's events load on the events thread: the first one's beside the layout, every later
    # one's beside the run before.
    assert [name.startswith("tbpipe-events") for name in threads] == [True] * 7
    _stored_alike(db, _ingested_one_by_one(tmp_path, runs, symbol_cache))
    assert rows(db, "SELECT count(*) FROM site_counts WHERE site_id IS NULL") == [(0,)]


def _load_more_modules(run_dir: Path, *build_ids: str) -> None:
    """The run loaded more modules than its stacks use (each still gets its row in `modules`)."""

    def more(table: pa.Table) -> pa.Table:
        extra = []
        for k, build_id in enumerate(build_ids):
            row = table.slice(0, 1)
            for name, value in (
                ("module_index", pc.max(table["module_index"]).as_py() + 1 + k),
                ("path", f"/opt/extra/lib{build_id}.so"),
                ("build_id", build_id),
            ):
                index = row.schema.get_field_index(name)
                row = row.set_column(index, row.schema.field(name), pa.array([value], row.schema.field(name).type))
            extra.append(row)
        return pa.concat_tables([table, *extra])

    (part,) = run_dir.glob("modules-*.parquet")
    _rewrite(part, more)


def test_a_module_the_transaction_before_added_unseen_gets_one_row(tmp_path, good_run, symbol_cache) -> None:
    """The next run's transaction begins before the one before it commits, so it cannot see the
    `modules` row that one adds: a module both runs loaded first still gets one row, as does the
    module the later run adds."""
    runs = tmp_path / "runs"
    _copy(good_run, runs, "a")
    _load_more_modules(_copy(good_run, runs, "b"), "e0e0e0e0e0e0e0e001")
    _load_more_modules(_copy(good_run, runs, "c"), "e0e0e0e0e0e0e0e001", "e0e0e0e0e0e0e0e002")
    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache)
    assert summary.ok and summary.ingested == 3
    assert rows(
        db, "SELECT module_key, count(*) FROM modules WHERE path LIKE '/opt/extra/%' GROUP BY ALL ORDER BY 1"
    ) == [
        ("e0e0e0e0e0e0e0e001", 1),
        ("e0e0e0e0e0e0e0e002", 1),
    ]
    _stored_alike(db, _ingested_one_by_one(tmp_path, runs, symbol_cache))


def test_a_run_failing_while_the_next_one_loads_beside_it(tmp_path, symbol_cache) -> None:
    """A transaction fails at its end, after the next one began beside it on the other connection:
    that one is rolled back with it, laid out again without the failed run, and loaded; the database
    is the one the other runs make alone."""
    from tbpipe.pipeline.db.ingest.tables import QuarantineRun

    runs = tmp_path / "runs"
    _synthetic_night(runs, 5)
    victim = find_run_dirs([runs])[1]
    victim_id = json.loads((victim / "manifest.json").read_text())["run_id"]

    def before_commit(run_id: str) -> None:
        if run_id == victim_id:
            raise QuarantineRun("failed at the commit")

    db = tmp_path / "t.duckdb"
    summary = ingest(db, runs, cache=symbol_cache, hooks=IngestHooks(before_commit=before_commit))
    assert [o.path.name for o in summary.quarantined] == [victim.name]
    assert "failed at the commit" in summary.quarantined[0].reason
    assert summary.ingested == 4
    _stored_alike(db, _ingested_one_by_one(tmp_path, runs, symbol_cache, skip=(victim.name,)))
