"""`tbpipe serve`: the trace-analysis service (JSON API, web UI, ingest service) over one database.

- `app`       the app factory (`create_app`), wiring everything below into one FastAPI app
- `config`    what the command line asked for (`ServeConfig`)
- `database`  the served DuckDB file: a locked read-only instance, read-write only while ingesting
- `sandbox`   user SQL: one SELECT, on the locked instance, with a time and a row limit
- `api`       the JSON API under /api; `pages` the HTML pages; `flame` the icicle trees they draw
- `queries`   the reads behind both, over `pipeline.db.read`
- `ingest`    the ingest service (one writer thread, jobs); `watch` the run-folder watcher
- `upload`    uploaded run archives: size limits, confined unpacking, the ingest's validation
- `security`  the token, static files from the package only, response headers, loopback hosts
- `errors`    every failure as a clear 4xx/5xx answer, never a traceback
"""

from tbpipe.pipeline.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from tbpipe.pipeline.serve.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
