-- Which Python frames are user code: the frames `call_sites` puts events at.
--
-- Built in: the standard library, site-packages/dist-packages, frozen modules and tbpipe itself are
-- not user code; everything else is. The `user_code` table adjusts that by path prefix (longest
-- match wins); `tbpipe ingest --user-code PREFIX` fills it, and the views read it live. Code that
-- torch.compile or Triton generated is a third class (`is_generated_path`, the `generated_code`
-- table): never user code.

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

-- Whether a Python file is user code: never for generated code (`is_generated_path`); else the
-- longest matching `user_code` prefix decides, else the built-in rule (`is_library_python_file`).
-- @arg file  VARCHAR  a Python file name as captured
-- @returns BOOLEAN
CREATE OR REPLACE MACRO python_file_is_user(file) AS
    NOT coalesce(is_generated_path(file), false)
    AND coalesce(
        (SELECT arg_max(r.is_user, length(r.prefix)) FROM user_code r WHERE user_code_prefix_matches(file, r.prefix)),
        NOT is_library_python_file(file)
    );

-- The `user_code` prefix that decides whether a Python file is user code, NULL when the built-in rule does.
-- @arg file  VARCHAR  a Python file name as captured
-- @returns VARCHAR
CREATE OR REPLACE MACRO python_file_rule(file) AS
    (SELECT arg_max(r.prefix, length(r.prefix)) FROM user_code r WHERE user_code_prefix_matches(file, r.prefix));

-- The Python files of the stacks with stack_id >= first_stack_id, and whether each is user code.
-- @requires stacks
-- @arg first_stack_id  BIGINT  the lowest stack id whose frames' files are classified (0: all)
-- @column file          the file name as captured
-- @column is_user       true when frames of this file can be call sites (`python_file_is_user`)
-- @column rule          the `user_code.prefix` that decided, NULL when the built-in rule did
-- @column is_generated  true for generated code (`is_generated_path`): neither user code nor a library
CREATE OR REPLACE MACRO python_files_from(first_stack_id) AS TABLE
SELECT file, python_file_is_user(file) AS is_user, python_file_rule(file) AS rule,
       coalesce(is_generated_path(file), false) AS is_generated
FROM (
    SELECT DISTINCT file FROM stack_frames
    WHERE stack_id >= first_stack_id AND kind = 'python' AND file IS NOT NULL
);

-- Every distinct Python file of the stored stacks, and whether it is user code.
-- @column file          the file name as captured
-- @column is_user       true when frames of this file can be call sites
-- @column rule          the `user_code.prefix` that decided, NULL when the built-in rule did
-- @column is_generated  true for generated code: neither user code nor a library
CREATE OR REPLACE VIEW python_files AS
SELECT * FROM python_files_from(0);
