"""`tbpipe ingest`: run directories into the database, each run whole or not at all.

- `runs`      the flow: find run folders; per run read, lay out and load it (in a transaction, small runs sharing one)
- `outcomes`  options, what happened to each run, the summary the CLI prints
- `symbols`   symbols for new frames, and old frames redone when better debug info turns up
- `siting`    which Python files are user code, and the call site of every stack
- `rows`      a run's rows, inserted by column name
- `tables`    the connection helpers: Arrow tables as views, transactions, data errors

    summary = ingest_runs([Path("runs")], IngestOptions(db_path=Path("tbpipe.duckdb")))
"""

from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary, RunOutcome, UnsymbolizedGroup
from tbpipe.pipeline.db.ingest.runs import ingest_runs
from tbpipe.pipeline.db.ingest.siting import parse_user_code

__all__ = ["IngestOptions", "IngestSummary", "RunOutcome", "UnsymbolizedGroup", "ingest_runs", "parse_user_code"]
