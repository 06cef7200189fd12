"""The regression report's types: what is asked, and the typed result every rendering reads.

`compare()` fills a `RegressionReport`; the JSON, Markdown and HTML renderings and the service's
pages only read it. Counts are floats because `--per` normalises them (events per marker event).
GPU time per site is a second metric beside the counts (`GpuSiteChange`, `gpu_sites`), with its
own thresholds and verdict: the counts' comparison, verdict and exit status do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tbpipe.pipeline.stacks.focus import DEFAULT_RULES, FrameRules

if TYPE_CHECKING:
    from tbpipe.pipeline.reports.regression.suspects import Suspect, SuspectHistory

FORMAT_VERSION = 1

# What happened to one (kind, name, site) between baseline and candidate.
NEW, REMOVED, INCREASED, DECREASED, MOVED, UNCHANGED = "new", "removed", "increased", "decreased", "moved", "unchanged"
CHANGES = (NEW, REMOVED, INCREASED, DECREASED, MOVED, UNCHANGED)
# The changes that make a regression: more work, or work from a new place.
REGRESSING = (NEW, INCREASED)
# Where work done in autograd's backward is counted: at its own stack's site (where backward() ran,
# for CPU backward), or at the site of the forward op that made its node (view `backward_op_sites`).
SITE_OF = ("own", "forward")


@dataclass(frozen=True)
class Thresholds:
    """A count change is flagged only when it is past both (strictly)."""

    relative: float = 0.0  # |candidate - baseline| / baseline
    absolute: float = 0.0  # |candidate - baseline|, in events (or events per marker with --per)


@dataclass(frozen=True)
class ReportRequest:
    candidate: str  # RUN: a run id, `latest`, `latest:K=V,...` or a group `K=V`
    baseline: str | None = None  # RUN, or None with `window`
    window: int | None = None  # compare with the N previous runs (or groups)
    labels: dict[str, str] = field(default_factory=dict)  # only runs with these labels are considered
    kinds: tuple[str, ...] = ()  # event kinds compared; () = all
    per: tuple[str, str] | None = None  # (kind, name) of the marker events each run's counts are divided by
    thresholds: Thresholds = field(default_factory=Thresholds)
    group_by: str | None = None  # label whose value makes a group of runs (e.g. 'commit'); None: single runs
    vary: tuple[str, ...] = ("commit",)  # labels allowed to differ between candidate and its window
    tracebacks: int = 50  # combined tracebacks fetched for the first N flagged sites
    spread: float = 3.0  # window tier: half-width of the band in robust standard deviations (1.4826 MAD)
    # GPU time per site: flagged past both (in ns, or ns per marker with --per); a single baseline
    # also needs the per-execution mean to move by `spread` standard errors, or the count to change.
    gpu_thresholds: Thresholds = field(default_factory=lambda: Thresholds(relative=0.10, absolute=0.0))
    site_of: str = "own"  # one of SITE_OF
    # Suspects: the commits between the two sides that changed code on each regressed site's stacks,
    # read from the git repository `repo` (None: the working folder's checkout, else one the runs ran in).
    suspects: bool = False
    repo: str | None = None


@dataclass
class RunSet:
    """The runs one side of the comparison sums over: a single run, or a group sharing a label value."""

    name: str  # how people see it: the run id, or 'commit=abc123'
    run_ids: list[str]
    labels: dict[str, str]  # the labels all its runs share
    started_at: str | None  # the earliest start, ISO-8601 UTC
    markers: float | None = None  # with --per: the marker events the counts were divided by

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "run_ids": self.run_ids,
            "labels": self.labels,
            "started_at": self.started_at,
            "markers": self.markers,
        }


@dataclass
class Spread:
    """How a site's metric varied over the baseline window (one value per run or group, oldest first)."""

    values: list[float]
    median: float
    mad: float  # median absolute deviation
    low: float  # the band the candidate must leave to be flagged
    high: float
    method: str  # 'min-max' (few runs) or 'median-mad'


@dataclass
class Frame:
    kind: str  # 'python', 'native' or 'marker'
    function: str | None
    file: str | None
    line: int | None
    module: str | None
    inlined: bool
    generated: bool = False  # a frame of code torch.compile or Triton generated (never a site)


def where(portable_file: str | None, file: str | None, line: int | None) -> str:
    """`file:line` of a site as people read it (the portable file when there is one)."""
    return f"{portable_file or file or '??'}:{line if line is not None else '?'}"


@dataclass
class SiteChange:
    kind: str
    name: str
    site_key: str | None  # None: events without a stack
    site_function: str | None
    site_file: str | None  # where the site is in the candidate (else in the baseline)
    site_line: int | None
    site_portable_file: str | None
    baseline_events: float
    candidate_events: float
    change: str  # one of CHANGES
    baseline_line: int | None = None  # where the site was in the baseline, when it moved
    site_known: bool = True  # new: the site had other names in the baseline (a new kernel at a known site)
    flagged: bool = False
    accepted: str | None = None  # why an --accept entry lets it pass
    spread: Spread | None = None
    traceback: list[Frame] | None = None
    suspects: list[Suspect] | None = None  # None: not looked for (see RegressionReport.history)

    @property
    def delta(self) -> float:
        return self.candidate_events - self.baseline_events

    @property
    def relative(self) -> float | None:
        return self.delta / self.baseline_events if self.baseline_events else None

    @property
    def where(self) -> str:
        return where(self.site_portable_file, self.site_file, self.site_line)

    def to_json(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "name": self.name,
            "site_key": self.site_key,
            "site_function": self.site_function,
            "site_file": self.site_file,
            "site_line": self.site_line,
            "site_portable_file": self.site_portable_file,
            "baseline_events": self.baseline_events,
            "candidate_events": self.candidate_events,
            "change": self.change,
            "delta": self.delta,
            "relative": self.relative,
            "baseline_line": self.baseline_line,
            "site_known": self.site_known,
            "flagged": self.flagged,
            "accepted": self.accepted,
            "spread": None if self.spread is None else vars(self.spread),
            "suspects": suspects_json(self.suspects),
        }
        if self.traceback is not None:
            out["traceback"] = [vars(frame) for frame in self.traceback]
        return out


def suspects_json(suspects: list[Suspect] | None) -> list[dict[str, Any]] | None:
    return None if suspects is None else [s.to_json() for s in suspects]


@dataclass
class GpuSiteChange:
    """GPU time of one (activity kind, name, launch site): the second metric of the report."""

    kind: str  # activity kind: 'kernel', 'memcpy', 'memset'
    name: str  # kernel name, copy kind ('HtoD', ...) or 'memset'
    site_key: str | None  # the launch site; None: launches not recorded
    site_function: str | None
    site_file: str | None
    site_line: int | None
    site_portable_file: str | None
    launch_kind: str | None  # 'kernel_launch', 'graph_launch', 'memcpy', 'memset'
    baseline_ns: float  # summed GPU time (per marker with --per); the window's median in a window
    candidate_ns: float
    baseline_executions: float
    candidate_executions: float
    baseline_mean_ns: float | None  # per execution
    candidate_mean_ns: float | None
    change: str  # one of CHANGES but 'moved'
    z: float | None = None  # single baseline: the per-execution mean's shift in standard errors
    flagged: bool = False
    accepted: str | None = None
    spread: Spread | None = None  # window: the band of the summed GPU time
    traceback: list[Frame] | None = None
    suspects: list[Suspect] | None = None

    @property
    def delta(self) -> float:
        return self.candidate_ns - self.baseline_ns

    @property
    def relative(self) -> float | None:
        return self.delta / self.baseline_ns if self.baseline_ns else None

    @property
    def where(self) -> str:
        return where(self.site_portable_file, self.site_file, self.site_line)

    def to_json(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "name": self.name,
            "site_key": self.site_key,
            "site_function": self.site_function,
            "site_file": self.site_file,
            "site_line": self.site_line,
            "site_portable_file": self.site_portable_file,
            "launch_kind": self.launch_kind,
            "baseline_ns": self.baseline_ns,
            "candidate_ns": self.candidate_ns,
            "delta_ns": self.delta,
            "relative": self.relative,
            "baseline_executions": self.baseline_executions,
            "candidate_executions": self.candidate_executions,
            "baseline_mean_ns": self.baseline_mean_ns,
            "candidate_mean_ns": self.candidate_mean_ns,
            "change": self.change,
            "z": self.z,
            "flagged": self.flagged,
            "accepted": self.accepted,
            "spread": None if self.spread is None else vars(self.spread),
            "suspects": suspects_json(self.suspects),
        }
        if self.traceback is not None:
            out["traceback"] = [vars(frame) for frame in self.traceback]
        return out


@dataclass
class EnvironmentDifference:
    what: str  # 'torch_version', 'label commit', 'module libtorch_cpu.so', ...
    baseline: str | None
    candidate: str | None


@dataclass
class RegressionReport:
    request: ReportRequest
    candidate: RunSet
    baseline: list[RunSet]  # one set, or the window (oldest first)
    environment: list[EnvironmentDifference]
    sites: list[SiteChange]  # every compared (kind, name, site), flagged first, then by size of change
    expired_accepts: list[str] = field(default_factory=list)  # --accept entries past their date
    seconds: float = 0.0
    gpu_sites: list[GpuSiteChange] = field(default_factory=list)  # GPU time per site, flagged first
    history: SuspectHistory | None = None  # where the suspects came from; None when not asked for
    focus_rules: FrameRules = DEFAULT_RULES  # what the tracebacks' focus modes fold (the database's own code)

    @property
    def gpu_regressions(self) -> list[GpuSiteChange]:
        return [s for s in self.gpu_sites if s.flagged]

    def gpu_verdict(self) -> str:
        """One line on GPU time per site (the counts' verdict says nothing about it)."""
        if not self.gpu_sites:
            return "GPU time: not compared (no GPU activity recorded on both sides)"
        slower = self.gpu_regressions
        if not slower:
            return f"GPU time: no site slower ({len(self.gpu_sites)} sites compared)"
        new = sum(1 for s in slower if s.change == NEW)
        return (
            f"GPU time: {len(slower)} site{'s' if len(slower) != 1 else ''} slower"
            + (f" ({new} new)" if new else "")
            + f" ({len(self.gpu_sites)} sites compared)"
        )

    @property
    def regressions(self) -> list[SiteChange]:
        return [s for s in self.sites if s.flagged]

    @property
    def accepted(self) -> list[SiteChange]:
        return [s for s in self.sites if s.accepted is not None]

    @property
    def windowed(self) -> bool:
        return self.request.window is not None

    def count(self, change: str) -> int:
        return sum(1 for s in self.sites if s.change == change)

    def verdict(self) -> str:
        """One line: what a CI comment starts with."""
        regressions = self.regressions
        against = (
            f"{len(self.baseline)} previous {'group' if self.request.group_by else 'run'}"
            + ("s" if len(self.baseline) != 1 else "")
            if self.windowed
            else self.baseline[0].name
        )
        if not regressions:
            accepted = f", {len(self.accepted)} accepted" if self.accepted else ""
            return (
                f"No regressions: {self.candidate.name} against {against} ({len(self.sites)} sites compared{accepted})"
            )
        new = sum(1 for s in regressions if s.change == NEW)
        parts = []
        if new:
            parts.append(f"{new} new")
        if len(regressions) > new:
            parts.append(f"{len(regressions) - new} increased")
        count = f"{len(regressions)} regression{'s' if len(regressions) != 1 else ''}"
        return f"{count} ({', '.join(parts)}): {self.candidate.name} against {against}"

    def to_json(self) -> dict[str, Any]:
        request = self.request
        return {
            "format": FORMAT_VERSION,
            "verdict": self.verdict(),
            "ok": not self.regressions,
            "candidate": self.candidate.to_json(),
            "baseline": [s.to_json() for s in self.baseline],
            "mode": "window" if self.windowed else "pair",
            "thresholds": {"relative": request.thresholds.relative, "absolute": request.thresholds.absolute},
            "per": None if request.per is None else {"kind": request.per[0], "name": request.per[1]},
            "group_by": request.group_by,
            "site_of": request.site_of,
            "environment": [vars(e) for e in self.environment],
            "counts": {change: self.count(change) for change in CHANGES},
            "sites": [s.to_json() for s in self.sites],
            "regressions": [s.to_json() for s in self.regressions],
            "accepted": [s.to_json() for s in self.accepted],
            "expired_accepts": self.expired_accepts,
            "history": None if self.history is None else self.history.to_json(),
            "gpu_time": {
                "verdict": self.gpu_verdict(),
                "ok": not self.gpu_regressions,
                "thresholds": {
                    "relative": request.gpu_thresholds.relative,
                    "absolute_ns": request.gpu_thresholds.absolute,
                },
                "counts": {change: sum(1 for s in self.gpu_sites if s.change == change) for change in CHANGES},
                "sites": [s.to_json() for s in self.gpu_sites],
                "regressions": [s.to_json() for s in self.gpu_regressions],
                "accepted": [s.to_json() for s in self.gpu_sites if s.accepted is not None],
            },
        }
