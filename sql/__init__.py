"""The DuckDB schema as package data: `migrations/NNN_name.sql` (applied in order, each once) and one
module per topic of views and macros (`*.sql` here), loaded by `tbpipe.pipeline.db.schema`.

Every table, view and macro is preceded by a comment that says what it holds, with one
`-- @column NAME text` line per column (`-- @arg`, `-- @returns` for macros); the loader turns them
into DuckDB `COMMENT ON` entries, so `duckdb_columns()` documents the database it is asked about.
A module names the modules it uses with `-- @requires NAME` lines.
"""
