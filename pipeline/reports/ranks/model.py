"""The typed result of `tbpipe ranks`: one job, its ranks, and the call sites where they disagree.

The JSON (`RanksReport.to_json`, `"format": 1`) is the contract for automation; the table, the
Markdown and the service's job page render the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tbpipe.pipeline.reports.regression.model import Frame
from tbpipe.pipeline.stacks import focus
from tbpipe.pipeline.stacks.focus import DEFAULT_RULES, FrameRules

FORMAT = 1


@dataclass(frozen=True)
class RanksRequest:
    job: str = "latest-job"  # a job selector: job=ID, latest-job, latest-job:K=V,...
    labels: dict[str, str] = field(default_factory=dict)  # only jobs of runs with these labels (latest-job)
    kinds: tuple[str, ...] = ()  # event kinds looked at; () = all
    # A rank diverges at a site when its count differs from the site's reference count (the median
    # over the ranks) by more than both thresholds: `relative` x the reference and `absolute` events.
    threshold_rel: float = 0.0
    threshold_abs: float = 0.0
    tracebacks: int = 20  # combined tracebacks fetched for the first N divergent sites
    top: int = 30  # sites in `sites` (the heat map): the divergent ones first, then the busiest


@dataclass(frozen=True)
class Site:
    """Where a call site is (the names people read; `key` is what matches across runs)."""

    key: str | None  # None: events without a stack
    function: str | None
    file: str | None
    line: int | None
    portable_file: str | None
    kind: str | None  # 'python' or 'native'

    def where(self) -> str:
        if self.key is None:
            return "(no stack)"
        place = f"{self.portable_file or self.file or '??'}:{self.line if self.line is not None else '?'}"
        return f"{self.function or '??'} ({place})" if self.kind == "python" else (self.function or "??")

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "function": self.function,
            "file": self.file,
            "line": self.line,
            "portable_file": self.portable_file,
            "kind": self.kind,
        }


@dataclass
class RankSite:
    """One (kind, name, call site) of the job with its events on every rank."""

    kind: str
    name: str
    site: Site
    counts_by_rank: dict[int, int]  # every rank of the job, 0 where it had none
    reference: float  # the count the ranks are compared with: their median (the lower middle one)
    outlier_ranks: list[int]  # the ranks past the thresholds from the reference
    traceback: list[Frame] | None = None  # the heaviest stack among the outlier ranks' events

    @property
    def divergent(self) -> bool:
        return bool(self.outlier_ranks)

    @property
    def total(self) -> int:
        return sum(self.counts_by_rank.values())

    def to_json(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "name": self.name,
            "site": self.site.to_json(),
            "counts_by_rank": {str(rank): count for rank, count in sorted(self.counts_by_rank.items())},
            "reference": self.reference,
            "outlier_ranks": list(self.outlier_ranks),
        }
        if self.traceback is not None:
            out["traceback"] = [vars(frame) for frame in self.traceback]
        return out


@dataclass(frozen=True)
class JobRun:
    """One run of the job: a rank's process (or one of its forked workers), the launcher, a helper."""

    run_id: str
    rank: int | None
    local_rank: int | None
    node: int | None
    role: str | None

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "rank": self.rank, "local_rank": self.local_rank, "node": self.node,
                "role": self.role}  # fmt: skip


@dataclass
class RanksReport:
    request: RanksRequest
    job: str
    ranks: list[int]
    runs: list[JobRun]
    divergent: list[RankSite]  # most outlying events first
    sites: list[RankSite]  # the heat map's rows: the divergent sites, then the busiest others (`request.top`)
    sites_compared: int  # (kind, name, site) rows looked at
    focus_rules: FrameRules = DEFAULT_RULES  # what the tracebacks' focus modes fold (the database's own code)

    def tracebacks_by_site(self) -> list[tuple[RankSite, list[RankSite]]]:
        """The divergent entries grouped by call site, in order: (the entry whose traceback stands for
        the site, every entry there). The names at one line (an op and the ops it calls) share one."""
        groups: dict[str | None, list[RankSite]] = {}
        for site in self.divergent:
            groups.setdefault(site.site.key, []).append(site)
        out = []
        for entries in groups.values():
            shown = next((e for e in entries if e.traceback is not None), None)
            if shown is not None:
                out.append((shown, entries))
        return out

    def traceback_text(self, site: RankSite, mode: str = focus.DEFAULT_MODE) -> str:
        """A divergent site's traceback as text, one frame a line, focused by `mode`."""
        lines = []
        for frame in focus.focus_frames(site.traceback or [], mode, self.focus_rules):
            if isinstance(frame, focus.StartUp) or frame.kind == "marker":
                lines.append(frame.text if isinstance(frame, focus.StartUp) else frame.function or "")
                continue
            where = frame.file or (frame.module.rsplit("/", 1)[-1] if frame.module else "??")
            notes = (" [inlined]" if frame.inlined else "") + (" [generated]" if frame.generated else "")
            line = frame.line if frame.line is not None else "?"
            lines.append(f"{where}:{line}:{frame.function or '??'}{notes}")
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        if len(self.ranks) < 2:
            return f"job {self.job}: {len(self.ranks)} rank, nothing to compare"
        if not self.divergent:
            return f"job {self.job}: {len(self.ranks)} ranks agree at all {self.sites_compared:,} sites"
        ranks = sorted({r for s in self.divergent for r in s.outlier_ranks})
        places = len({s.site.key for s in self.divergent})
        return (
            f"job {self.job}: ranks disagree at {places} call site{'s' if places != 1 else ''} "
            f"({len(self.divergent)} kind/name row{'s' if len(self.divergent) != 1 else ''}; outlier "
            f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "job": self.job,
            "ranks": self.ranks,
            "runs": [run.to_json() for run in self.runs],
            "thresholds": {"relative": self.request.threshold_rel, "absolute": self.request.threshold_abs},
            "sites_compared": self.sites_compared,
            "verdict": self.verdict,
            "divergent": [site.to_json() for site in self.divergent],
        }
