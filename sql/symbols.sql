-- How well the native frames are symbolized, per module and per reason.

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

-- Per module (build-ID): the debug info found and how many of its stored addresses resolve.
-- @column build_id       `modules.build_id`
-- @column path           where the module was last loaded from
-- @column quality        'dwarf', 'symbols' or 'none'
-- @column addresses      distinct addresses of this module in `symbols`
-- @column unsymbolized   of those, addresses without a function name
-- @column reason         what was found, or why nothing was
CREATE OR REPLACE VIEW symbol_coverage AS
SELECT
    m.build_id,
    m.path,
    m.quality,
    count(s.address) AS addresses,
    count(s.address) FILTER (WHERE s.function IS NULL) AS unsymbolized,
    m.reason
FROM modules m
LEFT JOIN symbols s ON s.build_id = m.build_id AND s.depth = 0
GROUP BY m.build_id, m.path, m.quality, m.reason;

-- Native frames of all stacks that have no function name, grouped by why (`reason_category`).
-- @column reason     why the frames are unsymbolized
-- @column frames     number of such frames (one per native address per stack)
-- @column modules    number of distinct modules they are in
-- @column build_ids  those modules' build-IDs
CREATE OR REPLACE VIEW unsymbolized_frames AS
SELECT
    reason_category(coalesce(reason, 'not symbolized')) AS reason,
    count(*) AS frames,
    count(DISTINCT build_id) AS modules,
    list(DISTINCT build_id ORDER BY build_id) AS build_ids
FROM stack_frames
WHERE kind = 'native' AND chain_depth = 0 AND function IS NULL
GROUP BY ALL;
