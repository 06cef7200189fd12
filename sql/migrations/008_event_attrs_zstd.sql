-- Schema version 8: event attributes compressed with zstd. A kernel launch's attributes are ~80
-- characters of JSON that differ in every event (the correlation id), so DuckDB's default string
-- compression kept ~20 bytes of them per event, half of the database. zstd keeps ~11, and reads
-- and writes them faster. On a database file in a storage format older than DuckDB 1.2's, which
-- has no zstd for strings, the column keeps the default compression (`schema.apply_migrations`).
-- The rows are copied in their order; the table is the same otherwise.

ALTER TABLE event_rows RENAME TO event_rows_before_zstd;

-- Every recorded event of every run, its run and name by number.
-- @column event_id    number naming the event in this database (`show --event ID`), in recording order within a run
-- @column run_number  `runs.run_number`
-- @column ts          when the event was recorded
-- @column thread_id   OS thread id (`runs.threads` has names)
-- @column name_id     `event_names.name_id`: the event's kind and name
-- @column stack_id    `stacks.stack_id`; NULL when no stack was taken or a killed process never flushed it
-- @column attrs       attributes (grid, block, stream, correlation id, ...) as JSON, compressed with zstd
CREATE TABLE event_rows (
    event_id BIGINT NOT NULL,
    run_number INTEGER NOT NULL,
    ts TIMESTAMPTZ NOT NULL,
    thread_id BIGINT NOT NULL,
    name_id INTEGER NOT NULL,
    stack_id BIGINT,
    attrs JSON USING COMPRESSION zstd
);

INSERT INTO event_rows SELECT * FROM event_rows_before_zstd;

DROP TABLE event_rows_before_zstd;
