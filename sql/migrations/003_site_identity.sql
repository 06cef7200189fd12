-- Schema version 3: call sites keep their identity across checkout folders, rebuilds and code moves.
--
-- A Python site is now keyed by its file relative to the import root that held it (the run's
-- sys.path entry or working folder), its function's qualified name and the line's offset from the
-- function's first line; a native site by its module's file name and its function. The stored
-- sites are recomputed by the next ingest (the settings row that says which rules they were
-- computed with is dropped here); Python frames of runs ingested before this version get their
-- functions' first lines from their run folders when those still exist.

-- The first line of a Python frame's function (`co_firstlineno`), NULL for native frames.
ALTER TABLE stack_frames ADD COLUMN first_line INTEGER;
COMMENT ON COLUMN stack_frames.first_line IS 'first line of the Python function (`co_firstlineno`); NULL for native frames and for frames of runs whose first lines could not be recovered';

-- The CUDA version torch was built with, and the run's import roots.
ALTER TABLE runs ADD COLUMN cuda_version VARCHAR;
ALTER TABLE runs ADD COLUMN sys_path VARCHAR[];
COMMENT ON COLUMN runs.cuda_version IS 'CUDA version torch was built with, when the program imported a CUDA build of torch';
COMMENT ON COLUMN runs.sys_path IS 'the import path as absolute folders at session start (Python files are named relative to these); NULL for runs captured before tbpipe recorded it';

-- Each Python file once: its name as captured and the name that does not depend on where the code
-- was checked out.
-- @column file           the file as captured (`stack_frames.file`, absolute for real files)
-- @column portable_file  the file relative to the longest import root that holds it (e.g. 'models/bert.py'); the file itself when no root does, or for pseudo-files such as '<frozen os>'
-- @column root           the import root it was named relative to, NULL when none
CREATE TABLE source_files (
    file VARCHAR PRIMARY KEY,
    portable_file VARCHAR NOT NULL,
    root VARCHAR
);

-- What a site is, beside its key.
ALTER TABLE sites ADD COLUMN kind VARCHAR;
ALTER TABLE sites ADD COLUMN portable_file VARCHAR;
ALTER TABLE sites ADD COLUMN line_offset INTEGER;
ALTER TABLE sites ADD COLUMN module VARCHAR;
COMMENT ON COLUMN sites.kind IS '''python'' or ''native''';
COMMENT ON COLUMN sites.portable_file IS 'Python site: `source_files.portable_file` of its file';
COMMENT ON COLUMN sites.line_offset IS 'Python site: its line minus its function''s first line; NULL when the first line is unknown (the key then uses the line itself)';
COMMENT ON COLUMN sites.module IS 'native site: the file name of its module (e.g. ''libtorch_cpu.so'')';
COMMENT ON COLUMN sites.file IS 'the site frame''s file where the site was first seen';
COMMENT ON COLUMN sites.line IS 'the site frame''s line where the site was first seen';

-- Where a stack's site frame is (a site may move between runs; its key stays).
ALTER TABLE stack_sites ADD COLUMN site_file VARCHAR;
ALTER TABLE stack_sites ADD COLUMN site_line INTEGER;
COMMENT ON COLUMN stack_sites.site_file IS 'the site frame''s file in this stack';
COMMENT ON COLUMN stack_sites.site_line IS 'the site frame''s line in this stack';

DELETE FROM settings WHERE key = 'sited_with_rules';
