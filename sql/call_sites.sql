-- Call sites: where in the user's code events come from, counted per run, kind and name.
--
-- The site of a stack is its innermost user frame (`python_files.is_user`); a stack without one
-- is sited at its innermost symbolized frame (Python or native), so no event goes uncounted.
-- `stack_sites_from` applies the `user_code` rules; the ingest stores its answer in the
-- `stack_sites` table (again for every stack when the rules change), which the views read.
-- @requires user_code

-- Key of a call site over what it means, (function, file, line), never over addresses: the same
-- site has the same key across rebuilds, runs and databases. 16 hex digits.
-- @arg function  VARCHAR  the site's function
-- @arg file      VARCHAR  the site's file
-- @arg line      INTEGER  the site's line
-- @returns VARCHAR
CREATE OR REPLACE MACRO call_site_key(function, file, line) AS
    substr(md5(concat_ws(chr(31), coalesce(function, ''), coalesce(file, ''), coalesce(CAST(line AS VARCHAR), ''))), 1, 16);

-- The call site of every stack with stack_id >= first_stack_id, under the current `user_code` rules.
-- @arg first_stack_id  BIGINT  the lowest stack id to compute (0: all)
-- @column stack_id       `stacks.stack_id`
-- @column site_depth     depth of the site frame in `stack_frames`; NULL when the stack has no symbolized frame
-- @column site_kind      'python' or 'native'
-- @column site_function  the site frame's function
-- @column site_file      the site frame's file
-- @column site_line      the site frame's line
-- @column site_is_user   true when the site is a user frame, false when the stack has none
-- @column site_key       `call_site_key` of the site
CREATE OR REPLACE MACRO stack_sites_from(first_stack_id) AS TABLE
WITH user_frames AS (
    SELECT f.stack_id, min(f.depth) AS depth
    FROM stack_frames f
    JOIN python_files p ON p.file = f.file AND p.is_user
    WHERE f.kind = 'python' AND f.stack_id >= first_stack_id
    GROUP BY f.stack_id
), picked AS (
    SELECT s.stack_id, coalesce(u.depth, s.symbolized_depth) AS depth, u.depth IS NOT NULL AS is_user
    FROM stacks s
    LEFT JOIN user_frames u USING (stack_id)
    WHERE s.stack_id >= first_stack_id
)
SELECT
    p.stack_id,
    p.depth AS site_depth,
    f.kind AS site_kind,
    f.function AS site_function,
    f.file AS site_file,
    f.line AS site_line,
    p.is_user AS site_is_user,
    CASE WHEN p.depth IS NOT NULL THEN call_site_key(f.function, f.file, f.line) END AS site_key
FROM picked p
LEFT JOIN stack_frames f ON f.stack_id = p.stack_id AND f.depth = p.depth AND f.stack_id >= first_stack_id;

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
WITH per_site AS (
    SELECT c.run_number, c.name_id, s.site_id, sum(c.events) AS events
    FROM event_counts c
    LEFT JOIN stack_sites s USING (stack_id)
    GROUP BY c.run_number, c.name_id, s.site_id
)
SELECT
    r.run_id,
    n.kind,
    n.name,
    t.function AS site_function,
    t.file AS site_file,
    t.line AS site_line,
    p.events::BIGINT AS events,
    t.site_key
FROM per_site p
JOIN runs r USING (run_number)
JOIN event_names n USING (name_id)
LEFT JOIN sites t USING (site_id);

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
