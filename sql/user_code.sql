-- Which Python frames are user code: the frames `call_sites` puts events at.
--
-- Built in: the standard library, site-packages/dist-packages, frozen modules and tbpipe itself are
-- not user code; everything else is. The `user_code` table adjusts that by path prefix (longest
-- match wins); `tbpipe ingest --user-code PREFIX` fills it, and the views read it live.

-- True when `file` matches the `user_code` rule `prefix`: a prefix starting with '/' or '<' must
-- start the path; any other prefix may also start after any '/' (so 'mylib/' matches
-- '/venv/lib/python3.11/site-packages/mylib/nn.py').
-- @arg file    VARCHAR  a Python file name as captured (`stack_frames.file`)
-- @arg prefix  VARCHAR  a `user_code.prefix`
-- @returns BOOLEAN
CREATE OR REPLACE MACRO user_code_prefix_matches(file, prefix) AS
    starts_with(file, prefix)
    OR (NOT starts_with(prefix, '/') AND NOT starts_with(prefix, '<') AND contains(file, '/' || prefix));

-- True for a file that is not user code by the built-in rule: the standard library
-- (`.../lib/python3.X/`, frozen modules), site-packages and dist-packages, an installed tbpipe.
-- tbpipe's own source folders in an editable install are `user_code` rows with origin 'tbpipe'.
-- @arg file  VARCHAR  a Python file name as captured
-- @returns BOOLEAN
CREATE OR REPLACE MACRO is_library_python_file(file) AS
    starts_with(file, '<frozen ')
    OR regexp_matches(file, '/(site|dist)-packages/')
    OR regexp_matches(file, '/lib(64)?/python[0-9]+\.[0-9]+t?/')
    OR regexp_matches(file, '/tbpipe/(capture|pipeline|schemas)/');

-- Every distinct Python file of the stored frames, and whether it is user code.
-- @column file     the file name as captured
-- @column is_user  true when frames of this file can be call sites
-- @column rule     the `user_code.prefix` that decided, NULL when the built-in rule did
CREATE OR REPLACE VIEW python_files AS
WITH files AS (
    SELECT DISTINCT file FROM frames WHERE kind = 'python' AND file IS NOT NULL
), matched AS (
    SELECT f.file, arg_max(r.is_user, length(r.prefix)) AS is_user, arg_max(r.prefix, length(r.prefix)) AS rule
    FROM files f
    JOIN user_code r ON user_code_prefix_matches(f.file, r.prefix)
    GROUP BY f.file
)
SELECT f.file, coalesce(m.is_user, NOT is_library_python_file(f.file)) AS is_user, m.rule
FROM files f
LEFT JOIN matched m USING (file);
