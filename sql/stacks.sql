-- Whole stacks as text, and a key for a stack that survives rebuilds.

-- One line of a printed traceback: `file:line:function`, with ' [inlined]' for an inlined frame;
-- an unsymbolized native frame shows its module and address.
-- @arg kind      VARCHAR   `stack_frames.kind`
-- @arg function  VARCHAR   `stack_frames.function`
-- @arg file      VARCHAR   `stack_frames.file`
-- @arg line      INTEGER   `stack_frames.line`
-- @arg module    VARCHAR   `stack_frames.module`
-- @arg address   UBIGINT   `stack_frames.address`
-- @arg inlined   BOOLEAN   `stack_frames.inlined`
-- @returns VARCHAR
CREATE OR REPLACE MACRO frame_text(kind, function, file, line, module, address, inlined) AS
    CASE WHEN kind = 'marker' THEN function
    ELSE coalesce(file, regexp_extract(module, '[^/]*$'), '??') || ':' || coalesce(CAST(line AS VARCHAR), '?') || ':'
         || coalesce(function, regexp_extract(module, '[^/]*$') || '+0x' || lower(printf('%x', address)), '??')
         || CASE WHEN inlined THEN ' [inlined]' ELSE '' END
    END;

-- Every stack as a traceback, innermost frame first, and its stable key.
-- @column stack_id   `stacks.stack_id`
-- @column stack_key  16 hex digits over (function, file, line) of all its frames: equal for the same code path across rebuilds and runs (addresses play no part)
-- @column frames     number of frames
-- @column traceback  one `frame_text` per line, innermost first
CREATE OR REPLACE VIEW stack_tracebacks AS
SELECT
    stack_id,
    substr(md5(string_agg(concat_ws(chr(31), kind, coalesce(function, ''), coalesce(file, ''), coalesce(CAST(line AS VARCHAR), '')), chr(30) ORDER BY depth)), 1, 16) AS stack_key,
    count(*) AS frames,
    string_agg(frame_text(kind, function, file, line, module, address, inlined), chr(10) ORDER BY depth) AS traceback
FROM stack_frames
GROUP BY stack_id;
