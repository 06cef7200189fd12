"""Retention on a schedule (`tbpipe serve --retain-keep-runs N ...`): every `retain_every_s` (the
first time when the service starts), one job in the ingest service's queue that does what `tbpipe
retain` does with the same options, in the writer's turn, so it never meets an ingest: old runs
rolled up, then quarantined uploads and ingested run folders (of the watched folders and of the
uploads) aged out where asked."""

from __future__ import annotations

import logging

from tbpipe.pipeline.db.connection import open_database
from tbpipe.pipeline.db.retain import FolderPolicy, age_out_folders, retain
from tbpipe.pipeline.serve.background import PollingThread
from tbpipe.pipeline.serve.config import ServeConfig
from tbpipe.pipeline.serve.ingest import IngestJob, IngestService

log = logging.getLogger("tbpipe.serve.retain")


def folder_policy(config: ServeConfig) -> FolderPolicy:
    return FolderPolicy(
        uploads=config.uploads,
        keep_quarantined_days=config.keep_quarantined_days,
        run_roots=(*config.watch, config.uploads),
        delete_ingested_after_days=config.delete_ingested_runs_after_days,
    )


class Retainer(PollingThread):
    name = "tbpipe-retain"
    failure = "scheduling a retain failed"
    log = log

    def __init__(self, config: ServeConfig, ingest: IngestService):
        super().__init__(config.retain_every_s)
        self.config = config
        self.ingest = ingest
        self.last: IngestJob | None = None

    def step(self) -> None:
        if self.last is not None and not self.last.done.is_set():
            return  # the one before has not had its turn yet
        self.last = self.ingest.submit_task(self.run_once, "retain")

    def run_once(self) -> str:
        """One retain, the database open for writing (`ServedDatabase.writing`); what it did, in a line."""
        config, parts = self.config, []
        if config.retain is not None:
            result = retain(config.db_path, config.retain, wait_s=config.open_wait_s)
            parts.append(
                f"rolled up {len(result.runs):,} run{'s' if len(result.runs) != 1 else ''} "
                f"({result.events:,} events let go; {result.kept:,} kept, {config.retain.describe()})"
            )
        folders = folder_policy(config)
        if folders.active:
            con = open_database(config.db_path, wait_s=config.open_wait_s)
            try:
                aged = age_out_folders(con, folders)
            finally:
                con.close()
            parts.append(f"aged out {len(aged):,} folders ({sum(a.bytes for a in aged) / 1e6:,.1f} MB)")
        return "; ".join(parts)
