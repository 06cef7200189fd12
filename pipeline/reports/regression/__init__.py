"""Nightly regression reports: what changed, call site by call site, between runs or against a window.

    from tbpipe.pipeline.reports.regression import ReportRequest, compare
    report = compare(con, ReportRequest(candidate="latest", window=7, group_by="commit"))
    report.regressions        # the flagged sites; report.to_json() is the versioned contract

- `select`   which runs each side sums over (RUN selectors, groups, the baseline window)
- `compute`  the comparison: exact counts against one baseline, a band against a window
- `stats`    the window's band for any per-site metric
- `accept`   accepted changes from a checked-in TOML file
- `model`    the request and the typed result that the JSON, Markdown and HTML renderings read
"""

from tbpipe.pipeline.reports.regression.accept import AcceptList, load_accept_file
from tbpipe.pipeline.reports.regression.compute import compare
from tbpipe.pipeline.reports.regression.model import (
    CHANGES,
    RegressionReport,
    ReportRequest,
    RunSet,
    SiteChange,
    Thresholds,
)
from tbpipe.pipeline.reports.regression.select import SelectionError

__all__ = [
    "CHANGES",
    "AcceptList",
    "RegressionReport",
    "ReportRequest",
    "RunSet",
    "SelectionError",
    "SiteChange",
    "Thresholds",
    "compare",
    "load_accept_file",
]
