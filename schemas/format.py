"""The raw format's name, versions and manifest file: what a run's manifest says about its format.

Kept apart from `raw` (the Arrow schemas) so that the capture's start-up path, which writes the
first manifest, imports no pyarrow: the writer's libraries load when the first part is written.
"""

FORMAT_NAME = "tbpipe-raw"
# The version this tbpipe writes. Readers accept every version from OLDEST_READABLE_RAW_SCHEMA_VERSION
# up to it (`readable_raw_schema_version`); a table added by a version is optional in runs of it and
# absent from older runs (TABLE_SINCE), a column added by a version absent from older parts (COLUMN_SINCE).
RAW_SCHEMA_VERSION = 5
OLDEST_READABLE_RAW_SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
