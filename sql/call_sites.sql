-- Call sites: where in the user's code events come from, counted per run, kind and name.
--
-- The site of a stack is its innermost user frame (`python_files.is_user`); a stack without one
-- is sited at its innermost symbolized frame (Python or native), so no event goes uncounted.
-- `stack_sites_from` applies the `user_code` rules; the ingest stores its answer in the
-- `stack_sites` table (again for every stack when the rules change), which the views read.
--
-- A site is named by what survives a new checkout folder, a rebuild and an edit elsewhere in the
-- file (`site_identity_key`): never by an absolute path or an address.
-- @requires user_code
-- @requires stacks

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

-- The call site of every stack with stack_id >= first_stack_id, under the current `user_code` rules.
-- @arg first_stack_id  BIGINT  the lowest stack id to compute (0: all)
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
CREATE OR REPLACE MACRO stack_sites_from(first_stack_id) AS TABLE
WITH user_frames AS (
    SELECT f.stack_id, min(f.depth) AS depth
    FROM stack_frames f
    JOIN python_files_from(first_stack_id) p ON p.file = f.file AND p.is_user
    WHERE f.kind = 'python' AND f.stack_id >= first_stack_id
    GROUP BY f.stack_id
), picked AS (
    SELECT s.stack_id, coalesce(u.depth, s.symbolized_depth) AS depth, u.depth IS NOT NULL AS is_user
    FROM stacks s
    LEFT JOIN user_frames u USING (stack_id)
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

-- Events per run, kind, name and call site, with where the site was in that run.
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
FROM site_counts p
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
