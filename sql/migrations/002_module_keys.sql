-- Schema version 2: modules are named by `module_key`, and `build_id` holds only real build-IDs.
--
-- Version 1 called the module key `build_id` although it also held 'path:...' (an object without
-- a build-ID note) and 'invalid:...' (a note that cannot be a build-ID). The key keeps its
-- encoding (`tbpipe.pipeline.symbols.modulekey`: garbage text is now cut at 200 characters);
-- the columns holding it are renamed, and `modules` gains the build-ID alone.

ALTER TABLE modules RENAME COLUMN build_id TO module_key;
ALTER TABLE run_modules RENAME COLUMN build_id TO module_key;
ALTER TABLE symbols RENAME COLUMN build_id TO module_key;
ALTER TABLE stack_frames RENAME COLUMN build_id TO module_key;

-- Garbage build-IDs longer than the key keeps: the same rows under their new key.
UPDATE modules SET module_key = 'invalid:' || left(module_key[9:], 200)
WHERE starts_with(module_key, 'invalid:') AND length(module_key) > 208;
UPDATE run_modules SET module_key = 'invalid:' || left(module_key[9:], 200)
WHERE starts_with(module_key, 'invalid:') AND length(module_key) > 208;
UPDATE symbols SET module_key = 'invalid:' || left(module_key[9:], 200)
WHERE starts_with(module_key, 'invalid:') AND length(module_key) > 208;
UPDATE stack_frames SET module_key = 'invalid:' || left(module_key[9:], 200)
WHERE starts_with(module_key, 'invalid:') AND length(module_key) > 208;

ALTER TABLE modules ADD COLUMN build_id VARCHAR;
UPDATE modules SET build_id = module_key
WHERE NOT starts_with(module_key, 'path:') AND NOT starts_with(module_key, 'invalid:');

COMMENT ON COLUMN modules.module_key IS 'the module''s key: its lowercase hex build-ID; ''path:'' + path for an object without a build-ID note; ''invalid:'' + the text of a note that is not a build-ID';
COMMENT ON COLUMN modules.build_id IS 'the object''s build-ID (lowercase hex), NULL when it has none or a garbled one';
COMMENT ON COLUMN run_modules.module_key IS '`modules.module_key`';
COMMENT ON COLUMN symbols.module_key IS '`modules.module_key`';
COMMENT ON COLUMN stack_frames.module_key IS '`modules.module_key` (native frames)';
