"""What an ingest has to do, found before the stages that read runs are imported (they need numpy
and pyarrow; an ingest whose runs are all loaded needs neither): which runs need reading, by their
folders and manifests against the runs the database holds (`LoadedRuns`), and whether the
database's upkeep before the runs has anything to do (`upkeep_due`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tbpipe.pipeline.db.connection import query_rows, query_value
from tbpipe.pipeline.db.ingest.outcomes import RunOutcome
from tbpipe.pipeline.db.ingest.user_code import rules_in_force
from tbpipe.pipeline.runfolder import DamagedRunError, MissingManifestError, parts_fingerprint, read_manifest


class LoadedRuns:
    """What the database holds of each run id: (complete, parts fingerprint), kept as runs load."""

    def __init__(self, rows: list[tuple[str, bool, str]]):
        self._runs = {run_id: (complete, parts) for run_id, complete, parts in rows}

    @classmethod
    def of(cls, con: Any) -> LoadedRuns:
        """The runs the database holds now."""
        return cls(query_rows(con, "SELECT run_id, complete, parts FROM runs"))

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._runs

    def loaded(self, run_id: str, complete: bool, fingerprint: str) -> None:
        self._runs[run_id] = (complete, fingerprint)

    def present(self, run_dir: Path, run_id: str, fingerprint: str) -> RunOutcome | None:
        """The run's outcome when the database holds it complete, or as it is now; None when it
        must be loaded."""
        existing = self._runs.get(run_id)
        if existing is not None and (existing[0] or existing[1] == fingerprint):
            return RunOutcome(run_dir, "present", run_id=run_id, complete=existing[0])
        return None


def outcomes_unread(run_dirs: list[Path], loaded: LoadedRuns, recover: bool) -> list[RunOutcome] | None:
    """Every run's outcome when none of them needs reading (each present in the database, or
    quarantined for its folder or manifest), as the stages would give them; None as soon as one
    needs reading (a lost manifest that `recover` rebuilds from the parts needs it too)."""
    outcomes = []
    for run_dir in run_dirs:
        try:
            manifest = read_manifest(run_dir)
            fingerprint = parts_fingerprint(run_dir, manifest)
        except MissingManifestError as error:
            if recover:
                return None
            outcomes.append(RunOutcome(run_dir, "quarantined", reason=str(error)))
            continue
        except DamagedRunError as error:
            outcomes.append(RunOutcome(run_dir, "quarantined", reason=str(error)))
            continue
        present = loaded.present(run_dir, manifest["run_id"], fingerprint)
        if present is None:
            return None
        outcomes.append(present)
    return outcomes


def upkeep_due(con: Any, rules: list[tuple[str, bool]]) -> bool:
    """Whether the upkeep an ingest does before its runs may change anything in the database: the
    old runs' site identity backfilled (`siting.backfill_site_identity`), the user-code rules stored
    and the stacks sited with them (`siting.store_user_code`). (Modules whose debug info got better
    are `debug_info`'s to find.)"""
    return not site_identity_backfilled(con) or not rules_in_force(con, rules)


def site_identity_backfilled(con: Any) -> bool:
    """Whether the runs of a database upgraded from schema 2 have had their site identity backfilled."""
    return query_value(con, "SELECT value FROM settings WHERE key = 'site_identity_backfilled'") == "1"
