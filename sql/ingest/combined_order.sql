-- Combined order of new stacks: where each Python frame goes among the native frames.
--
-- Statements run by the ingest (not installed in the database). Inputs, registered from Arrow:
--   ingest_native(stack_id, idx, build_id, module, address, flags)  raw native frames, innermost first
--   ingest_python(stack_id, idx, function, file, line, flags)       raw Python frames, innermost first
--   ingest_stacks(stack_id, stack_hash, status, native_frames, python_frames)
--   ingest_stop_reasons(code, reason)                               schemas.raw.STOP_REASONS
-- Output: temp tables ingest_shape and ingest_slots.
--
-- The rule (tbpipe.pipeline.interleave, ARCHITECTURE §5): each native eval-loop frame stands for
-- the run of Python frames from the next unclaimed one up to and including the next entry frame.
-- So Python frames fall into groups ended by entry frames, and the k-th eval-loop frame (marker
-- frames never count) takes the k-th group. Eval-loop frames beyond the last group stay native
-- frames. Groups left over follow a native walk that stopped early; without such a stop they mean
-- the two walks disagree, and the stack is shown as its Python frames alone.

-- Native frames with their eval-loop rank.
-- @column is_marker  the walk stopped here (flag 128)
-- @column is_eval    a CPython eval-loop frame (flag 1) that is not a marker
-- @column eval_rank  0-based rank among the stack's eval-loop frames; NULL for other frames
CREATE OR REPLACE TEMP TABLE ingest_native_ranked AS
SELECT
    n.*,
    (n.flags & 128) <> 0 AS is_marker,
    (n.flags & 1) <> 0 AND (n.flags & 128) = 0 AS is_eval,
    CASE WHEN (n.flags & 1) <> 0 AND (n.flags & 128) = 0 THEN
        sum(CASE WHEN (n.flags & 1) <> 0 AND (n.flags & 128) = 0 THEN 1 ELSE 0 END)
            OVER (PARTITION BY n.stack_id ORDER BY n.idx ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) - 1
    END AS eval_rank
FROM ingest_native n;

-- Python frames with their group.
-- @column grp  number of entry frames (flag 1) before this frame: the eval-loop rank that runs it
CREATE OR REPLACE TEMP TABLE ingest_python_grouped AS
SELECT
    p.*,
    coalesce(
        sum(CASE WHEN (p.flags & 1) <> 0 THEN 1 ELSE 0 END)
            OVER (PARTITION BY p.stack_id ORDER BY p.idx ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING),
        0
    ) AS grp
FROM ingest_python p;

-- How each new stack is put together.
-- @column stack_id     the stack
-- @column evals        eval-loop frames
-- @column groups       Python frame groups
-- @column truncated    the native walk stopped early (a marker frame)
-- @column leftover     Python frames no eval-loop frame claims
-- @column python_only  the stack is shown as its Python frames alone (no native frames, or walks that disagree)
-- @column problem      why the order cannot be fully trusted, else NULL (interleave.CombinedOrder.problem)
CREATE OR REPLACE TEMP TABLE ingest_shape AS
WITH native_counts AS (
    SELECT stack_id, count(*) FILTER (WHERE is_eval) AS evals, bool_or(is_marker) AS truncated
    FROM ingest_native_ranked
    GROUP BY stack_id
), python_counts AS (
    SELECT p.stack_id, max(p.grp) + 1 AS groups, count(*) FILTER (WHERE p.grp >= coalesce(n.evals, 0)) AS leftover
    FROM ingest_python_grouped p
    LEFT JOIN native_counts n USING (stack_id)
    GROUP BY p.stack_id
), counted AS (
    SELECT
        s.stack_id,
        (s.status & 4) = 0 AND s.native_frames > 0 AS has_native,
        coalesce(n.evals, 0) AS evals,
        coalesce(p.groups, 0) AS groups,
        coalesce(n.truncated, false) AS truncated,
        coalesce(p.leftover, 0) AS leftover,
        s.native_frames
    FROM ingest_stacks s
    LEFT JOIN native_counts n USING (stack_id)
    LEFT JOIN python_counts p USING (stack_id)
)
SELECT
    stack_id,
    evals,
    groups,
    truncated,
    leftover,
    native_frames,
    NOT has_native OR (leftover > 0 AND NOT truncated) AS python_only,
    CASE
        WHEN has_native AND leftover > 0 AND truncated THEN
            'native walk stopped early; ' || leftover || ' outer Python frames follow it'
        WHEN has_native AND leftover > 0 THEN
            leftover || ' Python frames had no eval-loop frame to match; showing the Python stack alone'
    END AS problem
FROM counted;

-- Every frame of the new stacks in combined order, before inline expansion.
-- @column stack_id  the stack
-- @column slot      0-based position in the combined order
-- @column kind      'python', 'native' or 'marker'
-- @column function  Python qualified name; for a marker, what stopped the walk; NULL for native frames (from `symbols`)
-- @column file      Python file
-- @column line      Python line, NULL when unknown
-- @column module    native: path of the ELF object
-- @column build_id  native: `modules.build_id`, NULL when the run did not describe the module
-- @column address   native: ELF virtual address (marker: the stop reason's code)
-- @column exact     native: the address is not a return address (flag 4)
-- @column reason    marker: the stop reason
CREATE OR REPLACE TEMP TABLE ingest_slots AS
WITH placed AS (
    SELECT
        p.stack_id,
        CASE WHEN sh.python_only THEN p.idx WHEN p.grp < sh.evals THEN e.idx ELSE sh.native_frames + p.idx END AS major,
        CASE WHEN sh.python_only OR p.grp >= sh.evals THEN 0 ELSE p.idx + 1 END AS minor,
        'python' AS kind,
        p.function,
        p.file,
        CASE WHEN p.line >= 0 THEN p.line END AS line,
        NULL::VARCHAR AS module,
        NULL::VARCHAR AS build_id,
        NULL::UBIGINT AS address,
        NULL::BOOLEAN AS exact,
        NULL::VARCHAR AS reason
    FROM ingest_python_grouped p
    JOIN ingest_shape sh USING (stack_id)
    LEFT JOIN ingest_native_ranked e ON e.stack_id = p.stack_id AND e.eval_rank = p.grp
    UNION ALL
    SELECT
        n.stack_id,
        n.idx AS major,
        0 AS minor,
        CASE WHEN n.is_marker THEN 'marker' ELSE 'native' END AS kind,
        CASE WHEN n.is_marker THEN '<native walk stopped: ' || coalesce(r.reason, 'stop reason ' || n.address) || '>' END AS function,
        NULL AS file,
        NULL AS line,
        CASE WHEN NOT n.is_marker THEN n.module END AS module,
        CASE WHEN NOT n.is_marker THEN n.build_id END AS build_id,
        n.address,
        CASE WHEN NOT n.is_marker THEN (n.flags & 4) <> 0 END AS exact,
        CASE WHEN n.is_marker THEN coalesce(r.reason, 'stop reason ' || n.address) END AS reason
    FROM ingest_native_ranked n
    JOIN ingest_shape sh USING (stack_id)
    LEFT JOIN ingest_stop_reasons r ON n.is_marker AND r.code = n.address
    WHERE NOT sh.python_only AND NOT (n.is_eval AND n.eval_rank < sh.groups)
)
SELECT
    stack_id,
    (row_number() OVER (PARTITION BY stack_id ORDER BY major, minor) - 1)::INTEGER AS slot,
    kind, function, file, line, module, build_id, address, exact, reason
FROM placed;
