"""The raw run format written by tbpipe.capture and read by tbpipe.pipeline.

Defined once here and imported everywhere; `schemas/README.md` documents it for
people who read the files with other tools.
"""

from tbpipe.schemas.raw import (
    COLUMN_SINCE,
    FORMAT_NAME,
    MANIFEST_FILE,
    OLDEST_READABLE_RAW_SCHEMA_VERSION,
    RAW_SCHEMA_VERSION,
    RUN_TABLES,
    SCHEMA_KEY,
    TABLE_SINCE,
    VERSION_KEY,
    code_origins_schema,
    code_schema,
    events_schema,
    gpu_activity_schema,
    gpu_graph_nodes_schema,
    modules_schema,
    readable_raw_schema_version,
    stacks_schema,
    table_file_name,
    table_schema,
)

__all__ = [
    "FORMAT_NAME",
    "MANIFEST_FILE",
    "OLDEST_READABLE_RAW_SCHEMA_VERSION",
    "RAW_SCHEMA_VERSION",
    "COLUMN_SINCE",
    "RUN_TABLES",
    "SCHEMA_KEY",
    "TABLE_SINCE",
    "VERSION_KEY",
    "code_origins_schema",
    "code_schema",
    "events_schema",
    "gpu_activity_schema",
    "gpu_graph_nodes_schema",
    "modules_schema",
    "readable_raw_schema_version",
    "stacks_schema",
    "table_file_name",
    "table_schema",
]
