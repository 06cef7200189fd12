"""What an ingest is asked to do and what came of it: options, one outcome per run, the summary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tbpipe.pipeline.db.ingest.tuning import IngestLimits

if TYPE_CHECKING:
    from tbpipe.pipeline.symbols.debuginfod import DebuginfodSettings

DEFAULT_WAIT_S = 600.0


def _ignore(*_args: object) -> None:
    pass


@dataclass(frozen=True)
class IngestHooks:
    """Calls at the seams between the ingest's stages, for tests and tools that watch it (each on
    the thread doing that work); an exception raised by one fails that step as a real error would."""

    # A run folder read ahead, on a reading thread: (folder, read with its stacks' frames or not).
    run_read: Callable[[Path, bool], None] = _ignore
    # A batch about to be laid out, on the loading thread: its runs' ids.
    laying_out: Callable[[list[str]], None] = _ignore
    # A transaction's events about to load (on the events thread, or the loading thread): run ids.
    loading_events: Callable[[list[str]], None] = _ignore
    # A transaction about to insert its other rows and commit, on the loading thread: run ids.
    finishing: Callable[[list[str]], None] = _ignore
    # The last moment of each run's transaction, before the commit: the run id.
    before_commit: Callable[[str], None] = _ignore


@dataclass
class IngestOptions:
    db_path: Path | None = None  # None: $TBPIPE_DB or ./tbpipe.duckdb
    debug_dirs: Sequence[Path] = ()
    cache_dir: Path | None = None  # the symbol store; None: $TBPIPE_CACHE_DIR or the user cache dir
    user_code: Sequence[str] = ()  # PREFIX (user code) or !PREFIX (not user code), kept in the database
    wait_s: float = DEFAULT_WAIT_S  # how long to wait for another ingest holding the database
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    jobs: int | None = None  # symbolizer worker processes (None: all CPUs)
    # A run folder whose manifest is lost is quarantined; with this, what its parts hold is loaded
    # as an incomplete run (rawrun.recovered_manifest), the folder left as it is.
    recover_manifests: bool = False
    # Runs loaded in one transaction (consecutive runs of a batch). None (the default): consecutive
    # runs share one while together they load at most `limits.rows_per_transaction` rows, so a night
    # of small runs pays the per-transaction costs once per group and a big run goes alone. 1: each
    # run alone, a kill loses no run already loaded. Either way each run goes in whole or not at all,
    # and a group whose data fails is loaded again run by run to quarantine the run at fault.
    runs_per_transaction: int | None = None
    debuginfod: DebuginfodSettings | None = None  # servers asked for debug info; None: $DEBUGINFOD_URLS
    limits: IngestLimits = field(default_factory=IngestLimits)
    hooks: IngestHooks = field(default_factory=IngestHooks)


@dataclass
class RunOutcome:
    path: Path
    status: str  # 'ingested', 'updated' (an incomplete run loaded again), 'present' or 'quarantined'
    run_id: str | None = None
    complete: bool | None = None
    events: int = 0
    new_stacks: int = 0
    reason: str | None = None  # why it was quarantined
    notes: list[str] = field(default_factory=list)


@dataclass
class UnsymbolizedGroup:
    """Unsymbolized native frames (of the stacks this ingest added) that share a reason."""

    reason: str
    frames: int = 0
    modules: dict[str, str] = field(default_factory=dict)  # module key -> path


@dataclass
class IngestSummary:
    db_path: Path
    outcomes: list[RunOutcome] = field(default_factory=list)
    frames_symbolized: int = 0
    frames_unsymbolized: int = 0
    unsymbolized: dict[str, UnsymbolizedGroup] = field(default_factory=dict)
    refreshed_modules: list[str] = field(default_factory=list)  # build-IDs re-symbolized with better debug info
    debuginfod: list[str] = field(default_factory=list)  # a line per debuginfod server asked: files, failures
    user_code: list[tuple[str, bool]] = field(default_factory=list)  # rules set by this ingest
    seconds: float = 0.0

    def _count(self, *statuses: str) -> int:
        return sum(1 for o in self.outcomes if o.status in statuses)

    @property
    def ingested(self) -> int:
        return self._count("ingested", "updated")

    @property
    def present(self) -> int:
        return self._count("present")

    @property
    def incomplete(self) -> int:
        return sum(1 for o in self.outcomes if o.status in ("ingested", "updated") and not o.complete)

    @property
    def quarantined(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if o.status == "quarantined"]

    @property
    def events(self) -> int:
        return sum(o.events for o in self.outcomes)

    @property
    def new_stacks(self) -> int:
        return sum(o.new_stacks for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not self.quarantined
