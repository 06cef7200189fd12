-- Schema version 11: retention. `tbpipe retain` lets the events of old runs go and keeps what
-- history reads of them ("rolls them up"): their run rows, labels and loaded modules, their counts
-- per kind/name and stack (split by thread, which pprof's samples need), their GPU time per stack
-- (`gpu_time_counts`, kept as it is), and the stacks, frames and sites those use. A rolled-up run's
-- counts per site are its counts per stack summed over the stacks' current sites, as the ingest
-- computes `site_counts` (the `run_site_counts` view): a later change of the `user_code` rules or of
-- the symbols sites them again like every other run. The views of sql/counts.sql read full and
-- rolled-up runs alike; nothing changes for a database that is never rolled up.

ALTER TABLE runs ADD COLUMN rolled_up_at TIMESTAMPTZ;
COMMENT ON COLUMN runs.rolled_up_at IS 'when `tbpipe retain` rolled the run up (its events and GPU activity records let go, its counts moved to `rolled_up_counts`); NULL while the run keeps its events';

-- The counts of the rolled-up runs' events per run, kind/name, stack and thread: `event_counts`
-- split by thread. Written in blocks of runs (`rolled_up_runs.block`), each block's rows sorted by
-- stack, name, thread and run: the counts of one stack in consecutive runs lie together, where
-- DuckDB's compression packs them to about a byte a row and its zone maps find a stack's rows
-- without an index (a site's history), while a run's rows stay within its block.
-- @column stack_id    `stacks.stack_id`; NULL for events without a stack
-- @column name_id     `event_names.name_id`
-- @column thread      the thread within the run, numbered from 0 in the order of their first events (`rolled_up_threads`)
-- @column run_number  `runs.run_number`
-- @column events      number of events
CREATE TABLE rolled_up_counts (
    stack_id BIGINT,
    name_id INTEGER NOT NULL,
    thread INTEGER NOT NULL,
    run_number INTEGER NOT NULL,
    events BIGINT NOT NULL
);

-- The events of each rolled-up run per kind/name: `rolled_up_counts` summed over stacks and threads,
-- kept beside it (written with it, never changed after) so that a run's totals per kind (the runs
-- page, `--per`) read a row per name instead of a block of stacks.
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column events      number of events
CREATE TABLE rolled_up_name_counts (
    run_number INTEGER NOT NULL,
    name_id INTEGER NOT NULL,
    events BIGINT NOT NULL
);

-- The threads of each rolled-up run by their number in `rolled_up_counts`.
-- @column run_number  `runs.run_number`
-- @column thread      `rolled_up_counts.thread`
-- @column thread_id   OS thread id (`runs.threads` has names)
CREATE TABLE rolled_up_threads (
    run_number INTEGER NOT NULL,
    thread INTEGER NOT NULL,
    thread_id BIGINT NOT NULL
);

-- The backward events of rolled-up runs whose forward op was recorded, counted per run, name, own
-- stack and the forward op's stack: what `event_counts_at_forward` moves (`tbpipe report --site-of
-- forward`), kept when the events go. Runs without autograd's backward work have no rows.
-- @column run_number        `runs.run_number`
-- @column name_id           `event_names.name_id`
-- @column stack_id          the event's own stack
-- @column forward_stack_id  the stack of its forward op
-- @column events            number of events
CREATE TABLE rolled_up_forward_counts (
    run_number INTEGER NOT NULL,
    name_id INTEGER NOT NULL,
    stack_id BIGINT,
    forward_stack_id BIGINT NOT NULL,
    events BIGINT NOT NULL
);

-- What `tbpipe retain` let go of each rolled-up run, and where its counts are.
-- @column run_number      `runs.run_number`
-- @column block           the block of `rolled_up_counts` holding its counts (runs rolled up together, up to a few million rows)
-- @column first_event_id  the `event_id` of its first event (a run's events had consecutive ids); NULL when it had none
-- @column last_event_id   the `event_id` of its last event
-- @column gpu_records     GPU activity records let go
CREATE TABLE rolled_up_runs (
    run_number INTEGER NOT NULL,
    block INTEGER NOT NULL,
    first_event_id BIGINT,
    last_event_id BIGINT,
    gpu_records BIGINT NOT NULL
);
