-- Events as people query them: with their run id, kind and name (stored as numbers in `event_rows`).

-- An event's attributes as it recorded them, as JSON text: the stored JSON with the correlation id
-- of a CUDA call (kept in `event_rows.correlation_id`, never in the JSON) put back, first. Spliced in
-- as text (a cast to JSON would parse every launch's attributes again, twice the cost of the
-- splice); an object written with spaces is minified first, and attributes that are no object
-- (no CUDA source writes such) come as stored.
-- @arg attrs           JSON      `event_rows.attrs`
-- @arg correlation_id  UINTEGER  `event_rows.correlation_id`
-- @returns VARCHAR
CREATE OR REPLACE MACRO event_attrs(attrs, correlation_id) AS
    CASE WHEN correlation_id IS NULL THEN CAST(attrs AS VARCHAR)
    WHEN attrs IS NULL OR attrs = '{}' THEN concat('{"correlation_id":', correlation_id, '}')
    WHEN starts_with(attrs, '{"') THEN concat('{"correlation_id":', correlation_id, ',', substr(attrs, 2))
    WHEN json_type(attrs) <> 'OBJECT' THEN CAST(attrs AS VARCHAR)
    WHEN CAST(json(attrs) AS VARCHAR) = '{}' THEN concat('{"correlation_id":', correlation_id, '}')
    ELSE concat('{"correlation_id":', correlation_id, ',', substr(CAST(json(attrs) AS VARCHAR), 2))
    END;

-- Every recorded event of every run.
-- @column event_id        number naming the event in this database (`show --event ID`), in recording order within a run
-- @column run_id          `runs.run_id`
-- @column ts              when the event was recorded
-- @column thread_id       OS thread id (`runs.threads` has names)
-- @column kind            'kernel_launch', 'op', 'alloc', 'user', ...
-- @column name            kernel, op or user name
-- @column stack_id        `stacks.stack_id`; NULL when no stack was taken or a killed process never flushed it
-- @column attrs           attributes (grid, block, stream, correlation id, ...) as JSON text
-- @column correlation_id  CUPTI's correlation id of a CUDA API call (the key of its `gpu_activity`); NULL for other events
CREATE OR REPLACE VIEW events AS
SELECT e.event_id, r.run_id, e.ts, e.thread_id, n.kind, n.name, e.stack_id,
       event_attrs(e.attrs, e.correlation_id) AS attrs, e.correlation_id
FROM event_rows e
JOIN runs r USING (run_number)
JOIN event_names n USING (name_id);
