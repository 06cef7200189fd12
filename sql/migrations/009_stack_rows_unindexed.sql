-- Schema version 9: a stack's frame rows found without an index. The ingest writes
-- `stack_frame_rows` in stack id order (new stacks take increasing ids, a transaction inserts its
-- stacks' rows by id), so each row group covers a narrow range of stack ids and DuckDB's min/max
-- statistics lead a lookup of one stack to the one row group holding it: as fast as the index
-- (0.8 ms on a 10M-event database, 3.8M rows). The index cost the ingest an entry per frame row, the
-- most of any table (1.8 s of a 10M-event ingest, 0.7 bytes per event on disk); it still helped a
-- lookup of many stacks at once (10 stacks: 3 ms with it, 6 ms without), which no page waits on.
-- Stacks re-laid out after better debug info arrive get their rows appended, in a later row group:
-- still found, through that group's statistics.

DROP INDEX IF EXISTS stack_frame_rows_by_stack;
