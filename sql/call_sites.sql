-- Call sites: where in the user's code events come from, counted per run, kind and name.
--
-- The site of a stack is its innermost user frame (`python_files.is_user`); a stack without one
-- is sited at its innermost symbolized frame (Python or native) that is not generated code, so no
-- event goes uncounted. Frames that torch.compile generated are never sites: the user lines their
-- graph nodes came from stand inside them (inlined Python frames placed by the ingest from the run's
-- `code_origins`), else the compiled function's own frame further out is the innermost user frame.
-- `stack_sites_from` applies the `user_code` rules; the ingest stores its answer in the
-- `stack_sites` table (again for every stack when the rules change), which the views read.
--
-- A site is named by what survives a new checkout folder, a rebuild and an edit elsewhere in the
-- file (`site_identity_key`): never by an absolute path or an address.
-- @requires user_code
-- @requires stacks
-- @requires counts

-- Key of a call site by what it means, 16 hex digits. A Python site: its file relative to its
-- import root, its function's qualified name, and its line as an offset from the function's first
-- line (the line itself when the first line is unknown), so a function that moved down the file
-- keeps its sites' keys. A native site: its module's file name and its function.
-- @arg kind           VARCHAR  'python' or 'native'
-- @arg function       VARCHAR  the site frame's function
-- @arg portable_file  VARCHAR  Python: `source_files.portable_file`
-- @arg line           INTEGER  Python: the site frame's line
-- @arg first_line     INTEGER  Python: its function's first line, NULL when unknown
-- @arg module         VARCHAR  native: path of the module
-- @returns VARCHAR
CREATE OR REPLACE MACRO site_identity_key(kind, function, portable_file, line, first_line, module) AS
    substr(md5(CASE WHEN kind = 'python'
        THEN concat_ws(chr(31), 'py', coalesce(portable_file, ''), coalesce(function, ''),
                       CASE WHEN first_line IS NULL THEN 'L' || coalesce(CAST(line AS VARCHAR), '')
                            ELSE CAST(line - first_line AS VARCHAR) END)
        ELSE concat_ws(chr(31), 'native', coalesce(regexp_extract(module, '[^/]*$'), ''), coalesce(function, ''))
    END), 1, 16);

-- The call site of every stack with stack_id >= first_stack_id, under the current `user_code` rules:
-- its innermost user frame; without one (a thread without Python frames: gloo's and NCCL's workers,
-- autograd's engine threads, a program's C++ threads), its innermost symbolized frame that is neither
-- generated code nor the recording machinery (tbpipe's and torch's: RecordFunction, the observer,
-- the dispatcher's profiling path), else its innermost symbolized frame that is not generated code.
-- The machinery's patterns are the focus modes' (`pipeline.stacks.focus`), passed in by the caller
-- (`siting.reference_sites`). Code run from a string ('<string>', which has no file of its own)
-- inside generated code belongs to its caller: it is not user code when the next Python frame out is
-- not (Inductor's Triton launchers are made that way and called by Inductor's runtime).
-- @arg first_stack_id       BIGINT   the lowest stack id to compute (0: all)
-- @arg machinery_functions  VARCHAR  regular expression of the recording machinery's function names
-- @arg machinery_modules    VARCHAR  regular expression of the recording machinery's module file names
-- @column stack_id            `stacks.stack_id`
-- @column site_depth          depth of the site frame in `stack_frames`; NULL when the stack has no symbolized frame
-- @column site_kind           'python' or 'native'
-- @column site_function       the site frame's function
-- @column site_file           the site frame's file
-- @column site_line           the site frame's line
-- @column site_portable_file  Python: the file relative to its import root (`source_files`)
-- @column site_line_offset    Python: line minus the function's first line, NULL when that is unknown
-- @column site_module         native: the module's path
-- @column site_is_user        true when the site is a user frame, false when the stack has none
-- @column site_key            `site_identity_key` of the site
CREATE OR REPLACE MACRO stack_sites_from(first_stack_id, machinery_functions, machinery_modules) AS TABLE
WITH files AS (
    SELECT * FROM python_files_from(first_stack_id)
), user_rows AS (
    SELECT f.stack_id, f.depth, f.file
    FROM stack_frames f
    JOIN files p ON p.file = f.file AND p.is_user
    WHERE f.kind = 'python' AND f.stack_id >= first_stack_id
), lent AS (
    SELECT a.stack_id, a.depth
    FROM user_rows a
    JOIN stack_frames c ON c.stack_id = a.stack_id AND c.kind = 'python' AND c.depth > a.depth
    LEFT JOIN files p ON p.file = c.file
    WHERE a.file = '<string>' AND c.stack_id >= first_stack_id
    GROUP BY a.stack_id, a.depth
    HAVING NOT coalesce(arg_min(p.is_user, c.depth), true) AND bool_or(coalesce(p.is_generated, false))
), user_frames AS (
    SELECT stack_id, min(depth) AS depth
    FROM user_rows
    ANTI JOIN lent USING (stack_id, depth)
    GROUP BY stack_id
), modules AS (
    SELECT module, coalesce(is_generated_path(module), false) AS is_generated
    FROM (SELECT DISTINCT module FROM stack_frames WHERE kind = 'native' AND stack_id >= first_stack_id)
), machinery AS (
    SELECT function, module
    FROM (SELECT DISTINCT function, module FROM stack_frames WHERE kind = 'native' AND stack_id >= first_stack_id)
    WHERE coalesce(regexp_matches(function, machinery_functions), false)
       OR coalesce(regexp_matches(regexp_extract(module, '[^/]*$'), machinery_modules), false)
), fallback AS (
    SELECT f.stack_id,
           coalesce(min(f.depth) FILTER (WHERE k.function IS NULL), min(f.depth)) AS depth
    FROM stack_frames f
    LEFT JOIN files p ON f.kind = 'python' AND p.file = f.file
    LEFT JOIN modules m ON f.kind = 'native' AND m.module = f.module
    LEFT JOIN machinery k ON f.kind = 'native' AND k.function = f.function AND k.module IS NOT DISTINCT FROM f.module
    WHERE f.stack_id >= first_stack_id AND f.kind <> 'marker' AND f.function IS NOT NULL
      AND NOT coalesce(p.is_generated, false) AND NOT coalesce(m.is_generated, false)
      AND f.stack_id NOT IN (SELECT stack_id FROM user_frames)
    GROUP BY f.stack_id
), picked AS (
    SELECT s.stack_id, coalesce(u.depth, b.depth) AS depth, u.depth IS NOT NULL AS is_user
    FROM stacks s
    LEFT JOIN user_frames u USING (stack_id)
    LEFT JOIN fallback b USING (stack_id)
    WHERE s.stack_id >= first_stack_id
), located AS (
    SELECT
        p.stack_id,
        p.depth,
        p.is_user,
        f.kind,
        f.function,
        f.file,
        f.line,
        f.first_line,
        f.module,
        CASE WHEN f.kind = 'python' THEN coalesce(src.portable_file, f.file) END AS portable_file
    FROM picked p
    LEFT JOIN stack_frames f ON f.stack_id = p.stack_id AND f.depth = p.depth AND f.stack_id >= first_stack_id
    LEFT JOIN source_files src ON src.file = f.file
)
SELECT
    stack_id,
    depth AS site_depth,
    kind AS site_kind,
    function AS site_function,
    file AS site_file,
    line AS site_line,
    portable_file AS site_portable_file,
    CASE WHEN kind = 'python' THEN line - first_line END AS site_line_offset,
    CASE WHEN kind = 'native' THEN module END AS site_module,
    is_user AS site_is_user,
    CASE WHEN depth IS NOT NULL THEN site_identity_key(kind, function, portable_file, line, first_line, module) END
        AS site_key
FROM located;

-- Events per run, kind, name and call site, with where the site was in that run (rolled-up runs
-- too: `run_site_counts`).
-- @column run_id              `runs.run_id`
-- @column kind                event kind
-- @column name                event name (kernel, op, ...)
-- @column site_function       the site's function; NULL for events without a stack
-- @column site_file           the site's file in this run (where most of its events were)
-- @column site_line           the site's line in this run (likewise)
-- @column events              number of events
-- @column site_key            `site_identity_key` of the site (`tbpipe show --site KEY`): equal across runs, checkouts and rebuilds
-- @column site_portable_file  Python site: its file relative to its import root
-- @column site_is_user        true when the site is a user frame
CREATE OR REPLACE VIEW call_sites AS
SELECT
    r.run_id,
    n.kind,
    n.name,
    t.function AS site_function,
    p.site_file,
    p.site_line,
    p.events::BIGINT AS events,
    t.site_key,
    t.portable_file AS site_portable_file,
    p.site_is_user
FROM run_site_counts p
JOIN runs r USING (run_number)
JOIN event_names n USING (name_id)
LEFT JOIN sites t USING (site_id);

-- `call_sites` of kernel launches only (kind 'kernel_launch').
-- @column run_id              `runs.run_id`
-- @column kind                always 'kernel_launch'
-- @column name                kernel name
-- @column site_function       the site's function
-- @column site_file           the site's file in this run
-- @column site_line           the site's line in this run
-- @column events              number of launches
-- @column site_key            `site_identity_key` of the site
-- @column site_portable_file  Python site: its file relative to its import root
-- @column site_is_user        true when the site is a user frame
CREATE OR REPLACE VIEW kernel_launch_sites AS
SELECT * FROM call_sites WHERE kind = 'kernel_launch';
