"""Arrow schemas of a raw run directory, version 5, and the constants its columns use.

The frame and stack flags and stop reasons are defined here once; the extension (`tbpipe._native`)
exports the same names from its C++ enums, and the tests hold each pair equal.

A run directory `<out>/<run_id>/` holds `manifest.json` and, per flush of the
capture library's background thread, one zstd Parquet file per table that had
new rows: `events-000001.parquet`, `stacks-000001.parquet`, ... Every file is
complete on its own (a killed process leaves all earlier files readable).
Each file's key-value metadata names its table and the schema version.

Versions: a reader of this module reads every version from
OLDEST_READABLE_RAW_SCHEMA_VERSION to RAW_SCHEMA_VERSION. A later version only adds
optional tables (`format.TABLE_SINCE` says from which version a table may appear) and
nullable columns at the end of a table (`COLUMN_SINCE`); a part of an older version
has the schema `table_schema(table, version)` gives, a table a run does not have is
empty.
"""

from __future__ import annotations

import functools

import pyarrow as pa

from tbpipe.schemas.format import (  # noqa: F401 - defined there, without pyarrow, for the capture's start
    FORMAT_NAME,
    MANIFEST_FILE,
    OLDEST_READABLE_RAW_SCHEMA_VERSION,
    RAW_SCHEMA_VERSION,
)
from tbpipe.schemas.op_attributes import OP_COLUMNS

SCHEMA_KEY = b"tbpipe.table"
VERSION_KEY = b"tbpipe.schema_version"


def _with_metadata(table: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={SCHEMA_KEY: table.encode(), VERSION_KEY: str(RAW_SCHEMA_VERSION).encode()},
    )


def events_schema() -> pa.Schema:
    """One row per recorded event."""
    return _with_metadata(
        "events",
        [
            pa.field("ts", pa.timestamp("ns", tz="UTC"), nullable=False),
            pa.field("thread_id", pa.int64(), nullable=False),  # OS thread id (gettid)
            pa.field("kind", pa.string(), nullable=False),  # kernel_launch, op, alloc, user, ...
            pa.field("name", pa.string(), nullable=False),
            pa.field("stack_id", pa.uint64()),  # stacks.stack_id; null when no stack was taken
            pa.field("attrs", pa.string()),  # JSON object, null when none
            # (version 3) CUDA API calls (kernel_launch, graph_launch, memcpy, memset): CUPTI's correlation
            # id, the key of the GPU activity the call caused; null for other events. It differs in every
            # event: inside `attrs` it made a third of an events part's bytes, as a column it delta-packs.
            pa.field("correlation_id", pa.uint32()),
            # (version 5) the attributes of an op event from the torch-ops observer, typed: as JSON text in
            # `attrs` they were most of the capture's cost per op (formatted per event, compressed at the
            # flush). Null for other events, and where the attribute does not apply (schemas/op_attributes.py).
            pa.field("op_id", pa.int64()),  # the op's number on its thread
            pa.field("op_depth", pa.int32()),  # how many recorded ops enclose it on its thread
            pa.field("op_parent", pa.int64()),  # op_id of the innermost enclosing op
            pa.field("op_seq", pa.int64()),  # autograd's sequence number of a forward op...
            pa.field("op_seq_thread", pa.int64()),  # ... and RecordFunction's number for its thread
            pa.field("op_bwd_seq", pa.int64()),  # in autograd's backward: the node's sequence number,
            pa.field("op_fwd_thread", pa.int64()),  # the number of its forward op's thread,
            pa.field("op_bwd_node", pa.string()),  # and its name
            pa.field("op_scope", pa.string()),  # what it is when not a plain op: backward, user, ...
        ],
    )


NATIVE_FRAME = pa.struct(
    [
        pa.field("module", pa.int32(), nullable=False),  # modules.module_index, -1 for a marker
        pa.field("offset", pa.uint64(), nullable=False),  # pc - load bias (ELF vaddr); marker: stop reason
        pa.field("flags", pa.uint32(), nullable=False),  # NATIVE_FRAME_* bits
    ]
)

PYTHON_FRAME = pa.struct(
    [
        pa.field("code_id", pa.uint64(), nullable=False),  # code.code_id
        pa.field("offset", pa.int32(), nullable=False),  # instruction byte offset (-1: not started)
        pa.field("line", pa.int32(), nullable=False),  # resolved at flush; -1 when unknown
        pa.field("flags", pa.uint32(), nullable=False),  # PYTHON_FRAME_* bits
    ]
)

# Bits of NATIVE_FRAME.flags
NATIVE_FRAME_EVAL_LOOP = 1  # runs a group of Python frames (CPython eval loop)
NATIVE_FRAME_BY_FRAME_POINTER = 2  # found by the frame-pointer fallback
NATIVE_FRAME_EXACT_PC = 4  # not a return address: symbolize at offset, not offset - 1
NATIVE_FRAME_MARKER = 128  # the walk stopped here; offset holds the stop reason

# Bits of PYTHON_FRAME.flags
PYTHON_FRAME_ENTRY = 1  # outermost Python frame of its eval-loop group
PYTHON_FRAME_LINE_RESOLVED = 2  # captured without the GIL; `offset` holds the line too

# Bits of stacks.status
STACK_NATIVE_TRUNCATED = 1
STACK_PYTHON_TRUNCATED = 2
STACK_NO_NATIVE = 4
STACK_NO_PYTHON = 8

# Values of a marker frame's offset: why the native walk stopped there
STOP_COMPLETE = 0  # reached the outermost frame
STOP_UNKNOWN_PC = 1
STOP_NO_UNWIND_INFO = 2
STOP_UNSUPPORTED_RULE = 3
STOP_BAD_STACK_READ = 4
STOP_DEPTH_LIMIT = 5  # MAX_NATIVE_FRAMES reached
STOP_NOT_SUPPORTED = 6
STOP_REASONS = {
    STOP_COMPLETE: "complete",
    STOP_UNKNOWN_PC: "PC outside every loaded module",
    STOP_NO_UNWIND_INFO: "no unwind info for this PC",
    STOP_UNSUPPORTED_RULE: "unsupported CFI rule",
    STOP_BAD_STACK_READ: "stack read out of bounds",
    STOP_DEPTH_LIMIT: "depth limit reached",
    STOP_NOT_SUPPORTED: "no native unwinder on this platform",
}

# Most native frames of one raw stack (the last may be a marker)
MAX_NATIVE_FRAMES = 512


def stacks_schema() -> pa.Schema:
    """Each distinct raw stack once; frames innermost first, not yet interleaved."""
    return _with_metadata(
        "stacks",
        [
            pa.field("stack_id", pa.uint64(), nullable=False),  # content hash
            pa.field("thread_id", pa.int64(), nullable=False),  # thread that first recorded it
            pa.field("status", pa.uint32(), nullable=False),  # STACK_* bits
            pa.field("native", pa.list_(NATIVE_FRAME), nullable=False),
            pa.field("python", pa.list_(PYTHON_FRAME), nullable=False),
            # (version 4) the portable stack hash (schemas/identity.py), as the capture
            # computed it when it wrote the stack: an ingest that already stores every stack of a
            # run reads this column instead of the frames. Null where the writer did not compute it.
            pa.field("stack_hash", pa.uint64()),
        ],
    )


ADDRESS_RANGE = pa.struct([pa.field("lo", pa.uint64()), pa.field("hi", pa.uint64())])


def modules_schema() -> pa.Schema:
    """Loaded ELF objects referenced by the run's stacks."""
    return _with_metadata(
        "modules",
        [
            pa.field("module_index", pa.int32(), nullable=False),
            pa.field("path", pa.string(), nullable=False),
            pa.field("build_id", pa.string()),  # lowercase hex, null when the object has none
            pa.field("load_bias", pa.uint64(), nullable=False),
            # Ranges as ELF virtual addresses (runtime address - load bias).
            pa.field("exec_ranges", pa.list_(ADDRESS_RANGE), nullable=False),
            pa.field("eval_ranges", pa.list_(ADDRESS_RANGE), nullable=False),
        ],
    )


def code_schema() -> pa.Schema:
    """Python code objects referenced by the run's stacks."""
    return _with_metadata(
        "code",
        [
            pa.field("code_id", pa.uint64(), nullable=False),
            pa.field("filename", pa.string(), nullable=False),
            pa.field("qualname", pa.string(), nullable=False),
            pa.field("first_line", pa.int32(), nullable=False),
        ],
    )


# Where generated code came from (version 2). torch.compile runs most of a program's ops and kernels
# from code it generated: Inductor's wrapper modules, FX and AOTAutograd code. A row says that the
# lines `line_lo`..`line_hi` of the generated `file` (as its code objects name it) were generated
# from the user's source lines in `origin`, innermost first: the stack trace of the graph node that
# the lines run. The ingest places those frames inside the generated frame, marked as inlined, so
# that the generated frame's events are sited at the user's lines.
ORIGIN_FRAME = pa.struct(
    [
        pa.field("filename", pa.string(), nullable=False),
        pa.field("qualname", pa.string(), nullable=False),  # as code.qualname would name the function
        pa.field("first_line", pa.int32(), nullable=False),  # the function's first line, -1 unknown
        pa.field("line", pa.int32(), nullable=False),
    ]
)


def code_origins_schema() -> pa.Schema:
    """Generated code's line ranges and the user source lines each was generated from."""
    return _with_metadata(
        "code_origins",
        [
            pa.field("file", pa.string(), nullable=False),
            pa.field("line_lo", pa.int32(), nullable=False),
            pa.field("line_hi", pa.int32(), nullable=False),  # inclusive
            pa.field("origin", pa.list_(ORIGIN_FRAME), nullable=False),  # innermost first
        ],
    )


# Values of gpu_activity.kind
GPU_ACTIVITY_KINDS = ("kernel", "memcpy", "memset", "sync")


def gpu_activity_schema() -> pa.Schema:
    """One row per GPU activity record from CUPTI (source `cuda`): a kernel execution, a copy, a set or a
    synchronization. Joined to its launch event by `correlation_id` (the events' column of that name)."""
    return _with_metadata(
        "gpu_activity",
        [
            pa.field("kind", pa.string(), nullable=False),  # GPU_ACTIVITY_KINDS
            # kernel: its (mangled) name; memcpy: the copy kind (HtoD, DtoH, DtoD, ...); memset: "memset";
            # sync: the synchronization type (stream_synchronize, event_synchronize, ...)
            pa.field("name", pa.string(), nullable=False),
            # GPU times on the events' clock (CUPTI's clock moved by the offset measured when the source
            # started); null when CUPTI could not time it (no device memory for timestamps, or cut by the end)
            pa.field("gpu_start", pa.timestamp("ns", tz="UTC")),
            pa.field("gpu_end", pa.timestamp("ns", tz="UTC")),
            pa.field("device", pa.uint32()),  # null for a synchronization
            pa.field("context", pa.uint32(), nullable=False),  # CUPTI's context id
            pa.field("stream", pa.uint32(), nullable=False),  # CUPTI's stream id (= the launch's stream_id)
            pa.field("correlation_id", pa.uint32()),  # of the API call that caused it; null when 0
            pa.field("graph_id", pa.uint32()),  # a node of a CUDA graph launch: the graph's id, else null
            pa.field("graph_node_id", pa.uint64()),  # ... and the node's id (gpu_graph_nodes), else null
            pa.field("bytes", pa.uint64()),  # memcpy, memset: bytes copied or set
            pa.field("grid_x", pa.int32()),  # kernel: grid and block dimensions
            pa.field("grid_y", pa.int32()),
            pa.field("grid_z", pa.int32()),
            pa.field("block_x", pa.int32()),
            pa.field("block_y", pa.int32()),
            pa.field("block_z", pa.int32()),
            pa.field("registers_per_thread", pa.int32()),  # kernel
            pa.field("static_shared_mem", pa.int32()),  # kernel: bytes of static shared memory per block
            pa.field("dynamic_shared_mem", pa.int32()),  # kernel: bytes of dynamic shared memory per block
        ],
    )


def gpu_graph_nodes_schema() -> pa.Schema:
    """CUDA graph nodes as CUPTI reported them made or cloned (source `cuda`): a replayed kernel's
    `graph_node_id` leads, through the clones made when the graph was instantiated, to the node made
    while a launch was being captured, and that launch's `correlation_id` to its event and stack."""
    return _with_metadata(
        "gpu_graph_nodes",
        [
            pa.field("ts", pa.timestamp("ns", tz="UTC"), nullable=False),
            pa.field("thread_id", pa.int64(), nullable=False),  # the thread that made it
            pa.field("graph_node_id", pa.uint64(), nullable=False),
            pa.field("original_graph_node_id", pa.uint64()),  # a clone: the node it was cloned from; else null
            pa.field("graph_id", pa.uint32()),  # the graph it belongs to (an executable graph for a clone)
            pa.field("node_type", pa.int32(), nullable=False),  # CUgraphNodeType: 0 kernel, 1 memcpy, 2 memset, ...
            # made during a launch (stream capture): that launch's correlation id, else null
            pa.field("correlation_id", pa.uint32()),
        ],
    )


RUN_TABLES = {
    "events": events_schema,
    "stacks": stacks_schema,
    "modules": modules_schema,
    "code": code_schema,
    "code_origins": code_origins_schema,
    "gpu_activity": gpu_activity_schema,
    "gpu_graph_nodes": gpu_graph_nodes_schema,
}

# Event kinds the CUDA source records for an API call, with its `correlation_id`.
CORRELATED_KINDS = ("kernel_launch", "graph_launch", "memcpy", "memset")

# Columns added by a later raw schema version (appended, nullable), by (table, column): parts of
# older versions lack them, and readers take them as null.
COLUMN_SINCE = {
    ("events", "correlation_id"): 3,
    ("stacks", "stack_hash"): 4,
    **{("events", column): 5 for column in OP_COLUMNS},
}


@functools.cache  # a reader checks every part against it: built once (a schema is immutable)
def table_schema(table: str, version: int = RAW_SCHEMA_VERSION) -> pa.Schema:
    """The columns of `table` in parts of raw schema `version` (without the ones added after it)."""
    schema = RUN_TABLES[table]()
    later = [i for i, name in enumerate(schema.names) if COLUMN_SINCE.get((table, name), 0) > version]
    for index in reversed(later):
        schema = schema.remove(index)
    return schema


def table_file_name(table: str, sequence: int) -> str:
    """File name of one flush's part of `table` (sequence numbers start at 1)."""
    return f"{table}-{sequence:06d}.parquet"
