-- Schema version 4: the two big tables hold integers, their text once elsewhere.
--
-- A nightly rebuild makes every stack new, and each new stack brought ~13 frame rows of text
-- (function, file, module, build-ID...) that other stacks already had; each event repeated its
-- run id, kind and name. Frames are now stored once each (`frames`) and stacks list them by id
-- (`stack_frame_rows`); events refer to their run and name by number (`event_rows`). The views
-- `stack_frames` and `events` (sql/stacks.sql, sql/events.sql) give back the old shape, so every
-- query written against them keeps working.

-- Each distinct frame once, over all stacks.
-- @column frame_id     number of the frame in this database
-- @column frame_hash   DuckDB's hash of all the columns below (`frame_hash` in sql/stacks.sql): finds a stored frame by content
-- @column kind         'python', 'native' or 'marker'
-- @column function     Python qualified name or demangled C/C++ name; NULL for an unsymbolized native frame
-- @column file         source file
-- @column line         source line, NULL when unknown
-- @column first_line   first line of a Python frame's function, NULL otherwise or when unknown
-- @column module       path of the ELF object (native frames)
-- @column module_key   `modules.module_key` (native frames)
-- @column address      ELF virtual address (native frames)
-- @column exact        false when `address` is a return address (native frames)
-- @column inlined      true for a frame inlined into the next one
-- @column reason       why a native frame is unsymbolized or only partly symbolized
CREATE TABLE frames (
    frame_id INTEGER NOT NULL,
    frame_hash UBIGINT NOT NULL,
    kind VARCHAR NOT NULL,
    function VARCHAR,
    file VARCHAR,
    line INTEGER,
    first_line INTEGER,
    module VARCHAR,
    module_key VARCHAR,
    address UBIGINT,
    exact BOOLEAN,
    inlined BOOLEAN NOT NULL,
    reason VARCHAR
);

-- The frames of every stack in combined order, innermost first, by frame id.
-- @column stack_id     `stacks.stack_id`
-- @column depth        position in the combined stack, 0 = innermost
-- @column slot         position before inline expansion: frames of one native address share a slot
-- @column chain_depth  position in the slot's inline chain, 0 = innermost; 0 for Python frames
-- @column frame_id     `frames.frame_id`
CREATE TABLE stack_frame_rows (
    stack_id BIGINT NOT NULL,
    depth INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    chain_depth INTEGER NOT NULL,
    frame_id INTEGER NOT NULL
);

INSERT INTO frames
SELECT
    (row_number() OVER (ORDER BY kind, function, file, line, first_line, module, address, exact, inlined, reason))::INTEGER,
    hash(kind, function, file, line, first_line, module, module_key, address, exact, inlined, reason),
    kind, function, file, line, first_line, module, module_key, address, exact, inlined, reason
FROM (
    SELECT DISTINCT kind, function, file, line, first_line, module, module_key, address, exact, inlined, reason
    FROM stack_frames
);

INSERT INTO stack_frame_rows
SELECT s.stack_id, s.depth, s.slot, s.chain_depth, f.frame_id
FROM stack_frames s
JOIN frames f
    ON f.kind = s.kind
   AND f.function IS NOT DISTINCT FROM s.function
   AND f.file IS NOT DISTINCT FROM s.file
   AND f.line IS NOT DISTINCT FROM s.line
   AND f.first_line IS NOT DISTINCT FROM s.first_line
   AND f.module IS NOT DISTINCT FROM s.module
   AND f.module_key IS NOT DISTINCT FROM s.module_key
   AND f.address IS NOT DISTINCT FROM s.address
   AND f.exact IS NOT DISTINCT FROM s.exact
   AND f.inlined = s.inlined
   AND f.reason IS NOT DISTINCT FROM s.reason;

DROP TABLE stack_frames;

-- Every recorded event of every run, its run and name by number.
-- @column event_id    number naming the event in this database (`show --event ID`), in recording order within a run
-- @column run_number  `runs.run_number`
-- @column ts          when the event was recorded
-- @column thread_id   OS thread id (`runs.threads` has names)
-- @column name_id     `event_names.name_id`: the event's kind and name
-- @column stack_id    `stacks.stack_id`; NULL when no stack was taken or a killed process never flushed it
-- @column attrs       attributes (grid, block, stream, correlation id, ...) as JSON
CREATE TABLE event_rows (
    event_id BIGINT NOT NULL,
    run_number INTEGER NOT NULL,
    ts TIMESTAMPTZ NOT NULL,
    thread_id BIGINT NOT NULL,
    name_id INTEGER NOT NULL,
    stack_id BIGINT,
    attrs JSON
);

INSERT INTO event_rows
SELECT e.event_id, r.run_number, e.ts, e.thread_id, n.name_id, e.stack_id, e.attrs
FROM events e
JOIN runs r USING (run_id)
JOIN event_names n USING (kind, name)
ORDER BY e.event_id;

DROP TABLE events;

-- Events counted per run, kind/name and call site (`event_counts` summed over the stacks of each
-- site), with where the site was in that run: what `call_sites` reads. Kept by the ingest with
-- each run, and rebuilt whenever stacks are sited again.
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column site_id     `sites.site_id`; NULL for events without a stack or a stack without a site
-- @column events      number of events
-- @column site_file   the site frame's file in this run (where most of the site's events were)
-- @column site_line   the site frame's line in this run (likewise)
-- @column site_is_user  true when the site is a user frame
CREATE TABLE site_counts (
    run_number INTEGER NOT NULL,
    name_id INTEGER NOT NULL,
    site_id BIGINT,
    events BIGINT NOT NULL,
    site_file VARCHAR,
    site_line INTEGER,
    site_is_user BOOLEAN
);

INSERT INTO site_counts
SELECT c.run_number, c.name_id, s.site_id, sum(c.events), arg_max(s.site_file, c.events),
       arg_max(s.site_line, c.events), bool_or(s.site_is_user)
FROM event_counts c
LEFT JOIN stack_sites s USING (stack_id)
GROUP BY c.run_number, c.name_id, s.site_id;
