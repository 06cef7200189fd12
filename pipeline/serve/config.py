"""What `tbpipe serve` was asked to do: one value object the app factory and the services read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tbpipe.pipeline.db.ingest import IngestOptions
from tbpipe.pipeline.db.retain import RetainPolicy
from tbpipe.pipeline.serve.upload import MAX_EXPANSION

MiB = 1 << 20


@dataclass
class ServeConfig:
    db_path: Path
    host: str = "127.0.0.1"
    port: int = 8000
    watch: list[Path] = field(default_factory=list)
    token: str | None = None  # None: every write refused
    uploads_dir: Path | None = None  # None: `<db>.uploads` beside the database
    max_upload_bytes: int = 512 * MiB
    max_unpacked_bytes: int | None = None  # None: 4 x max_upload_bytes
    max_expansion: float | None = MAX_EXPANSION  # unpacked bytes per archive byte at most (None: no ratio)
    idle_s: float = 30.0  # a run still being written is ingested after this long without change
    poll_s: float = 1.0
    query_timeout_s: float = 10.0
    query_max_rows: int = 10_000
    open_wait_s: float = 10.0
    ingest: IngestOptions = field(default_factory=IngestOptions)
    repo: Path | None = None  # git repository of the comparisons' suspects (None: the working folder's, else the runs')
    # `tbpipe retain` on a schedule (`--retain-*`): None, never; the folder rules are off unless given.
    retain: RetainPolicy | None = None
    retain_every_s: float = 24 * 3600.0
    keep_quarantined_days: float | None = None
    delete_ingested_runs_after_days: float | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def uploads(self) -> Path:
        return self.uploads_dir or self.db_path.with_name(self.db_path.name + ".uploads")

    @property
    def unpacked_limit(self) -> int:
        return self.max_unpacked_bytes or 4 * self.max_upload_bytes
