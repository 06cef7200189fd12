-- Schema version 7: indexes for the lookups of one site or one stack. The service, `tbpipe show`
-- and the report's tracebacks read a site by its key, a stack's frames (rows, then frames by id), a stack's event counts
-- and a site's counts per run; without an index each of those scans its whole table (millions
-- of rows after a few nights, 5-10 ms each), with one it reads a few rows (under a millisecond).
-- They cost the ingest an index entry per row it adds to these tables.

-- A site by its key: `/api/sites/{key}`, `tbpipe show --site`.
CREATE INDEX IF NOT EXISTS sites_by_key ON sites (site_key);
-- A stack's frames, in order: every traceback shown.
CREATE INDEX IF NOT EXISTS stack_frame_rows_by_stack ON stack_frame_rows (stack_id);
-- Those rows' frames.
CREATE INDEX IF NOT EXISTS frames_by_id ON frames (frame_id);
-- A stack's events per run and name: a site's heaviest stacks.
CREATE INDEX IF NOT EXISTS event_counts_by_stack ON event_counts (stack_id);
-- A site's events per run and name: its history.
CREATE INDEX IF NOT EXISTS site_counts_by_site ON site_counts (site_id);
