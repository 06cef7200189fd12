-- Call sites: where in the user's code events come from, counted per run, kind and name.
--
-- The site of a stack is its innermost user frame (`python_files.is_user`); a stack without one
-- is sited at its innermost symbolized frame (Python or native), so no event goes uncounted.
-- @requires user_code

-- Key of a call site over what it means, (function, file, line), never over addresses: the same
-- site has the same key across rebuilds, runs and databases. 16 hex digits.
-- @arg function  VARCHAR  the site's function
-- @arg file      VARCHAR  the site's file
-- @arg line      INTEGER  the site's line
-- @returns VARCHAR
CREATE OR REPLACE MACRO call_site_key(function, file, line) AS
    substr(md5(concat_ws(chr(31), coalesce(function, ''), coalesce(file, ''), coalesce(CAST(line AS VARCHAR), ''))), 1, 16);

-- The call site of every stack.
-- @column stack_id       `stacks.stack_id`
-- @column site_depth     depth of the site frame in `stack_frames`; NULL when the stack has no symbolized frame
-- @column site_kind      'python' or 'native'
-- @column site_function  the site frame's function
-- @column site_file      the site frame's file
-- @column site_line      the site frame's line
-- @column site_is_user   true when the site is a user frame, false when the stack has none (innermost symbolized frame)
-- @column site_key       `call_site_key` of the site
CREATE OR REPLACE VIEW stack_sites AS
WITH candidates AS (
    SELECT f.stack_id, f.depth, f.kind, f.function, f.file, f.line, coalesce(p.is_user, false) AS is_user
    FROM stack_frames f
    LEFT JOIN python_files p ON f.kind = 'python' AND p.file = f.file
    WHERE f.kind IN ('python', 'native') AND f.function IS NOT NULL
), picked AS (
    SELECT
        stack_id,
        coalesce(
            arg_min(struct_pack(depth, kind, function, file, line), depth) FILTER (WHERE is_user),
            arg_min(struct_pack(depth, kind, function, file, line), depth)
        ) AS site,
        bool_or(is_user) AS site_is_user
    FROM candidates
    GROUP BY stack_id
)
SELECT
    s.stack_id,
    p.site.depth AS site_depth,
    p.site.kind AS site_kind,
    p.site.function AS site_function,
    p.site.file AS site_file,
    p.site.line AS site_line,
    coalesce(p.site_is_user, false) AS site_is_user,
    CASE WHEN p.site IS NOT NULL THEN call_site_key(p.site.function, p.site.file, p.site.line) END AS site_key
FROM stacks s
LEFT JOIN picked p USING (stack_id);

-- Events per run, kind, name and call site.
-- @column run_id         `runs.run_id`
-- @column kind           event kind
-- @column name           event name (kernel, op, ...)
-- @column site_function  the site's function; NULL for events without a stack
-- @column site_file      the site's file
-- @column site_line      the site's line
-- @column events         number of events
-- @column site_key       `call_site_key` of the site (`tbpipe show --site KEY`)
CREATE OR REPLACE VIEW call_sites AS
WITH per_stack AS (
    SELECT run_id, kind, name, stack_id, count(*) AS events
    FROM events
    GROUP BY run_id, kind, name, stack_id
)
SELECT
    e.run_id,
    e.kind,
    e.name,
    s.site_function,
    s.site_file,
    s.site_line,
    sum(e.events)::BIGINT AS events,
    s.site_key
FROM per_stack e
LEFT JOIN stack_sites s USING (stack_id)
GROUP BY e.run_id, e.kind, e.name, s.site_function, s.site_file, s.site_line, s.site_key;

-- `call_sites` of kernel launches only (kind 'kernel_launch').
-- @column run_id         `runs.run_id`
-- @column kind           always 'kernel_launch'
-- @column name           kernel name
-- @column site_function  the site's function
-- @column site_file      the site's file
-- @column site_line      the site's line
-- @column events         number of launches
-- @column site_key       `call_site_key` of the site
CREATE OR REPLACE VIEW kernel_launch_sites AS
SELECT * FROM call_sites WHERE kind = 'kernel_launch';
