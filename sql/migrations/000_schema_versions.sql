-- Schema version 0: the tables that say what the database holds. Applied (idempotently) before
-- any other migration, so the loader can tell which migrations are in.

-- One row per migration applied to this database, in order; the highest version is the schema version.
-- @column version     the migration's number (NNN of `sql/migrations/NNN_name.sql`)
-- @column name        the migration's name
-- @column sha256      hash of the migration's text when applied
-- @column applied_at  when it was applied
-- @column tbpipe      version of the tbpipe that applied it
CREATE TABLE IF NOT EXISTS schema_versions (
    version INTEGER PRIMARY KEY,
    name VARCHAR NOT NULL,
    sha256 VARCHAR NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL,
    tbpipe VARCHAR
);

-- The view and macro modules (`sql/*.sql`) installed in this database, re-installed when their text changes.
-- @column module   module name (file name without .sql)
-- @column sha256   hash of the module's text when installed
-- @column objects  views and macros the module created, as 'view NAME' / 'macro NAME' / 'table macro NAME'
CREATE TABLE IF NOT EXISTS sql_modules (
    module VARCHAR PRIMARY KEY,
    sha256 VARCHAR NOT NULL,
    objects VARCHAR[] NOT NULL
);
