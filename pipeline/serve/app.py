"""The app factory: `create_app(config)` wires the database, the ingest service, the watcher, the
API, the pages and the static files into one FastAPI app; its lifespan opens and closes them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI
from starlette.requests import Request

from tbpipe.capture import __version__
from tbpipe.pipeline.serve.cache import ResponseCache, pages_kept
from tbpipe.pipeline.serve.config import ServeConfig
from tbpipe.pipeline.serve.database import CLOSED, ServedDatabase
from tbpipe.pipeline.serve.ingest import IngestService
from tbpipe.pipeline.serve.retain import Retainer, folder_policy
from tbpipe.pipeline.serve.security import SecurityHeaders, StaticFiles, is_loopback
from tbpipe.pipeline.serve.warm import Warmer
from tbpipe.pipeline.serve.watch import Watcher

log = logging.getLogger("tbpipe.serve")


@dataclass
class Service:
    config: ServeConfig
    database: ServedDatabase
    ingest: IngestService
    watcher: Watcher | None
    static: StaticFiles
    warmer: Warmer
    retainer: Retainer | None = None  # `--retain-*`: retention on a schedule

    def start(self) -> None:
        self.config.uploads.mkdir(parents=True, exist_ok=True)
        if self.database.mode == CLOSED:
            self.database.open()
        self.ingest.start()
        self.warmer.start()
        if self.watcher is not None:
            self.watcher.start()
        if self.retainer is not None:
            self.retainer.start()
        log.info("serving %s on %s", self.config.db_path, self.config.base_url)

    def stop(self) -> None:
        if self.retainer is not None:
            self.retainer.stop()
        if self.watcher is not None:
            self.watcher.stop()
        self.warmer.stop()
        self.ingest.stop()
        self.database.close()


def build_service(config: ServeConfig) -> Service:

    holder = f"tbpipe serve on {config.base_url} (it ingests runs itself: --watch folders, POST /api/runs)"
    database = ServedDatabase(config.db_path, holder, config.open_wait_s)
    options = replace(config.ingest, db_path=config.db_path, progress=False, wait_s=config.open_wait_s)
    ingest = IngestService(database, options)
    watcher = Watcher(config.watch, ingest, config.idle_s, config.poll_s) if config.watch else None
    retainer = Retainer(config, ingest) if config.retain is not None or folder_policy(config).active else None
    return Service(config, database, ingest, watcher, StaticFiles(), Warmer(database), retainer)


def service_of(request: Request) -> Service:
    return request.app.state.service


def create_app(config: ServeConfig) -> FastAPI:
    from tbpipe.pipeline.serve import api, errors, jobs, pages

    service = build_service(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(
        title="tbpipe",
        version=__version__,
        description="Call sites of GPU kernel launches and ops across nightly runs: runs, sites, combined "
        "tracebacks, comparisons and read-only SQL over the tbpipe database.",
        lifespan=lifespan,
        openapi_url="/api/openapi.json",
        docs_url=None,  # the bundled docs pages load their scripts from a CDN; /api lists the endpoints instead
        redoc_url=None,
    )
    app.state.service = service
    errors.install(app)
    app.include_router(api.router)
    app.include_router(pages.router)
    app.include_router(jobs.router)
    app.add_middleware(ResponseCache, state_key=service.database.state_key, pages=pages_kept())  # inside the headers
    app.add_middleware(SecurityHeaders, loopback_only=is_loopback(config.host))
    return app
