-- How well the native frames are symbolized, per module and per reason.
-- @requires stacks

-- A symbolizer reason without what differs per module or address, so that like reasons group
-- together: "no debug info for build-ID 1a2b3c4d5e6f… (looked in: ...)" -> "no debug info for build-ID …".
-- @arg reason  VARCHAR  `symbols.reason` / `stack_frames.reason`
-- @returns VARCHAR
CREATE OR REPLACE MACRO reason_category(reason) AS
    regexp_replace(
        regexp_replace(
            regexp_replace(split_part(reason, ' (looked in:', 1), '0x[0-9a-f]+', '0x…', 'g'),
            '\b[0-9a-f]{8,}…?', '…', 'g'
        ),
        ' (in|of) /[^ ]+$', ''
    );

-- Per module: the debug info found and how many of its stored addresses resolve.
-- @column module_key     `modules.module_key`
-- @column build_id       `modules.build_id` (NULL for a module without one)
-- @column path           where the module was last loaded from
-- @column quality        'dwarf', 'symbols' or 'none'
-- @column addresses      distinct addresses of this module in `symbols`
-- @column unsymbolized   of those, addresses without a function name
-- @column reason         what was found, or why nothing was
-- @column found_via      where the debug info came from: debug-dir, build-id-dir, debuginfod-cache, module, debuglink, or 'debuginfod URL' (that server)
-- @column debug_file     the file the symbols were read from
CREATE OR REPLACE VIEW symbol_coverage AS
SELECT
    m.module_key,
    m.build_id,
    m.path,
    m.quality,
    count(s.address) AS addresses,
    count(s.address) FILTER (WHERE s.function IS NULL) AS unsymbolized,
    m.reason,
    m.found_via,
    m.debug_file
FROM modules m
LEFT JOIN symbols s ON s.module_key = m.module_key AND s.depth = 0
GROUP BY m.module_key, m.build_id, m.path, m.quality, m.reason, m.found_via, m.debug_file;

-- Native frames of all stacks that have no function name, grouped by why (`reason_category`).
-- @column reason     why the frames are unsymbolized
-- @column frames     number of such frames (one per native address per stack)
-- @column modules    number of distinct modules they are in
-- @column module_keys  those modules' keys (`modules.module_key`)
CREATE OR REPLACE VIEW unsymbolized_frames AS
SELECT
    reason_category(coalesce(reason, 'not symbolized')) AS reason,
    count(*) AS frames,
    count(DISTINCT module_key) AS modules,
    list(DISTINCT module_key ORDER BY module_key) AS module_keys
FROM stack_frames
WHERE kind = 'native' AND chain_depth = 0 AND function IS NULL
GROUP BY ALL;
