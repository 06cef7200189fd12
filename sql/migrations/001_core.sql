-- Schema version 1: the core tables written by `tbpipe ingest`.
--
-- Runs, their events and loaded objects are per run; stacks, their frames and symbols are shared by
-- all runs (a stack is stored once however many runs and events use it). No table has a foreign
-- key: the ingest keeps them consistent inside one transaction per run, under the ingest lock.

-- One row per ingested run (one captured process), from its manifest.
-- @column run_id                 the run's id, `YYYYmmddTHHMMSS-<pid>-<random>` (UTC start time)
-- @column run_number             small number of the run in this database (keys `event_counts`)
-- @column parent_run_id          run of the process that forked or started this one, or NULL
-- @column started_at             when capture started
-- @column ended_at               when capture closed cleanly; NULL for an incomplete run
-- @column complete               false when the process died before closing its session (e.g. SIGKILL): the run holds what was flushed
-- @column host                   host name of the captured process
-- @column pid                    process id
-- @column argv                   command line of the process
-- @column cwd                    working directory of the process
-- @column labels                 user labels, e.g. {'suite': 'bert', 'commit': 'abc123'}: `labels['suite']`
-- @column python_version         CPython version, e.g. '3.11.7'
-- @column python_implementation  'CPython'
-- @column torch_version          torch version when the program imported torch, else NULL
-- @column tbpipe_version         version of the tbpipe that captured the run
-- @column sources                event sources switched on (e.g. 'cupti', 'aten')
-- @column capture                capture settings (python/native frames, flush interval, fork policy) as JSON
-- @column threads                OS thread id -> Python thread name, for threads alive at some flush
-- @column events_recorded        events the capture counted
-- @column events_dropped         events the capture had to drop (full buffers)
-- @column events                 events of this run in `events`
-- @column stacks                 distinct stacks this run's events use
-- @column new_stacks             stacks this run added to `stacks` (not seen in an earlier run)
-- @column capture_errors         problems the capture's background writer met (e.g. a full disk)
-- @column ingest_notes           what the ingest noticed, e.g. events whose stack was never flushed by a killed process
-- @column source_dir             folder the run was ingested from
-- @column parts                  fingerprint of the run's files when ingested: an incomplete run whose files changed is ingested again
-- @column ingested_at            when this row was written
-- @column manifest               the whole manifest as JSON
CREATE TABLE runs (
    run_id VARCHAR PRIMARY KEY,
    run_number INTEGER NOT NULL,
    parent_run_id VARCHAR,
    started_at TIMESTAMPTZ,
    ended_at TIMESTAMPTZ,
    complete BOOLEAN NOT NULL,
    host VARCHAR,
    pid BIGINT,
    argv VARCHAR[],
    cwd VARCHAR,
    labels MAP(VARCHAR, VARCHAR),
    python_version VARCHAR,
    python_implementation VARCHAR,
    torch_version VARCHAR,
    tbpipe_version VARCHAR,
    sources VARCHAR[],
    capture JSON,
    threads MAP(BIGINT, VARCHAR),
    events_recorded BIGINT,
    events_dropped BIGINT,
    events BIGINT NOT NULL,
    stacks BIGINT NOT NULL,
    new_stacks BIGINT NOT NULL,
    capture_errors VARCHAR[],
    ingest_notes VARCHAR[],
    source_dir VARCHAR NOT NULL,
    parts VARCHAR NOT NULL,
    ingested_at TIMESTAMPTZ NOT NULL,
    manifest JSON NOT NULL
);

-- One row per ELF object (by build-ID) any run loaded: what debug info the symbolizer found for it.
-- @column build_id     lowercase hex build-ID; 'path:' + path for an object without a build-ID note
-- @column path         path it was last loaded from
-- @column quality      'dwarf' (lines and inline frames), 'symbols' (function names only) or 'none'
-- @column reason       what was found and where, or why nothing was ("no debug info for build-ID ... (looked in: ...)")
-- @column debug_file   the file symbols were read from, or NULL
-- @column found_via    how debug_file was found: debug-dir, build-id-dir, debuginfod-cache, module, debuglink
-- @column checked_at   when the symbolizer last decided this
CREATE TABLE modules (
    build_id VARCHAR PRIMARY KEY,
    path VARCHAR,
    quality VARCHAR,
    reason VARCHAR,
    debug_file VARCHAR,
    found_via VARCHAR,
    checked_at TIMESTAMPTZ
);

-- The ELF objects one run had loaded and its stacks refer to.
-- @column run_id        the run (`runs.run_id`)
-- @column module_index  the object's index in the run's raw files
-- @column build_id      `modules.build_id`
-- @column path          path the object was loaded from
-- @column load_bias     runtime address minus ELF virtual address
-- @column exec_ranges   executable ranges as ELF virtual addresses
CREATE TABLE run_modules (
    run_id VARCHAR NOT NULL,
    module_index INTEGER NOT NULL,
    build_id VARCHAR,
    path VARCHAR,
    load_bias UBIGINT,
    exec_ranges STRUCT(lo UBIGINT, hi UBIGINT)[]
);

-- The persistent symbol store's answers: every native (build-ID, address) ever seen, with its inline chain.
-- One row per frame of the chain; an address that could not be symbolized has one row with function NULL and a reason.
-- @column build_id  `modules.build_id`
-- @column address   the captured address as an ELF virtual address (return addresses included: see `exact`)
-- @column exact     false for a return address, looked up at address - 1 (the call instruction)
-- @column depth     position in the inline chain, 0 = innermost
-- @column function  demangled function name, NULL when unknown
-- @column file      source file, NULL when unknown
-- @column line      source line, NULL when unknown
-- @column inlined   true for every frame of the chain but the outermost (the physical function)
-- @column reason    why the address is unsymbolized or only partly symbolized, else NULL
CREATE TABLE symbols (
    build_id VARCHAR NOT NULL,
    address UBIGINT NOT NULL,
    exact BOOLEAN NOT NULL,
    depth INTEGER NOT NULL,
    function VARCHAR,
    file VARCHAR,
    line INTEGER,
    inlined BOOLEAN NOT NULL,
    reason VARCHAR
);

-- Each distinct stack once, over all runs: identified by its content (modules by build-ID, Python
-- code by file, name and first line), so the same stack in two runs is one row.
-- @column stack_id       small number naming the stack in this database (`show --stack ID`)
-- @column stack_hash     64-bit hash of the stack's portable content; equal stacks of any run have equal hashes
-- @column status         raw status bits: 1 native walk cut short, 2 Python frames capped, 4 no native frames asked for, 8 no Python frames asked for
-- @column native_frames  raw native frames (before inline expansion), marker included
-- @column python_frames  Python frames
-- @column frames         rows in `stack_frames` (inline frames and marker included)
-- @column problem           why the combined order could not be fully trusted, else NULL
-- @column symbolized_depth  depth of the innermost frame with a function name: the call site of a stack without user frames; NULL when none
-- @column first_run_id      the run that brought the stack in
CREATE TABLE stacks (
    stack_id BIGINT NOT NULL,
    stack_hash UBIGINT NOT NULL,
    status UINTEGER NOT NULL,
    native_frames INTEGER NOT NULL,
    python_frames INTEGER NOT NULL,
    frames INTEGER NOT NULL,
    problem VARCHAR,
    symbolized_depth INTEGER,
    first_run_id VARCHAR NOT NULL
);

-- The frames of every stack in combined order, innermost first: Python frames where the C code
-- ran them (each CPython eval-loop frame replaced by the Python frames it executed), native frames
-- expanded into their inline chains.
-- @column stack_id     `stacks.stack_id`
-- @column depth        position in the combined stack, 0 = innermost
-- @column slot         position before inline expansion: frames of one native address share a slot
-- @column chain_depth  position in the slot's inline chain, 0 = innermost; 0 for Python frames
-- @column kind         'python', 'native', or 'marker' (the native walk stopped here; function says why)
-- @column function     Python qualified name or demangled C/C++ name; NULL for an unsymbolized native frame
-- @column file         source file
-- @column line         source line, NULL when unknown
-- @column module       path of the ELF object (native frames)
-- @column build_id     `modules.build_id` (native frames)
-- @column address      ELF virtual address (native frames)
-- @column exact        false when `address` is a return address (native frames)
-- @column inlined      true for a frame inlined into the next one
-- @column reason       why a native frame is unsymbolized or only partly symbolized
CREATE TABLE stack_frames (
    stack_id BIGINT NOT NULL,
    depth INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    chain_depth INTEGER NOT NULL,
    kind VARCHAR NOT NULL,
    function VARCHAR,
    file VARCHAR,
    line INTEGER,
    module VARCHAR,
    build_id VARCHAR,
    address UBIGINT,
    exact BOOLEAN,
    inlined BOOLEAN NOT NULL,
    reason VARCHAR
);

-- Every recorded event of every run.
-- @column event_id   number naming the event in this database (`show --event ID`), in recording order within a run
-- @column run_id     `runs.run_id`
-- @column ts         when the event was recorded
-- @column thread_id  OS thread id (`runs.threads` has names)
-- @column kind       'kernel_launch', 'op', 'alloc', 'user', ...
-- @column name       kernel, op or user name
-- @column stack_id   `stacks.stack_id`; NULL when no stack was taken or a killed process never flushed it
-- @column attrs      attributes (grid, block, stream, correlation id, ...) as JSON
CREATE TABLE events (
    event_id BIGINT NOT NULL,
    run_id VARCHAR NOT NULL,
    ts TIMESTAMPTZ NOT NULL,
    thread_id BIGINT NOT NULL,
    kind VARCHAR NOT NULL,
    name VARCHAR NOT NULL,
    stack_id BIGINT,
    attrs JSON
);

-- Each distinct (kind, name) of the events once, numbered (keys `event_counts`).
-- @column name_id  the pair's number
-- @column kind     event kind
-- @column name     event name
CREATE TABLE event_names (
    name_id INTEGER PRIMARY KEY,
    kind VARCHAR NOT NULL,
    name VARCHAR NOT NULL
);

-- Events counted per run, kind/name and stack: what `call_sites` adds up, kept by the ingest in
-- the same transaction as the events. Integer keys, because grouping a few million rows on long
-- kernel names is what would make the call-site views slow.
-- @column run_number  `runs.run_number`
-- @column name_id     `event_names.name_id`
-- @column stack_id    `stacks.stack_id`, NULL for events without a stack
-- @column events      number of events
CREATE TABLE event_counts (
    run_number INTEGER NOT NULL,
    name_id INTEGER NOT NULL,
    stack_id BIGINT,
    events BIGINT NOT NULL
);

-- Each distinct call site once: a (function, file, line) some stack is sited at.
-- @column site_id   number of the site in this database
-- @column site_key  `call_site_key(function, file, line)`: stable across rebuilds, runs and databases
-- @column function  the site frame's function
-- @column file      the site frame's file
-- @column line      the site frame's line
CREATE TABLE sites (
    site_id BIGINT PRIMARY KEY,
    site_key VARCHAR NOT NULL,
    function VARCHAR,
    file VARCHAR,
    line INTEGER
);

-- The call site of every stack under the current `user_code` rules (`stack_sites_from` computes
-- it; the ingest keeps this table in step: new stacks as they come in, every stack when the rules
-- or a stack's symbols change).
-- @column stack_id      `stacks.stack_id`
-- @column site_id       `sites.site_id`; NULL when the stack has no symbolized frame
-- @column site_depth    depth of the site frame in `stack_frames`
-- @column site_kind     'python' or 'native'
-- @column site_is_user  true when the site is a user frame; false when the stack has none and the site is its innermost symbolized frame
CREATE TABLE stack_sites (
    stack_id BIGINT NOT NULL,
    site_id BIGINT,
    site_depth INTEGER,
    site_kind VARCHAR,
    site_is_user BOOLEAN NOT NULL
);

-- Values the ingest keeps for itself.
-- @column key    what the value is: 'sited_with_rules' = hash of the `user_code` rules `stack_sites` was computed with
-- @column value  the value
CREATE TABLE settings (
    key VARCHAR PRIMARY KEY,
    value VARCHAR
);

-- Which Python files count as user code when events are sited (`call_sites`), beside the built-in
-- rule (standard library, site-packages and tbpipe are not user code). The longest matching prefix
-- wins. Set with `tbpipe ingest --user-code PREFIX` (or `!PREFIX` for not-user-code); rows with
-- origin 'tbpipe' are tbpipe's own source folders, added by every ingest.
-- @column prefix    a path prefix ('/srv/app/') or, without a leading '/', a path part matched after any '/' ('mylib/')
-- @column is_user   true: matching files are user code; false: they are not
-- @column origin    'user' (from --user-code) or 'tbpipe'
-- @column added_at  when the rule was set
CREATE TABLE user_code (
    prefix VARCHAR PRIMARY KEY,
    is_user BOOLEAN NOT NULL,
    origin VARCHAR NOT NULL,
    added_at TIMESTAMPTZ NOT NULL
);
