-- Inline expansion: the slots of `ingest_slots` (see combined_order.sql) become `stack_frames` rows.
--
-- Statements run by the ingest, for new stacks and again for stacks whose modules got better
-- debug info. Each native slot becomes its address's inline chain from `symbols` (innermost
-- first); Python and marker slots stay one row. Output: temp table ingest_frames, shaped like
-- `stack_frames`.

-- The frames of the stacks in `ingest_slots`, numbered innermost first.
-- @column stack_id     the stack
-- @column depth        position in the combined stack, 0 = innermost
-- @column slot         the slot the frame comes from
-- @column chain_depth  position in the slot's inline chain
-- @column kind         'python', 'native' or 'marker'
-- @column function     function name (NULL: unsymbolized native frame)
-- @column file         source file
-- @column line         source line
-- @column module       native: ELF object path
-- @column build_id     native: build-ID
-- @column address      native: ELF virtual address
-- @column exact        native: not a return address
-- @column inlined      inlined into the next frame
-- @column reason       why unsymbolized (native) or why the walk stopped (marker)
CREATE OR REPLACE TEMP TABLE ingest_frames AS
SELECT
    s.stack_id,
    (row_number() OVER (PARTITION BY s.stack_id ORDER BY s.slot, coalesce(y.depth, 0)) - 1)::INTEGER AS depth,
    s.slot,
    coalesce(y.depth, 0)::INTEGER AS chain_depth,
    s.kind,
    CASE WHEN s.kind = 'native' THEN y.function ELSE s.function END AS function,
    CASE WHEN s.kind = 'native' THEN y.file ELSE s.file END AS file,
    CASE WHEN s.kind = 'native' THEN y.line ELSE s.line END AS line,
    s.module,
    s.build_id,
    s.address,
    s.exact,
    coalesce(y.inlined, false) AS inlined,
    CASE
        WHEN s.kind <> 'native' THEN s.reason
        WHEN s.build_id IS NULL THEN 'the run does not describe this frame''s module'
        WHEN y.build_id IS NULL THEN 'not symbolized'
        ELSE y.reason
    END AS reason
FROM ingest_slots s
LEFT JOIN symbols y ON s.kind = 'native' AND y.build_id = s.build_id AND y.address = s.address AND y.exact = s.exact;
