-- Stacks as frames and as text, and a key for a stack that survives rebuilds.

-- The frames of every stack in combined order, innermost first: Python frames where the C code
-- ran them (each CPython eval-loop frame replaced by the Python frames it executed), native frames
-- expanded into their inline chains. Each frame is stored once (`frames`); this view lays them out.
-- @column stack_id     `stacks.stack_id`
-- @column depth        position in the combined stack, 0 = innermost
-- @column slot         position before inline expansion: frames of one native address share a slot
-- @column chain_depth  position in the slot's inline chain, 0 = innermost; 0 for Python frames
-- @column kind         'python', 'native', or 'marker' (the native walk stopped here; function says why)
-- @column function     Python qualified name or demangled C/C++ name; NULL for an unsymbolized native frame
-- @column file         source file
-- @column line         source line, NULL when unknown
-- @column module       path of the ELF object (native frames)
-- @column module_key   `modules.module_key` (native frames)
-- @column address      ELF virtual address (native frames)
-- @column exact        false when `address` is a return address (native frames)
-- @column inlined      true for a frame inlined into the next one
-- @column reason       why a native frame is unsymbolized or only partly symbolized
-- @column first_line   first line of a Python frame's function; NULL otherwise or when unknown
-- @column frame_id     `frames.frame_id`
CREATE OR REPLACE VIEW stack_frames AS
SELECT r.stack_id, r.depth, r.slot, r.chain_depth, f.kind, f.function, f.file, f.line, f.module, f.module_key,
       f.address, f.exact, f.inlined, f.reason, f.first_line, r.frame_id
FROM stack_frame_rows r
JOIN frames f USING (frame_id);

-- The hash that finds a stored frame by its content (`frames.frame_hash`): DuckDB's hash of every
-- column. DuckDB may change its hash between versions; then frames stored before the upgrade are
-- stored once more when they come again, and nothing else changes.
-- @arg kind        VARCHAR   'python', 'native' or 'marker'
-- @arg function    VARCHAR   function
-- @arg file        VARCHAR   file
-- @arg line        INTEGER   line
-- @arg first_line  INTEGER   first line of the Python function
-- @arg module      VARCHAR   module path
-- @arg module_key  VARCHAR   module key
-- @arg address     UBIGINT   address
-- @arg exact       BOOLEAN   exact
-- @arg inlined     BOOLEAN   inlined
-- @arg reason      VARCHAR   reason
-- @returns UBIGINT
CREATE OR REPLACE MACRO frame_hash(kind, function, file, line, first_line, module, module_key, address, exact, inlined, reason) AS
    hash(kind, function, file, line, first_line, module, module_key, address, exact, inlined, reason);

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

-- True for a Python file or native module of generated code: FX graph code ('<eval_with_key>.N'),
-- AOTAutograd's generated wrappers ('.../subclass_codegen.py:codegen(...)'), the functions tbpipe
-- records compile events from ('<tbpipe: ...>'), anything under Inductor's default cache folder
-- ('.../torchinductor_<user>/') or under a `generated_code` prefix (the folders the captured
-- processes configured). Generated code is never a call site, whatever `user_code` says.
-- @arg path  VARCHAR  a Python file name as captured, or a native module's path
-- @returns BOOLEAN
CREATE OR REPLACE MACRO is_generated_path(path) AS
    starts_with(path, '<eval_with_key>')
    OR starts_with(path, '<tbpipe: ')
    OR contains(path, '.py:codegen(')
    OR regexp_matches(path, '/torchinductor_[^/]+/')
    OR EXISTS (SELECT 1 FROM generated_code g WHERE starts_with(path, g.prefix));

-- Every stack as a traceback, innermost frame first, and its stable key.
-- @column stack_id   `stacks.stack_id`
-- @column stack_key  16 hex digits over (function, file, line) of all its frames: equal for the same code path across rebuilds and runs (addresses play no part)
-- @column frames     number of frames
-- @column traceback  one `frame_text` per line, innermost first; frames of generated code end in ' [generated]'
CREATE OR REPLACE VIEW stack_tracebacks AS
SELECT
    stack_id,
    substr(md5(string_agg(concat_ws(chr(31), kind, coalesce(function, ''), coalesce(file, ''), coalesce(CAST(line AS VARCHAR), '')), chr(30) ORDER BY depth)), 1, 16) AS stack_key,
    count(*) AS frames,
    string_agg(frame_text(kind, function, file, line, module, address, inlined)
               || CASE WHEN kind <> 'marker' AND coalesce(is_generated_path(CASE WHEN kind = 'python' THEN file ELSE module END), false)
                       THEN ' [generated]' ELSE '' END, chr(10) ORDER BY depth)
        AS traceback
FROM stack_frames
GROUP BY stack_id;
