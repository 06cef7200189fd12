"""Answers of the read API kept per database state (ASGI middleware).

In the locked mode the database changes only through the service's own ingest, which bumps the
state (`ServedDatabase.state_key`). Between two bumps a GET of `/api/...` with the same path and
query has one answer, so it is computed once and the bytes are kept: a team opening the same morning
report at once costs one query instead of one per person. Requests for an answer being computed wait
for it (one computation per key, however many ask at once). Nothing is kept while an ingest writes
(no state key then), for errors, for large answers, nor for the endpoints whose answer is not a
function of the data: `/api/query` (users' SQL may read the clock or draw random numbers) and the
ingest service's status.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CACHED_PREFIX = "/api/"
NOT_CACHED = ("/api/query", "/api/ingest", "/api/openapi.json")
MAX_ANSWER_BYTES = 4 << 20
# Says whether an answer came from the cache ("hit") or was computed for it ("miss").
CACHE_HEADER = b"x-tbpipe-cache"
MAX_TOTAL_BYTES = 64 << 20


@dataclass
class _Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class ResponseCache:
    """ASGI middleware over the app; `state_key()` names the data readers see now, or None."""

    def __init__(self, app: ASGIApp, state_key: Callable[[], tuple | None]):
        self.app = app
        self.state_key = state_key
        self._answers: OrderedDict[tuple, _Answer] = OrderedDict()
        self._bytes = 0
        self._state: tuple | None = None
        self._inflight: dict[tuple, asyncio.Event] = {}

    def _cacheable(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "GET":
            return False
        path = scope["path"]
        return path.startswith(CACHED_PREFIX) and not path.startswith(NOT_CACHED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state_key() if self._cacheable(scope) else None
        if state is None:
            await self.app(scope, receive, send)
            return
        if state != self._state:  # new data: every kept answer is stale
            self._answers.clear()
            self._bytes = 0
            self._state = state
        # The date too: a comparison's accepted regressions expire by it.
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
        keep = True

        async def recording_send(message: Message) -> None:
            nonlocal start, keep
            if message["type"] == "http.response.start":
                start = dict(message)
                message = {**message, "headers": [*message.get("headers", []), (CACHE_HEADER, b"miss")]}
            elif message["type"] == "http.response.body" and keep:
                chunks.append(message.get("body", b""))
                if sum(len(c) for c in chunks) > MAX_ANSWER_BYTES:
                    keep = False
                    chunks.clear()
            await send(message)

        await self.app(scope, receive, recording_send)
        if start is None or start["status"] != 200 or not keep:
            return None
        return _Answer(start["status"], list(start.get("headers", [])), b"".join(chunks))

    def _keep(self, key: tuple, answer: _Answer) -> None:
        self._answers[key] = answer
        self._bytes += len(answer.body)
        while self._bytes > MAX_TOTAL_BYTES and self._answers:
            _key, oldest = self._answers.popitem(last=False)
            self._bytes -= len(oldest.body)


async def _replay(answer: _Answer, send: Send) -> None:
    headers = [*answer.headers, (CACHE_HEADER, b"hit")]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
