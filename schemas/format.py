"""The raw format's name, versions, tables and manifest file: what a run's manifest says about its format.

Kept apart from `raw` (the Arrow schemas) so that the capture's start-up path, which writes the
first manifest, imports no pyarrow: the writer's libraries load when the first part is written.
An ingest with nothing to load reads run folders and manifests by these alone, without pyarrow too.
"""

FORMAT_NAME = "tbpipe-raw"
# The version this tbpipe writes. Readers accept every version from OLDEST_READABLE_RAW_SCHEMA_VERSION
# up to it (`readable_raw_schema_version`); a table added by a version is optional in runs of it and
# absent from older runs (TABLE_SINCE), a column added by a version absent from older parts (COLUMN_SINCE).
RAW_SCHEMA_VERSION = 5
OLDEST_READABLE_RAW_SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"

# The raw schema version that introduced each table of a run (in the order `raw.RUN_TABLES` lists
# their schemas): parts of it are absent from older runs.
TABLE_SINCE = {
    "events": 1,
    "stacks": 1,
    "modules": 1,
    "code": 1,
    "code_origins": 2,
    "gpu_activity": 2,
    "gpu_graph_nodes": 2,
}


def readable_raw_schema_version(version: object) -> bool:
    """Whether this tbpipe reads runs (and parts) of this raw schema version."""
    return (
        isinstance(version, int)
        and not isinstance(version, bool)
        and OLDEST_READABLE_RAW_SCHEMA_VERSION <= version <= RAW_SCHEMA_VERSION
    )
