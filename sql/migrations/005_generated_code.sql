-- Schema version 5: code that torch.compile (Inductor, FX, AOTAutograd) or Triton generated is a
-- class of its own beside user code and libraries: never a call site, marked in tracebacks.
--
-- Built-in patterns name FX and AOTAutograd pseudo-files and Inductor's default cache folder
-- (`is_generated_path` in sql/user_code.sql); this table adds the folders each captured process
-- configured (the run manifest's `generated_code`: Inductor's cache, Triton's cache), filled by the
-- ingest from every run it loads.

-- Folders (and pseudo-file prefixes) of generated code.
-- @column prefix        a path prefix: files and modules under it are generated code (folders end in '/')
-- @column generator     what generated the code there: 'inductor', 'triton', ... (the manifest's key)
-- @column first_run_id  the run whose manifest named it first
CREATE TABLE generated_code (
    prefix VARCHAR PRIMARY KEY,
    generator VARCHAR NOT NULL,
    first_run_id VARCHAR
);

-- Stored sites were computed without this class: the next ingest sites every stack again.
DELETE FROM settings WHERE key = 'sited_with_rules';
