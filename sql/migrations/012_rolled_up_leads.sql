-- Schema version 12: the leading call sites of each rolled-up run, kept. A rolled-up run's counts
-- per site are derived from its counts per stack, which lie in `rolled_up_counts` among those of
-- the few dozen runs of its block, sorted by stack for a site's history: one run's sites cost a
-- scan of its whole block and two aggregations (tens of milliseconds), every time a page asks. What
-- the service's run pages show first is the same few hundred sites each time, so `tbpipe retain`
-- keeps them when it rolls a run up, and the pages read them as a handful of rows by run. Kept
-- in step with the sites: when every stack is sited again (new `user_code` rules, new symbols), the
-- leads are made again with the site counts. A run rolled up before this version has no leads and
-- is read from its counts, as before.

-- The first `retain.LEAD_SITES` rows of each rolled-up run's `run_site_counts` in the order the
-- service pages them (most events first, then by name, kind and site), written in run order.
-- @column run_number  `runs.run_number`
-- @column place       the row's place in that order, from 0
-- @column name_id     `event_names.name_id`
-- @column site_id     `sites.site_id`; NULL for events without a site
-- @column events      number of events
-- @column site_file   the site frame's file in this run (as `run_site_counts.site_file`)
-- @column site_line   the site frame's line in this run (as `run_site_counts.site_line`)
CREATE TABLE rolled_up_leads (
    run_number INTEGER NOT NULL,
    place INTEGER NOT NULL,
    name_id INTEGER NOT NULL,
    site_id BIGINT,
    events BIGINT NOT NULL,
    site_file VARCHAR,
    site_line INTEGER
);
