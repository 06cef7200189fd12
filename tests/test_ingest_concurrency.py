"""Kills and concurrent processes: an ingest killed inside a transaction leaves the database as it
was before that transaction (and before the one loading beside it), and the next ingest finishes the
job; a second ingest waits or fails clearly; readers are refused while an ingest writes; a failed
load ends the thread preparing runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TBPIPE
from support.ingest import _copy, _ingested_alone, _run_ids, _words, ingest, rows, snapshot

from tbpipe.pipeline.db import open_database
from tbpipe.pipeline.db.ingest import IngestHooks, IngestLimits

PAUSING_INGEST = """
import sys, time
from pathlib import Path
import tbpipe.pipeline.db.ingest as ingest_module


def before_commit(run_id):
    if run_id == victim:
        Path(marker).write_text("inside the transaction")
        deadline = time.monotonic() + 300
        while not Path(release).exists():
            if time.monotonic() > deadline:
                sys.exit("never released")
            time.sleep(0.02)


# Guarded: with a cold symbol store the symbolizer starts a forkserver pool, which imports this
# script again as __mp_main__.
if __name__ == "__main__":
    runs, db, cache, victim, marker, release, per_transaction = sys.argv[1:8]
    options = ingest_module.IngestOptions(
        db_path=Path(db),
        cache_dir=Path(cache),
        progress=False,
        runs_per_transaction=int(per_transaction),
        hooks=ingest_module.IngestHooks(before_commit=before_commit),
    )
    summary = ingest_module.ingest_runs([Path(runs)], options)
    print("ingested", summary.ingested)
"""


class PausingIngest:
    """An ingest in a child process that stops inside the victim run's transaction, holding the
    database, until `release()` (or until it is killed)."""

    def __init__(self, tmp_path: Path, runs: Path, db: Path, cache: Path, victim: str, runs_per_transaction: int = 1):
        script = tmp_path / "pausing_ingest.py"
        script.write_text(PAUSING_INGEST)
        marker = tmp_path / f"marker-{victim}"
        self.release_file = tmp_path / f"release-{victim}"
        self.process = subprocess.Popen(
            [
                *(sys.executable, str(script), str(runs), str(db), str(cache), victim),
                *(str(marker), str(self.release_file), str(runs_per_transaction)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 240
        while not marker.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"ingest ended early: {self.process.communicate()}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"ingest never reached the victim run's commit: {self.process.communicate()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.process.pid

    def release(self) -> tuple[str, str]:
        """Lets the ingest commit and finish; its (stdout, stderr)."""
        self.release_file.write_text("go on")
        return self.process.communicate(timeout=240)


def test_killed_ingest_leaves_the_database_as_before(tmp_path, good_run, symbol_cache) -> None:
    runs = tmp_path / "runs"
    first = _copy(good_run, runs, "a-first")
    _copy(good_run, runs, "b-second")
    first_id, second_id = _run_ids(runs)
    # The same first run alone, ingested into another database: what the killed one must equal.
    reference = tmp_path / "reference.duckdb"
    ingest(reference, first, cache=symbol_cache)

    db = tmp_path / "t.duckdb"
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, second_id)
    holder.process.send_signal(signal.SIGKILL)  # in the middle of the second run's transaction
    holder.process.communicate(timeout=30)
    assert rows(db, "SELECT run_id FROM runs") == [(first_id,)]
    assert snapshot(db, exclude_ingest_times=True) == snapshot(reference, exclude_ingest_times=True)
    # The lock died with the process, and the next ingest finishes the job.
    summary = ingest(db, runs, cache=symbol_cache)
    assert (summary.ingested, summary.present) == (1, 1)
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted([first_id, second_id])


def test_killed_ingest_loses_only_the_transaction_in_progress(tmp_path, good_run, symbol_cache) -> None:
    """Runs sharing a transaction go in together or not at all: a kill inside it loses them all
    (and nothing else), and the next ingest loads them."""
    runs = tmp_path / "runs"
    for name in ("a", "b", "c"):
        _copy(good_run, runs, name)
    first_id, second_id, third_id = _run_ids(runs)
    # The symbol store warmed first: a symbolizer pool started by the killed ingest would outlive it.
    ingest(tmp_path / "warm.duckdb", runs / "a", cache=symbol_cache)
    db = tmp_path / "t.duckdb"
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, third_id, runs_per_transaction=2)
    holder.process.send_signal(signal.SIGKILL)  # inside the second transaction: the third run alone
    holder.process.communicate(timeout=30)
    assert sorted(rows(db, "SELECT run_id FROM runs")) == sorted([(first_id,), (second_id,)])
    assert rows(db, "SELECT count(*) FROM event_rows WHERE run_number > 2") == [(0,)]
    summary = ingest(db, runs, cache=symbol_cache, runs_per_transaction=2)
    assert (summary.ingested, summary.present) == (1, 2)
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)


def test_killed_ingest_loses_the_run_loading_beside_the_one_in_progress(tmp_path, good_run, symbol_cache) -> None:
    """Killed while a run's transaction commits, with the next run's events already loading on the
    other connection: both runs are lost, the one before stays, and the next ingest loads the two."""
    runs = tmp_path / "runs"
    for name in ("a", "b", "c"):
        _copy(good_run, runs, name)
    first_id, second_id, _third_id = _run_ids(runs)
    ingest(tmp_path / "warm.duckdb", runs / "a", cache=symbol_cache)  # (see above)
    db = tmp_path / "t.duckdb"
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, second_id, runs_per_transaction=1)
    holder.process.send_signal(signal.SIGKILL)
    holder.process.communicate(timeout=30)
    assert rows(db, "SELECT run_id FROM runs") == [(first_id,)]
    assert rows(db, "SELECT count(*) FROM event_rows WHERE run_number > 1") == [(0,)]
    summary = ingest(db, runs, cache=symbol_cache)
    assert (summary.ingested, summary.present) == (2, 1)
    assert snapshot(db, exclude_ingest_times=True) == snapshot(_ingested_alone(tmp_path, runs, symbol_cache), True)


def test_concurrent_ingests_wait_or_fail_clearly(tmp_path, good_run, symbol_cache) -> None:
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    _copy(good_run, one, "one")
    _copy(good_run, two, "two")
    _copy(good_run, three, "three")
    db = tmp_path / "t.duckdb"
    # A narrow terminal: the messages wrap, and the checks must not depend on where.
    env = dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache), COLUMNS="50")
    holder = PausingIngest(tmp_path, one, db, symbol_cache, _run_ids(one)[0])
    patient_err = tmp_path / "patient.err"
    try:
        impatient = subprocess.run(
            [*TBPIPE, "ingest", str(three), "--db", str(db), "--wait", "0"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        with open(patient_err, "w") as err:
            patient = subprocess.Popen(
                [*TBPIPE, "ingest", str(two), "--db", str(db), "--wait", "240"],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        # The holder keeps the database until the patient one says that it waits.
        deadline = time.monotonic() + 240
        while "waiting for another ingest" not in _words(patient_err.read_text()):
            assert patient.poll() is None, f"the second ingest did not wait: {patient_err.read_text()}"
            assert time.monotonic() < deadline, "the second ingest never said that it waits"
            time.sleep(0.02)
    finally:
        _out, holder_err = holder.release()
    patient.communicate(timeout=240)
    assert holder.process.returncode == 0, holder_err
    assert impatient.returncode == 2, impatient.stderr
    assert f"another ingest (pid {holder.pid}) is writing it" in _words(impatient.stderr)
    assert "Traceback" not in impatient.stderr
    assert patient.returncode == 0, patient_err.read_text()
    assert f"waiting for another ingest (pid {holder.pid})" in _words(patient_err.read_text())
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted(_run_ids(one) + _run_ids(two))


def test_readers_are_refused_while_an_ingest_writes(tmp_path, good_run, symbol_cache) -> None:
    from tbpipe.pipeline.db import DatabaseBusyError

    runs = tmp_path / "runs"
    _copy(good_run, runs, "only")
    db = tmp_path / "t.duckdb"
    ingest(db, tmp_path / "runs", cache=symbol_cache)  # the file exists before the writer holds it
    _copy(good_run, runs, "more")
    holder = PausingIngest(tmp_path, runs, db, symbol_cache, "20260101T000000-1-more")
    try:
        with pytest.raises(DatabaseBusyError, match="another process is writing the database"):
            open_database(db, read_only=True)
    finally:
        _out, err = holder.release()
    assert holder.process.returncode == 0, err
    assert sorted(r[0] for r in rows(db, "SELECT run_id FROM runs")) == sorted(_run_ids(runs))


def test_a_failed_load_stops_the_thread_preparing_runs(tmp_path, good_run, symbol_cache) -> None:
    """The ingest fails on a database error; the thread that prepares runs ahead ends with it rather
    than waiting, with prepared runs in memory, for a loader that is gone (as in a long-lived service)."""
    import threading

    from tbpipe.pipeline.db.connection import DatabaseError

    runs = tmp_path / "runs"
    for name in ("a", "b", "c", "d"):
        _copy(good_run, runs, name)

    def fail(_run_ids):
        raise DatabaseError("the disk is full")

    with pytest.raises(DatabaseError, match="the disk is full"):
        ingest(
            tmp_path / "t.duckdb",
            runs,
            cache=symbol_cache,
            hooks=IngestHooks(finishing=fail),
            limits=IngestLimits(batch_runs=1),
        )
    assert not [t for t in threading.enumerate() if t.name == "tbpipe-prepare"]
