"""Answers kept per database state (ASGI middleware): the read API's JSON and the HTML pages.

In the locked mode the database changes only through the service's own writer (an ingest, a
retain), which bumps the state (`ServedDatabase.state_key`). Between two bumps a GET of a kept path
with the same path and query has one answer, so it is computed once and the bytes are kept: a team
opening the same morning report at once costs one query and one rendering instead of one per person.
Requests for an answer being computed wait for it (one computation per key, however many ask at
once). The key is the state, the date (a comparison's accepted regressions expire by it), the path
and the query: nothing else changes an answer (no page shows the Host, a cookie, the token or the
time; the HTML or JSON form of an error is chosen by Accept, and errors are not kept).

Nothing is kept while the writer works (no state key then), for errors, for large answers, for an
answer that says `Cache-Control: no-store` (the runs page while an ingest runs says so), nor for
what is not a function of the data: `/api/query` (users' SQL may read the clock or draw random
numbers), the ingest service's status and jobs, the pages that are forms or documents of the
service itself (SQL, API), the static files, and anything but GET. `TBPIPE_PAGE_CACHE=off` in the
service's environment keeps the API's answers only (to measure what the pages cost without it).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_PREFIX = "/api/"
NOT_CACHED = ("/api/query", "/api/ingest", "/api/openapi.json")
# The pages that are a function of the database and their URL: the runs, a run, a site, a kernel's
# callers, a comparison (or its empty form, which lists the labels), the jobs and a job's ranks.
PAGE_PATHS = ("/", "/compare", "/jobs")
PAGE_PREFIXES = ("/runs/", "/sites/", "/kernels/", "/jobs/")
PAGE_CACHE_ENV = "TBPIPE_PAGE_CACHE"
MAX_ANSWER_BYTES = 4 << 20
MAX_TOTAL_BYTES = 64 << 20
MAX_ENTRIES = 4096  # besides the bytes: a crawl of many small answers is bounded too
# Says whether an answer came from the cache ("hit") or was computed for it ("miss").
CACHE_HEADER = b"x-tbpipe-cache"


def pages_kept() -> bool:
    """Whether the pages are kept too: yes unless `TBPIPE_PAGE_CACHE=off` in the environment."""
    return os.environ.get(PAGE_CACHE_ENV, "on").strip().lower() not in ("off", "0", "no", "false")


def is_api(path: str) -> bool:
    """A kept answer of the read API."""
    return path.startswith(API_PREFIX) and not path.startswith(NOT_CACHED)


def is_page(path: str) -> bool:
    """A kept HTML page."""
    return path in PAGE_PATHS or path.startswith(PAGE_PREFIXES)


@dataclass
class _Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class ResponseCache:
    """ASGI middleware over the app; `state_key()` names the data readers see now, or None. With
    `pages=False` only the API's answers are kept. At most `max_bytes` of bodies in `max_entries`
    answers, the least recently used let go first."""

    def __init__(
        self,
        app: ASGIApp,
        state_key: Callable[[], tuple | None],
        pages: bool = True,
        max_bytes: int = MAX_TOTAL_BYTES,
        max_entries: int = MAX_ENTRIES,
    ):
        self.app = app
        self.state_key = state_key
        self.pages = pages
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._answers: OrderedDict[tuple, _Answer] = OrderedDict()
        self._bytes = 0
        self._state: tuple | None = None
        self._inflight: dict[tuple, asyncio.Event] = {}

    def _cacheable(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "GET":
            return False
        path = scope["path"]
        return is_api(path) or (self.pages and is_page(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state_key() if self._cacheable(scope) else None
        if state is None:
            await self.app(scope, receive, send)
            return
        if state != self._state:  # new data: every kept answer is stale
            self._answers.clear()
            self._bytes = 0
            self._state = state
        key = (state, dt.date.today(), scope["path"], scope.get("query_string", b""))
        answer = self._answers.get(key)
        pending = self._inflight.get(key)
        if answer is None and pending is not None:
            await pending.wait()
            answer = self._answers.get(key)
            if answer is None:  # not kept (an error, too large, the data changed): answered on its own
                await self.app(scope, receive, send)
                return
        if answer is not None:
            self._answers.move_to_end(key)
            await _replay(answer, send)
            return
        done = self._inflight[key] = asyncio.Event()
        try:
            answer = await self._compute(scope, receive, send)
            if answer is not None and self.state_key() == state:
                self._keep(key, answer)
        finally:
            del self._inflight[key]
            done.set()

    async def _compute(self, scope: Scope, receive: Receive, send: Send) -> _Answer | None:
        """Runs the app, passing its messages on, and returns the answer when it may be kept."""
        start: Message | None = None
        chunks: list[bytes] = []
        size = 0
        keep = True

        async def recording_send(message: Message) -> None:
            nonlocal start, keep, size
            if message["type"] == "http.response.start":
                start = dict(message)
                keep = start["status"] == 200 and not _no_store(start.get("headers", []))
                message = {**message, "headers": [*message.get("headers", []), (CACHE_HEADER, b"miss")]}
            elif message["type"] == "http.response.body" and keep:
                body = message.get("body", b"")
                chunks.append(body)
                size += len(body)
                if size > MAX_ANSWER_BYTES:
                    keep = False
                    chunks.clear()
            await send(message)

        await self.app(scope, receive, recording_send)
        if start is None or not keep:
            return None
        return _Answer(start["status"], list(start.get("headers", [])), b"".join(chunks))

    def _keep(self, key: tuple, answer: _Answer) -> None:
        self._answers[key] = answer
        self._bytes += len(answer.body)
        while self._answers and (self._bytes > self.max_bytes or len(self._answers) > self.max_entries):
            _key, oldest = self._answers.popitem(last=False)
            self._bytes -= len(oldest.body)


def _no_store(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"cache-control" and b"no-store" in value.lower() for name, value in headers)


async def _replay(answer: _Answer, send: Send) -> None:
    headers = [*answer.headers, (CACHE_HEADER, b"hit")]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
