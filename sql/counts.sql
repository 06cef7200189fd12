-- Counts per run, for every run alike: the one read path of counts. A run that keeps its events has
-- them counted by the ingest (`event_counts`, `site_counts`); a run `tbpipe retain` rolled up has
-- them in `rolled_up_counts`, per thread. Each run is read from one side only, chosen by its
-- `runs.rolled_up_at`, so a lake caught between the steps of a retain counts nothing twice; in the
-- database a retain is one transaction and the sides never overlap. Whatever reads counts (call
-- sites, reports, exports, a site's history) reads these views and gets the same answer for a run
-- before and after it is rolled up.

-- The counts of the rolled-up runs per kind/name and stack, over their threads (`event_counts` of them).
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column stack_id    `stacks.stack_id`, NULL for events without a stack
-- @column events      number of events
CREATE OR REPLACE VIEW rolled_up_stack_counts AS
SELECT run_number, name_id, stack_id, sum(events)::BIGINT AS events
FROM rolled_up_counts
WHERE run_number IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
GROUP BY run_number, name_id, stack_id;

-- Events per run, kind/name and stack, of every run (`event_counts` and the rolled-up runs').
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column stack_id    `stacks.stack_id`, NULL for events without a stack
-- @column events      number of events
CREATE OR REPLACE VIEW run_stack_counts AS
SELECT run_number, name_id, stack_id, events
FROM event_counts
WHERE run_number NOT IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
UNION ALL
SELECT run_number, name_id, stack_id, events
FROM rolled_up_stack_counts;

-- Events per run and kind/name of every run: `run_stack_counts` summed over the stacks (for a
-- rolled-up run, kept as such: what a run's totals per kind read).
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column events      number of events
CREATE OR REPLACE VIEW run_name_counts AS
SELECT run_number, name_id, sum(events)::BIGINT AS events
FROM event_counts
WHERE run_number NOT IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
GROUP BY run_number, name_id
UNION ALL
SELECT run_number, name_id, events
FROM rolled_up_name_counts
WHERE run_number IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL);

-- Events per run, kind/name, thread and stack, of every run: counted from the events of a run that
-- keeps them, read from `rolled_up_counts` for a rolled-up one (pprof's samples).
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column thread_id   OS thread id (`runs.threads` has names)
-- @column stack_id    `stacks.stack_id`, NULL for events without a stack
-- @column events      number of events
CREATE OR REPLACE VIEW run_thread_counts AS
SELECT run_number, name_id, thread_id, stack_id, count(*)::BIGINT AS events
FROM event_rows
WHERE run_number NOT IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
GROUP BY run_number, name_id, thread_id, stack_id
UNION ALL
SELECT c.run_number, c.name_id, t.thread_id, c.stack_id, c.events
FROM rolled_up_counts c
JOIN rolled_up_threads t ON t.run_number = c.run_number AND t.thread = c.thread
WHERE c.run_number IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL);

-- The rolled-up runs' events per kind/name and call site: their counts per stack summed over the
-- stacks' current sites, as the ingest sums `site_counts` (a site's file and line in a run are those
-- of its stack with the most events; among equals the greatest file and line).
-- @column run_number    `runs.run_number`
-- @column name_id       `event_names.name_id`
-- @column site_id       `sites.site_id`; NULL for events without a stack or a stack without a site
-- @column events        number of events
-- @column site_file     the site frame's file in this run (where most of the site's events were)
-- @column site_line     the site frame's line in this run (likewise)
-- @column site_is_user  true when the site is a user frame
CREATE OR REPLACE VIEW rolled_up_site_counts AS
SELECT
    c.run_number,
    c.name_id,
    s.site_id,
    sum(c.events)::BIGINT AS events,
    arg_max(s.site_file, struct_pack(n := c.events, f := coalesce(s.site_file, ''), l := coalesce(s.site_line, -1)))
        AS site_file,
    arg_max(s.site_line, struct_pack(n := c.events, f := coalesce(s.site_file, ''), l := coalesce(s.site_line, -1)))
        AS site_line,
    bool_or(s.site_is_user) AS site_is_user
FROM rolled_up_stack_counts c
LEFT JOIN stack_sites s ON s.stack_id = c.stack_id
GROUP BY c.run_number, c.name_id, s.site_id;

-- Events per run, kind/name and call site of every run, with where the site was in that run: the
-- ingest's `site_counts`, and `rolled_up_site_counts`.
-- @column run_number    `runs.run_number`
-- @column name_id       `event_names.name_id`
-- @column site_id       `sites.site_id`; NULL for events without a stack or a stack without a site
-- @column events        number of events
-- @column site_file     the site frame's file in this run (where most of the site's events were)
-- @column site_line     the site frame's line in this run (likewise)
-- @column site_is_user  true when the site is a user frame
CREATE OR REPLACE VIEW run_site_counts AS
SELECT run_number, name_id, site_id, events, site_file, site_line, site_is_user
FROM site_counts
WHERE run_number NOT IN (SELECT run_number FROM runs WHERE rolled_up_at IS NOT NULL)
UNION ALL
SELECT run_number, name_id, site_id, events, site_file, site_line, site_is_user
FROM rolled_up_site_counts;
