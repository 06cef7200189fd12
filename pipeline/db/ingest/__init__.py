"""`tbpipe ingest`: run directories into the database, each run whole or not at all.

The flow (`flow.ingest_runs`) finds what there is to do first: the runs that need reading and
whether the database's upkeep has work (`pending`), modules with better debug info (`debug_info`).
Only when there is something does it import the stages (`stages.load_runs`, with numpy and
pyarrow), three with frozen hand-offs, each in its own module:

- `read_ahead`  run folders read, validated and hashed on threads -> `PreparedRun`, in batches
- `lay_out`     a batch's stack ids (`StackIds`), then its new stacks' frames, symbols and sites
                (`LaidOutBatch`), decided against the database and written nowhere
- `load`        transactions (`Loader`, `Transaction`): events beside, then the other rows and commit

and what they use:

- `rows`        a run's rows, inserted by column name
- `symbols`     symbols for new frames, and old frames redone when better debug info turns up
- `user_code`, `siting`  the user-code rules; which Python files are user code, and the call site of every stack
- `frames`, `gpu`  frame ids and rows; GPU activity
- `tables`      the connection helpers: Arrow tables as views, transactions, data errors
- `tuning`      the knobs: batch and transaction sizes, threads, priority, huge pages, checkpoints
- `outcomes`    options (with the hooks tests watch the stages by), outcomes, the summary

    summary = ingest_runs([Path("runs")], IngestOptions(db_path=Path("tbpipe.duckdb")))
"""

from tbpipe.pipeline.db.ingest.flow import ingest_runs
from tbpipe.pipeline.db.ingest.outcomes import IngestHooks, IngestOptions, IngestSummary, RunOutcome, UnsymbolizedGroup
from tbpipe.pipeline.db.ingest.tuning import IngestLimits
from tbpipe.pipeline.db.ingest.user_code import parse_user_code

__all__ = [
    "IngestHooks",
    "IngestLimits",
    "IngestOptions",
    "IngestSummary",
    "RunOutcome",
    "UnsymbolizedGroup",
    "ingest_runs",
    "parse_user_code",
]
