"""The DuckDB database that `tbpipe ingest` fills and `query`/`show`/`runs` read.

    con = open_database("tbpipe.duckdb", read_only=True)
    summary = ingest_runs([Path("runs")], IngestOptions(db_path=Path("tbpipe.duckdb")))

`schema` loads the packaged SQL (migrations, views, macros), `connection` opens the file and
serializes writers, `ingest` loads run directories (each run whole or not at all, over the stack stage
`tbpipe.pipeline.stacks`), `read` serves `show`, `runs` and the demo.
"""

from tbpipe.pipeline.db.connection import (
    DatabaseBusyError,
    DatabaseError,
    default_db_path,
    ingest_lock,
    open_database,
    resolve_db_path,
)
from tbpipe.pipeline.db.ingest import IngestOptions, IngestSummary, RunOutcome, ingest_runs

__all__ = [
    "DatabaseBusyError",
    "DatabaseError",
    "IngestOptions",
    "IngestSummary",
    "RunOutcome",
    "default_db_path",
    "ingest_runs",
    "ingest_lock",
    "open_database",
    "resolve_db_path",
]
