"""Every failure as a clear 4xx/5xx answer: JSON `{"error": ...}` under /api, an HTML page elsewhere.

Nothing a client sees carries a traceback: an unexpected exception is logged with its traceback
and answered with a 500 that says only that.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from tbpipe.pipeline.db.connection import DatabaseError
from tbpipe.pipeline.db.read import NotFoundError
from tbpipe.pipeline.errors import TbpipeError, UsageError
from tbpipe.pipeline.serve.database import DatabaseUnavailable
from tbpipe.pipeline.serve.sandbox import QueryRefused
from tbpipe.pipeline.serve.security import TokenError
from tbpipe.pipeline.serve.upload import UploadRefused

log = logging.getLogger("tbpipe.serve")


def error_response(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    if request.url.path.startswith("/api") or "text/html" not in request.headers.get("accept", ""):
        return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)
    from tbpipe.pipeline.serve.pages import render_error

    return HTMLResponse(render_error(request, status, message), status_code=status, headers=headers)


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for problem in error.errors():
        where = ".".join(str(p) for p in problem.get("loc", ()) if p not in ("query", "path", "body"))
        location = problem.get("loc", ("",))[0]
        parts.append(f"{location} parameter {where!r}: {problem.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> Response:
        return error_response(request, 400, _validation_message(error))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> Response:
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        if error.status_code == 404 and message == "Not Found":
            message = f"nothing at {request.url.path} (the API is described at /api/openapi.json)"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(request, error.status_code, message, getattr(error, "headers", None))

    @app.exception_handler(NotFoundError)
    async def _not_found(request: Request, error: NotFoundError) -> Response:
        return error_response(request, 404, str(error))

    @app.exception_handler(QueryRefused)
    async def _query(request: Request, error: QueryRefused) -> Response:
        return error_response(request, error.status, str(error))

    @app.exception_handler(UploadRefused)
    async def _upload(request: Request, error: UploadRefused) -> Response:
        return error_response(request, error.status, str(error))

    @app.exception_handler(TokenError)
    async def _token(request: Request, error: TokenError) -> Response:
        headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
        return error_response(request, error.status, str(error), headers)

    @app.exception_handler(DatabaseUnavailable)
    async def _unavailable(request: Request, error: DatabaseUnavailable) -> Response:
        return error_response(request, 503, str(error), {"retry-after": str(error.retry_after_s)})

    @app.exception_handler(DatabaseError)
    async def _database(request: Request, error: DatabaseError) -> Response:
        return error_response(request, 503, str(error), {"retry-after": "10"})

    @app.exception_handler(UsageError)
    async def _usage(request: Request, error: UsageError) -> Response:
        return error_response(request, 400, str(error))

    @app.exception_handler(TbpipeError)
    async def _tbpipe(request: Request, error: TbpipeError) -> Response:
        return error_response(request, 400, str(error))

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(request, 500, "internal error: the service's log has the details")
