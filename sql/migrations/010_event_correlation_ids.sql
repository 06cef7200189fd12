-- Schema version 10: a CUDA call's correlation id in a column of its own. It is the one attribute
-- of a kernel launch that differs in every event: inside the JSON it took a third of the database's
-- bytes, and made zstd the only compression that helped the attributes (schema 8). Without it a
-- launch's attributes repeat from one event to the next, and DuckDB's own choice of compression
-- (dictionary, FSST) packs them tighter than zstd did; the id itself bit-packs to about a byte. It
-- is also the key GPU activity joins its launches on (`gpu_activity.event_id`), no longer parsed
-- out of JSON. Raw runs of schema version 3 write it in a column of their own; for the rows already
-- here (and runs of versions 1 and 2) it is moved out of the `attrs` of the events the CUDA source
-- records, where it is an integer the column holds (0 means none, as the capture writes it). The
-- `events` view puts it back. The rows are copied in event id order (the order the ingest writes).

ALTER TABLE event_rows RENAME TO event_rows_before_correlation;

-- Every recorded event of every run, its run and name by number.
-- @column event_id        number naming the event in this database (`show --event ID`), in recording order within a run
-- @column run_number      `runs.run_number`
-- @column ts              when the event was recorded
-- @column thread_id       OS thread id (`runs.threads` has names)
-- @column name_id         `event_names.name_id`: the event's kind and name
-- @column stack_id        `stacks.stack_id`; NULL when no stack was taken or a killed process never flushed it
-- @column attrs           attributes (grid, block, stream, ...) as JSON, without the correlation id (`event_attrs` adds it)
-- @column correlation_id  CUPTI's correlation id of a CUDA API call (kernel_launch, graph_launch, memcpy, memset), the key of its GPU activity; NULL for other events
CREATE TABLE event_rows (
    event_id BIGINT NOT NULL,
    run_number INTEGER NOT NULL,
    ts TIMESTAMPTZ NOT NULL,
    thread_id BIGINT NOT NULL,
    name_id INTEGER NOT NULL,
    stack_id BIGINT,
    attrs JSON,
    correlation_id UINTEGER
);

INSERT INTO event_rows
SELECT event_id, run_number, ts, thread_id, name_id, stack_id,
       CASE WHEN correlation_id IS NULL THEN attrs ELSE json_merge_patch(attrs, '{"correlation_id": null}') END,
       correlation_id
FROM (
    SELECT e.*,
           CASE WHEN n.kind IN ('kernel_launch', 'graph_launch', 'memcpy', 'memset')
                 AND json_type(e.attrs, '$.correlation_id') IN ('UBIGINT', 'BIGINT')
           THEN NULLIF(TRY_CAST(json_extract_string(e.attrs, '$.correlation_id') AS UINTEGER), 0) END AS correlation_id
    FROM event_rows_before_correlation e
    LEFT JOIN event_names n USING (name_id)
)
ORDER BY event_id;

DROP TABLE event_rows_before_correlation;
