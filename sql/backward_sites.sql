-- Backward at the forward line: each backward op (and each kernel launched inside one) sited at the
-- user frame of the forward op that made its autograd node, beside its own site.
--
-- The `torch-ops` source links the two by autograd's sequence numbers. A forward op dispatched
-- through autograd carries `seq` (the number the node it creates gets) and, from the RecordFunction
-- observer, `seq_thread` (RecordFunction's number for its thread); a backward node's event and every
-- op inside it carry `bwd_seq`, `fwd_thread` and `bwd_node`. Sequence numbers count per thread, so
-- the forward op is the one with seq = bwd_seq on thread seq_thread = fwd_thread (the dispatch mode
-- records no thread: its join is by seq alone, exact when one thread ran the forward). Several
-- forward ops can share a number (a composite op and the op inside it that made the node, or ops
-- that made no node before the one that did): the last one recorded is the one that made the node.
--
-- A kernel launch (`cuda` source) belongs to the op recorded last before it on the launching
-- thread: ops nest, so that is the innermost op running then, or one that just finished inside the
-- same backward node. "Last before" is by event id (a thread's events get ids in the order it
-- recorded them), not by time: a thread's events often share a microsecond, and how a raw run's
-- nanoseconds are cut to one differs between DuckDB versions. On the CPU backward runs on the
-- thread that called `backward()`, whose own stack ends at that line; with CUDA it runs on an
-- autograd worker thread with no Python frames at all. Either way the forward op's site is the
-- line that made the work.
--
-- Events the session left out (sampling, the per-stack limit) leave gaps: a backward op whose
-- forward op was not recorded has no forward site (NULL), nor has AccumulateGrad (no forward op).
-- @requires events
-- @requires counts

-- An integer attribute of an event: the number at `path` in its attributes, NULL where there is
-- none or it is no integer. A function call rather than `attrs ->> path`: DuckDB 1.5 (the newest
-- for CPython 3.10) binds `->>` looser than AND and NOT, so `kind = 'op' AND attrs ->> '$.seq'`
-- read as `(kind = 'op' AND attrs) ->> '$.seq'`. TRY_CAST, because an op that user code records
-- (`capture.record('op', ...)`) carries whatever attributes it was given: one such op must not
-- fail every query of the views.
-- @arg attrs  VARCHAR  `events.attrs`
-- @arg path   VARCHAR  JSON path ('$.seq')
-- @returns BIGINT
CREATE OR REPLACE MACRO integer_attr(attrs, path) AS TRY_CAST(json_extract_string(attrs, path) AS BIGINT);

-- The forward op of each autograd sequence number in each run: the last op recorded with that
-- (seq_thread, seq).
-- @column run_id           `runs.run_id`
-- @column seq_thread       RecordFunction's number for the forward thread; NULL from the dispatch mode
-- @column seq              the autograd sequence number
-- @column forward_event_id `events.event_id` of the forward op
-- @column forward_name     its name ('aten::addmm', ...)
-- @column forward_stack_id its `stacks.stack_id`
CREATE OR REPLACE VIEW autograd_forward_ops AS
SELECT
    run_id,
    seq_thread,
    seq,
    max(event_id) AS forward_event_id,
    arg_max(name, event_id) AS forward_name,
    arg_max(stack_id, event_id) AS forward_stack_id
FROM (
    SELECT
        run_id,
        event_id,
        name,
        stack_id,
        integer_attr(attrs, '$.seq') AS seq,
        integer_attr(attrs, '$.seq_thread') AS seq_thread
    FROM events
    WHERE kind = 'op'
)
WHERE seq IS NOT NULL
GROUP BY run_id, seq_thread, seq;

-- Every event recorded inside autograd's backward: op events with `bwd_seq`, and kernel launches
-- whose innermost op on the launching thread (the op recorded last before them there) had one.
-- @column event_id     `events.event_id`
-- @column run_id       `runs.run_id`
-- @column thread_id    OS thread id
-- @column kind         'op', 'kernel_launch' or 'graph_launch'
-- @column name         op or kernel name
-- @column stack_id     the event's own `stacks.stack_id`
-- @column op_event_id  the backward op the event belongs to: itself for an op, the op it was launched in for a launch
-- @column bwd_node     name of the autograd node ('AddmmBackward0', ...)
-- @column bwd_seq      the node's sequence number
-- @column fwd_thread   RecordFunction's number for the thread that ran the node's forward op; NULL from the dispatch mode
CREATE OR REPLACE VIEW backward_events AS
WITH ops AS (
    SELECT
        event_id,
        run_id,
        thread_id,
        kind,
        name,
        stack_id,
        integer_attr(attrs, '$.bwd_seq') AS bwd_seq,
        integer_attr(attrs, '$.fwd_thread') AS fwd_thread,
        json_extract_string(attrs, '$.bwd_node') AS bwd_node
    FROM events
    WHERE kind = 'op'
), launches AS (
    SELECT event_id, run_id, thread_id, kind, name, stack_id
    FROM events
    WHERE kind IN ('kernel_launch', 'graph_launch')
)
SELECT event_id, run_id, thread_id, kind, name, stack_id, event_id AS op_event_id, bwd_node, bwd_seq, fwd_thread
FROM ops
WHERE bwd_seq IS NOT NULL
UNION ALL
SELECT l.event_id, l.run_id, l.thread_id, l.kind, l.name, l.stack_id, o.event_id, o.bwd_node, o.bwd_seq, o.fwd_thread
FROM launches l
ASOF JOIN ops o ON o.run_id = l.run_id AND o.thread_id = l.thread_id AND l.event_id > o.event_id
WHERE o.bwd_seq IS NOT NULL;

-- Each event of `backward_events` with the forward op it is sited at (what `backward_op_sites` and
-- the `*_at_forward` counts read).
-- @column event_id          `events.event_id`
-- @column run_id            `runs.run_id`
-- @column thread_id         OS thread id
-- @column kind              'op', 'kernel_launch' or 'graph_launch'
-- @column name              op or kernel name
-- @column stack_id          the event's own `stacks.stack_id`
-- @column op_event_id       the backward op it belongs to (itself for an op)
-- @column bwd_node          the autograd node it ran in
-- @column bwd_seq           the node's sequence number
-- @column forward_event_id  `events.event_id` of the forward op; NULL when it was not recorded
-- @column forward_name      the forward op's name
-- @column forward_stack_id  the forward op's `stacks.stack_id`
CREATE OR REPLACE VIEW backward_forward_ops AS
SELECT
    b.event_id,
    b.run_id,
    b.thread_id,
    b.kind,
    b.name,
    b.stack_id,
    b.op_event_id,
    b.bwd_node,
    b.bwd_seq,
    f.forward_event_id,
    f.forward_name,
    f.forward_stack_id
FROM backward_events b
LEFT JOIN autograd_forward_ops f
    ON f.run_id = b.run_id AND f.seq = b.bwd_seq AND f.seq_thread IS NOT DISTINCT FROM b.fwd_thread;

-- Each event of `backward_events` with its own call site and the call site of its forward op.
-- @column event_id               `events.event_id`
-- @column run_id                 `runs.run_id`
-- @column thread_id              OS thread id
-- @column kind                   'op', 'kernel_launch' or 'graph_launch'
-- @column name                   op or kernel name
-- @column bwd_node               the autograd node it ran in
-- @column bwd_seq                the node's sequence number
-- @column op_event_id            the backward op it belongs to (itself for an op)
-- @column site_function          its own site's function (for CPU backward: where `backward()` was called)
-- @column site_file              its own site's file
-- @column site_line              its own site's line
-- @column site_key               its own site's `site_identity_key`
-- @column forward_event_id       `events.event_id` of the forward op; NULL when it was not recorded
-- @column forward_name           the forward op's name
-- @column forward_stack_id       the forward op's `stacks.stack_id` (`tbpipe show --stack`)
-- @column forward_site_function  the forward op's site: function
-- @column forward_site_file      file
-- @column forward_site_line      line
-- @column forward_site_key       `site_identity_key` of the forward op's site (`tbpipe show --site`)
-- @column forward_site_is_user   true when the forward op's site is a user frame
CREATE OR REPLACE VIEW backward_op_sites AS
SELECT
    b.event_id,
    b.run_id,
    b.thread_id,
    b.kind,
    b.name,
    b.bwd_node,
    b.bwd_seq,
    b.op_event_id,
    own_site.function AS site_function,
    own.site_file,
    own.site_line,
    own_site.site_key,
    b.forward_event_id,
    b.forward_name,
    b.forward_stack_id,
    forward_site.function AS forward_site_function,
    fwd.site_file AS forward_site_file,
    fwd.site_line AS forward_site_line,
    forward_site.site_key AS forward_site_key,
    fwd.site_is_user AS forward_site_is_user
FROM backward_forward_ops b
LEFT JOIN stack_sites own ON own.stack_id = b.stack_id
LEFT JOIN sites own_site ON own_site.site_id = own.site_id
LEFT JOIN stack_sites fwd ON fwd.stack_id = b.forward_stack_id
LEFT JOIN sites forward_site ON forward_site.site_id = fwd.site_id;

-- The backward events whose forward op was recorded, counted per run, name, own stack and forward
-- op's stack: what `--site-of forward` moves from one stack to the other. Computed from the events
-- of a run that keeps them, read from `rolled_up_forward_counts` for a rolled-up one.
-- @column run_number        `runs.run_number`
-- @column name_id           `event_names.name_id`
-- @column stack_id          the event's own stack
-- @column forward_stack_id  its forward op's stack
-- @column events            number of events
CREATE OR REPLACE VIEW backward_forward_counts AS
SELECT r.run_number, n.name_id, b.stack_id, b.forward_stack_id, count(*)::BIGINT AS events
FROM backward_forward_ops b
JOIN runs r ON r.run_id = b.run_id AND r.rolled_up_at IS NULL
JOIN event_names n ON n.kind = b.kind AND n.name = b.name
WHERE b.forward_stack_id IS NOT NULL
GROUP BY r.run_number, n.name_id, b.stack_id, b.forward_stack_id
UNION ALL
SELECT c.run_number, c.name_id, c.stack_id, c.forward_stack_id, c.events
FROM rolled_up_forward_counts c
JOIN runs r ON r.run_number = c.run_number AND r.rolled_up_at IS NOT NULL;

-- `run_stack_counts` with backward work counted at its forward op: each event whose forward op was
-- recorded counts under that op's stack instead of its own (`tbpipe report --site-of forward`).
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column stack_id    the event's own stack, or its forward op's
-- @column events      number of events
CREATE OR REPLACE VIEW event_counts_at_forward AS
WITH moved AS MATERIALIZED (
    SELECT * FROM backward_forward_counts
)
SELECT run_number, name_id, stack_id, sum(events)::BIGINT AS events
FROM (
    SELECT run_number, name_id, stack_id, events FROM run_stack_counts
    UNION ALL
    SELECT run_number, name_id, stack_id, -events FROM moved
    UNION ALL
    SELECT run_number, name_id, forward_stack_id, events FROM moved
)
GROUP BY run_number, name_id, stack_id
HAVING sum(events) <> 0;

-- `site_counts` from `event_counts_at_forward`: backward work at the site of its forward op.
-- @column run_number    `runs.run_number`
-- @column name_id       `event_names.name_id`
-- @column site_id       `sites.site_id`; NULL for events without a stack or a stack without a site
-- @column events        number of events
-- @column site_file     the site frame's file in this run (where most of the site's events were)
-- @column site_line     the site frame's line in this run (likewise)
-- @column site_is_user  true when the site is a user frame
CREATE OR REPLACE VIEW site_counts_at_forward AS
SELECT c.run_number, c.name_id, s.site_id, sum(c.events)::BIGINT AS events, arg_max(s.site_file, c.events) AS site_file,
       arg_max(s.site_line, c.events) AS site_line, bool_or(s.site_is_user) AS site_is_user
FROM event_counts_at_forward c
LEFT JOIN stack_sites s USING (stack_id)
GROUP BY c.run_number, c.name_id, s.site_id;

-- Backward events counted per run, kind, name and forward site: `call_sites` for backward work,
-- with the line that made it in place of the line that ran it.
-- @column run_id                 `runs.run_id`
-- @column kind                   'op', 'kernel_launch' or 'graph_launch'
-- @column name                   op or kernel name
-- @column forward_site_function  the forward op's site: function (NULL when no forward op was recorded)
-- @column forward_site_file      file
-- @column forward_site_line      line
-- @column forward_site_key       `site_identity_key` of the forward site
-- @column site_key               `site_identity_key` of the events' own site (where backward ran)
-- @column events                 number of events
CREATE OR REPLACE VIEW backward_call_sites AS
SELECT
    run_id,
    kind,
    name,
    forward_site_function,
    arg_max(forward_site_file, event_id) AS forward_site_file,
    arg_max(forward_site_line, event_id) AS forward_site_line,
    forward_site_key,
    site_key,
    count(*)::BIGINT AS events
FROM backward_op_sites
GROUP BY run_id, kind, name, forward_site_function, forward_site_key, site_key;
