-- Jobs and ranks: the runs of one launch of many processes (torchrun, SLURM, MPI,
-- torch.multiprocessing), which the capture labels `job`, `rank`, `local_rank`, `world_size`, `node`
-- and `role` from the launchers' environment (capture/ranks.py), and their counts per rank.
-- `tbpipe ranks` reads `rank_site_counts` to find the sites where a job's ranks disagree.
-- @requires counts

-- The runs of every job, with their rank labels as numbers.
-- @column run_number  `runs.run_number`
-- @column run_id      `runs.run_id`
-- @column job         label `job`: one id shared by every process of one launch
-- @column rank        label `rank`, the global rank; NULL for a launcher or a helper that runs no rank
-- @column local_rank  label `local_rank`, the rank on its node
-- @column world_size  label `world_size`, the number of ranks
-- @column node        label `node`, the node's (torchrun's group's) rank
-- @column role        label `role`: 'launcher' for a process that launched ranks and ran none
-- @column started_at  `runs.started_at`
CREATE OR REPLACE VIEW job_runs AS
SELECT
    run_number,
    run_id,
    labels['job'] AS job,
    TRY_CAST(labels['rank'] AS INTEGER) AS rank,
    TRY_CAST(labels['local_rank'] AS INTEGER) AS local_rank,
    TRY_CAST(labels['world_size'] AS INTEGER) AS world_size,
    TRY_CAST(labels['node'] AS INTEGER) AS node,
    labels['role'] AS role,
    started_at
FROM runs
WHERE labels['job'] IS NOT NULL;

-- Events per job, rank, kind/name and call site: the runs of one rank summed (a forked worker
-- counts with its rank), and a row of 0 events for every rank of the job without any of a site's
-- events that another of its ranks has, so that each site has one row per rank.
-- @column job       `job_runs.job`
-- @column rank      `job_runs.rank`
-- @column kind      event kind
-- @column name      event name (kernel, op, ...)
-- @column site_id   `sites.site_id`; NULL for events without a stack
-- @column site_key  `site_identity_key` of the site (`tbpipe show --site KEY`); NULL for events without a stack
-- @column events    number of events of this rank at this site
CREATE OR REPLACE VIEW rank_site_counts AS
WITH counted AS (
    SELECT j.job, j.rank, c.name_id, coalesce(c.site_id, -1) AS site, sum(c.events) AS events
    FROM run_site_counts c
    JOIN job_runs j ON j.run_number = c.run_number
    WHERE j.rank IS NOT NULL
    GROUP BY j.job, j.rank, c.name_id, coalesce(c.site_id, -1)
), job_ranks AS (
    SELECT DISTINCT job, rank FROM job_runs WHERE rank IS NOT NULL
), job_sites AS (
    SELECT DISTINCT job, name_id, site FROM counted
)
SELECT
    s.job,
    r.rank,
    n.kind,
    n.name,
    CASE WHEN s.site >= 0 THEN s.site END AS site_id,
    t.site_key,
    CAST(coalesce(c.events, 0) AS BIGINT) AS events
FROM job_sites s
JOIN job_ranks r ON r.job = s.job
LEFT JOIN counted c ON c.job = s.job AND c.rank = r.rank AND c.name_id = s.name_id AND c.site = s.site
JOIN event_names n ON n.name_id = s.name_id
LEFT JOIN sites t ON t.site_id = s.site;
