-- Events as people query them: with their run id, kind and name (stored as numbers in `event_rows`).

-- Every recorded event of every run.
-- @column event_id   number naming the event in this database (`show --event ID`), in recording order within a run
-- @column run_id     `runs.run_id`
-- @column ts         when the event was recorded
-- @column thread_id  OS thread id (`runs.threads` has names)
-- @column kind       'kernel_launch', 'op', 'alloc', 'user', ...
-- @column name       kernel, op or user name
-- @column stack_id   `stacks.stack_id`; NULL when no stack was taken or a killed process never flushed it
-- @column attrs      attributes (grid, block, stream, correlation id, ...) as JSON
CREATE OR REPLACE VIEW events AS
SELECT e.event_id, r.run_id, e.ts, e.thread_id, n.kind, n.name, e.stack_id, e.attrs
FROM event_rows e
JOIN runs r USING (run_number)
JOIN event_names n USING (name_id);
