-- GPU time: the `cuda` source's CUPTI activity records, added up per event, call site and stack.
--
-- Every record's time goes to the call site of the API call that caused it (a kernel launch, a
-- CUDA graph launch, a copy or a set), sited like `call_sites`. A kernel of a replayed CUDA graph
-- is counted at the graph launch's site, and also named by the site of the launch that was
-- captured into its graph node (`capture_site_*`), where that launch was recorded. Records whose
-- launch was not recorded (sampling, rate limits, a killed process) are counted with NULL sites.
-- @requires call_sites
-- @requires events

-- GPU time of every event that caused GPU activity: a kernel launch, a graph launch (all its
-- kernels), a copy or a set.
-- @column event_id      `events.event_id`
-- @column run_id        `runs.run_id`
-- @column kind          the event's kind ('kernel_launch', 'graph_launch', 'memcpy', 'memset')
-- @column name          the event's name
-- @column stack_id      the event's stack
-- @column activities    GPU activity records it caused (the kernels of a graph launch, ...)
-- @column gpu_time_ns   their summed durations, nanoseconds
-- @column gpu_start     when the first of them started on the GPU
-- @column gpu_end       when the last of them ended
CREATE OR REPLACE VIEW event_gpu_time AS
SELECT
    e.event_id,
    r.run_id,
    n.kind,
    n.name,
    e.stack_id,
    count(*) AS activities,
    coalesce(sum(a.duration_ns), 0)::BIGINT AS gpu_time_ns,
    min(a.gpu_start) AS gpu_start,
    max(a.gpu_end) AS gpu_end
FROM gpu_activity a
JOIN event_rows e ON e.event_id = a.event_id
JOIN runs r ON r.run_number = e.run_number
JOIN event_names n ON n.name_id = e.name_id
GROUP BY e.event_id, r.run_id, n.kind, n.name, e.stack_id;

-- GPU time per run, activity kind and name, and call site: where the GPU's time comes from.
-- @column run_id                 `runs.run_id`
-- @column kind                   activity kind: 'kernel', 'memcpy', 'memset' or 'sync'
-- @column name                   kernel name (mangled, as CUPTI reports it); copy kind for a memcpy; 'memset'; sync type
-- @column launch_kind            kind of the event that caused it ('kernel_launch', 'graph_launch', 'memcpy', 'memset'); NULL when not recorded
-- @column site_function          the launch site's function; NULL when the launch was not recorded or has no stack
-- @column site_file              the launch site's file in this run (where most of its GPU time came from)
-- @column site_line              the launch site's line in this run (likewise)
-- @column site_key               `site_identity_key` of the launch site: equal across runs, checkouts and rebuilds
-- @column site_portable_file     Python site: its file relative to its import root
-- @column site_is_user           true when the site is a user frame
-- @column capture_site_key       a kernel of a replayed graph: the site of the launch captured into its node; else NULL
-- @column capture_site_function  that site's function
-- @column capture_site_file      that site's file
-- @column capture_site_line      that site's line
-- @column executions             activity records
-- @column timed                  records with a duration
-- @column gpu_time_ns            summed GPU time, nanoseconds
-- @column avg_ns                 mean duration of a timed record
-- @column min_ns                 shortest duration
-- @column max_ns                 longest duration
-- @column bytes                  memcpy, memset: bytes copied or set
CREATE OR REPLACE VIEW gpu_time_sites AS
SELECT
    r.run_id,
    g.kind,
    g.name,
    n.kind AS launch_kind,
    t.function AS site_function,
    arg_max(s.site_file, g.gpu_time_ns) AS site_file,
    arg_max(s.site_line, g.gpu_time_ns) AS site_line,
    t.site_key,
    t.portable_file AS site_portable_file,
    bool_or(s.site_is_user) AS site_is_user,
    ct.site_key AS capture_site_key,
    ct.function AS capture_site_function,
    arg_max(cs.site_file, g.gpu_time_ns) AS capture_site_file,
    arg_max(cs.site_line, g.gpu_time_ns) AS capture_site_line,
    sum(g.executions)::BIGINT AS executions,
    sum(g.timed)::BIGINT AS timed,
    sum(g.gpu_time_ns)::BIGINT AS gpu_time_ns,
    (sum(g.gpu_time_ns) / nullif(sum(g.timed), 0))::DOUBLE AS avg_ns,
    min(g.min_ns) AS min_ns,
    max(g.max_ns) AS max_ns,
    sum(g.bytes)::UBIGINT AS bytes
FROM gpu_time_counts g
JOIN runs r USING (run_number)
LEFT JOIN event_names n ON n.name_id = g.name_id
LEFT JOIN stack_sites s ON s.stack_id = g.stack_id
LEFT JOIN sites t ON t.site_id = s.site_id
LEFT JOIN stack_sites cs ON cs.stack_id = g.capture_stack_id
LEFT JOIN sites ct ON ct.site_id = cs.site_id
GROUP BY r.run_id, g.kind, g.name, n.kind, t.function, t.site_key, t.portable_file, ct.site_key, ct.function;

-- `gpu_time_sites` of kernels only: the GPU-time sibling of `kernel_launch_sites`.
-- @column run_id                 `runs.run_id`
-- @column kind                   always 'kernel'
-- @column name                   kernel name
-- @column launch_kind            'kernel_launch', or 'graph_launch' for a kernel of a replayed CUDA graph; NULL when the launch was not recorded
-- @column site_function          the launch site's function
-- @column site_file              the launch site's file in this run
-- @column site_line              the launch site's line in this run
-- @column site_key               `site_identity_key` of the launch site
-- @column site_portable_file     Python site: its file relative to its import root
-- @column site_is_user           true when the site is a user frame
-- @column capture_site_key       a kernel of a replayed graph: the site of the launch captured into its node
-- @column capture_site_function  that site's function
-- @column capture_site_file      that site's file
-- @column capture_site_line      that site's line
-- @column executions             kernel executions
-- @column timed                  executions with a duration
-- @column gpu_time_ns            summed GPU time, nanoseconds
-- @column avg_ns                 mean duration of an execution
-- @column min_ns                 shortest execution
-- @column max_ns                 longest execution
-- @column bytes                  always NULL
CREATE OR REPLACE VIEW kernel_gpu_time_sites AS
SELECT * FROM gpu_time_sites WHERE kind = 'kernel';

-- Memory copies per run, copy kind and call site, with their GPU time and bytes.
-- @column run_id              `runs.run_id`
-- @column copy_kind           'HtoD', 'DtoH', 'DtoD', 'HtoH', 'PtoP', ...
-- @column api                 the copy's API ('cudaMemcpyAsync', ...); NULL when the call was not recorded
-- @column site_function       the call site's function
-- @column site_file           the call site's file in this run
-- @column site_line           the call site's line in this run
-- @column site_key            `site_identity_key` of the call site
-- @column site_portable_file  Python site: its file relative to its import root
-- @column site_is_user        true when the site is a user frame
-- @column copies              copies
-- @column bytes               bytes copied
-- @column gpu_time_ns         summed GPU time, nanoseconds
-- @column gb_per_s            bytes per second of GPU time, in GB/s
CREATE OR REPLACE VIEW memcpy_sites AS
SELECT
    r.run_id,
    g.name AS copy_kind,
    n.name AS api,
    t.function AS site_function,
    arg_max(s.site_file, g.gpu_time_ns) AS site_file,
    arg_max(s.site_line, g.gpu_time_ns) AS site_line,
    t.site_key,
    t.portable_file AS site_portable_file,
    bool_or(s.site_is_user) AS site_is_user,
    sum(g.executions)::BIGINT AS copies,
    sum(g.bytes)::UBIGINT AS bytes,
    sum(g.gpu_time_ns)::BIGINT AS gpu_time_ns,
    (sum(g.bytes) / nullif(sum(g.gpu_time_ns), 0))::DOUBLE AS gb_per_s
FROM gpu_time_counts g
JOIN runs r USING (run_number)
LEFT JOIN event_names n ON n.name_id = g.name_id
LEFT JOIN stack_sites s ON s.stack_id = g.stack_id
LEFT JOIN sites t ON t.site_id = s.site_id
WHERE g.kind = 'memcpy'
GROUP BY r.run_id, g.name, n.name, t.function, t.site_key, t.portable_file;

-- Memory sets per run and call site, with their GPU time and bytes.
-- @column run_id              `runs.run_id`
-- @column api                 the set's API ('cudaMemsetAsync', ...); NULL when the call was not recorded
-- @column site_function       the call site's function
-- @column site_file           the call site's file in this run
-- @column site_line           the call site's line in this run
-- @column site_key            `site_identity_key` of the call site
-- @column site_portable_file  Python site: its file relative to its import root
-- @column site_is_user        true when the site is a user frame
-- @column sets                sets
-- @column bytes               bytes set
-- @column gpu_time_ns         summed GPU time, nanoseconds
CREATE OR REPLACE VIEW memset_sites AS
SELECT
    r.run_id,
    n.name AS api,
    t.function AS site_function,
    arg_max(s.site_file, g.gpu_time_ns) AS site_file,
    arg_max(s.site_line, g.gpu_time_ns) AS site_line,
    t.site_key,
    t.portable_file AS site_portable_file,
    bool_or(s.site_is_user) AS site_is_user,
    sum(g.executions)::BIGINT AS sets,
    sum(g.bytes)::UBIGINT AS bytes,
    sum(g.gpu_time_ns)::BIGINT AS gpu_time_ns
FROM gpu_time_counts g
JOIN runs r USING (run_number)
LEFT JOIN event_names n ON n.name_id = g.name_id
LEFT JOIN stack_sites s ON s.stack_id = g.stack_id
LEFT JOIN sites t ON t.site_id = s.site_id
WHERE g.kind = 'memset'
GROUP BY r.run_id, n.name, t.function, t.site_key, t.portable_file;

-- GPU time per run and stack (of the launch, or of the capture for a replayed graph's nodes):
-- what `tbpipe show` prints beside a traceback.
-- @column run_id        `runs.run_id`
-- @column stack_id      `stacks.stack_id`
-- @column role          'launch': GPU work this stack launched; 'capture': kernels of replayed graphs whose node this stack's launch was captured into
-- @column kind          activity kind
-- @column executions    activity records
-- @column gpu_time_ns   summed GPU time, nanoseconds
CREATE OR REPLACE VIEW stack_gpu_time AS
SELECT r.run_id, g.stack_id, 'launch' AS role, g.kind, sum(g.executions)::BIGINT AS executions,
       sum(g.gpu_time_ns)::BIGINT AS gpu_time_ns
FROM gpu_time_counts g JOIN runs r USING (run_number)
WHERE g.stack_id IS NOT NULL
GROUP BY r.run_id, g.stack_id, g.kind
UNION ALL
SELECT r.run_id, g.capture_stack_id AS stack_id, 'capture' AS role, g.kind, sum(g.executions)::BIGINT,
       sum(g.gpu_time_ns)::BIGINT
FROM gpu_time_counts g JOIN runs r USING (run_number)
WHERE g.capture_stack_id IS NOT NULL
GROUP BY r.run_id, g.capture_stack_id, g.kind;
