"""`tbpipe ranks`: the call sites where the ranks of one job disagree.

    from tbpipe.pipeline.reports.ranks import RanksRequest, divergence
    report = divergence(con, RanksRequest(job="latest-job"))
    report.divergent          # RankSite: counts_by_rank, outlier_ranks, traceback; report.to_json()

- `model`     the request and the typed result that the renderings read
- `compute`   the comparison over `rank_site_counts` (sql/ranks.sql)
- `markdown`, `table`  renderings (the service's job page is another)
"""

from tbpipe.pipeline.reports.ranks.compute import NoRanksError, divergence, job_of
from tbpipe.pipeline.reports.ranks.model import JobRun, RankSite, RanksReport, RanksRequest, Site

__all__ = ["JobRun", "NoRanksError", "RankSite", "RanksReport", "RanksRequest", "Site", "divergence", "job_of"]
