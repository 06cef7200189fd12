-- Schema version 6: GPU time. The `cuda` source's CUPTI activity records (raw `gpu_activity` parts,
-- raw schema 2) are loaded with their run, each joined to the event of the API call that caused
-- it by its correlation id, and counted per launch and stack. Runs without GPU activity have no
-- rows here; nothing else changes.

-- One row per GPU activity record: a kernel execution, a copy, a set or a synchronization.
-- @column run_number          `runs.run_number`
-- @column activity_id         number of the record in this database, in the order of its run's parts
-- @column kind                'kernel', 'memcpy', 'memset' or 'sync'
-- @column name                kernel: its name as CUPTI reports it (mangled); memcpy: the copy kind ('HtoD', 'DtoH', 'DtoD', ...); memset: 'memset'; sync: the synchronization type
-- @column gpu_start           when the GPU started it (the capture's clock); NULL when CUPTI could not time it
-- @column gpu_end             when the GPU finished it; NULL likewise
-- @column duration_ns         gpu_end - gpu_start in nanoseconds; NULL when either is unknown
-- @column device              CUDA device ordinal; NULL for a synchronization
-- @column context             CUPTI's context id
-- @column stream              CUPTI's stream id (the launch event's `stream_id` attribute)
-- @column correlation_id      correlation id of the API call that caused it
-- @column event_id            the event of that call (`events.event_id`: a kernel_launch, graph_launch, memcpy or memset), joined by correlation id; NULL when the run has no such event (sampled out, rate-limited, made before the session started, lost with a killed process, or a synchronization)
-- @column graph_id            a node of a replayed CUDA graph: the graph's id; else NULL
-- @column graph_node_id       ... and the node's id; else NULL
-- @column capture_event_id    a node of a replayed graph: the launch event recorded while the graph was captured, found through the node's clones (`gpu_graph_nodes` parts); NULL when the node was not made by a recorded launch
-- @column bytes               memcpy, memset: bytes copied or set
-- @column grid_x              kernel: grid dimensions (x, y, z)
-- @column grid_y              kernel: grid y
-- @column grid_z              kernel: grid z
-- @column block_x             kernel: block dimensions (x, y, z)
-- @column block_y             kernel: block y
-- @column block_z             kernel: block z
-- @column registers_per_thread  kernel: registers per thread
-- @column static_shared_mem   kernel: static shared memory per block, bytes
-- @column dynamic_shared_mem  kernel: dynamic shared memory per block, bytes
CREATE TABLE gpu_activity (
    run_number INTEGER NOT NULL,
    activity_id BIGINT NOT NULL,
    kind VARCHAR NOT NULL,
    name VARCHAR NOT NULL,
    gpu_start TIMESTAMPTZ,
    gpu_end TIMESTAMPTZ,
    duration_ns BIGINT,
    device UINTEGER,
    context UINTEGER,
    stream UINTEGER,
    correlation_id UINTEGER,
    event_id BIGINT,
    graph_id UINTEGER,
    graph_node_id UBIGINT,
    capture_event_id BIGINT,
    bytes UBIGINT,
    grid_x INTEGER,
    grid_y INTEGER,
    grid_z INTEGER,
    block_x INTEGER,
    block_y INTEGER,
    block_z INTEGER,
    registers_per_thread INTEGER,
    static_shared_mem INTEGER,
    dynamic_shared_mem INTEGER
);

-- GPU time counted per run, launch event (its kind and name, its stack), activity kind and name, and
-- for a replayed graph's nodes the stack of the launch captured into the node: what the GPU-time
-- views and the regression report add up. Kept by the ingest in the run's transaction.
-- @column run_number        `runs.run_number`
-- @column name_id           `event_names.name_id` of the launch event; NULL when the launch was not recorded
-- @column stack_id          the launch event's stack; NULL when it has none or the launch was not recorded
-- @column capture_stack_id  the stack of the launch captured into the graph node; NULL for anything but a node of a replayed graph made by a recorded launch
-- @column kind              activity kind ('kernel', 'memcpy', 'memset', 'sync')
-- @column name              activity name (`gpu_activity.name`)
-- @column executions        activity records
-- @column timed             records with a duration
-- @column gpu_time_ns       sum of the durations, nanoseconds
-- @column gpu_time_sq_us    sum of the squared durations in square microseconds (with `timed` and `gpu_time_ns`: the spread of one execution's time)
-- @column min_ns            shortest duration
-- @column max_ns            longest duration
-- @column bytes             memcpy, memset: bytes copied or set
CREATE TABLE gpu_time_counts (
    run_number INTEGER NOT NULL,
    name_id INTEGER,
    stack_id BIGINT,
    capture_stack_id BIGINT,
    kind VARCHAR NOT NULL,
    name VARCHAR NOT NULL,
    executions BIGINT NOT NULL,
    timed BIGINT NOT NULL,
    gpu_time_ns BIGINT NOT NULL,
    gpu_time_sq_us DOUBLE NOT NULL,
    min_ns BIGINT,
    max_ns BIGINT,
    bytes UBIGINT
);
