"""Who may write, what the browser may load, which files are served.

- Writes need the token (`--token-file`): `Authorization: Bearer TOKEN`, compared in constant time;
  without a configured token every write is refused.
- Static files come from a fixed table of the package's own asset files, built at start-up: a
  request names an entry of that table or gets a 404, so no path from a URL ever reaches the disk.
- Every answer carries a Content-Security-Policy allowing only this origin's scripts and styles
  (nothing from a CDN could load even if a page asked), and a loopback-bound service accepts only
  loopback Host headers (a DNS-rebinding page cannot read it).
"""

from __future__ import annotations

import hmac
import ipaddress
from importlib import resources
from pathlib import Path

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tbpipe.pipeline.errors import UsageError

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


class TokenError(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def read_token(path: Path) -> str:

    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--token-file {path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    if len(token) < 16:
        raise UsageError(f"--token-file {path}: the token must be at least 16 characters long")
    return token


def check_token(expected: str | None, authorization: str | None) -> None:
    """Raises TokenError (403 when writes are off, 401 for a missing or wrong token)."""
    if expected is None:
        raise TokenError("writes are disabled: start tbpipe serve with --token-file to accept uploads", 403)
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise TokenError("this needs the service's token: send the header 'Authorization: Bearer TOKEN'", 401)
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise TokenError("wrong token", 401)


class StaticFiles:
    """The package's asset files by name: serve/static/* and the reports' shared stylesheet."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, str]] = {}
        folders = [
            resources.files("tbpipe.pipeline.serve").joinpath("static"),
            resources.files("tbpipe.pipeline.reports").joinpath("assets"),
        ]
        for folder in folders:
            for entry in folder.iterdir():
                suffix = Path(entry.name).suffix
                if entry.is_file() and suffix in _TYPES:
                    self.files[entry.name] = (entry.read_bytes(), _TYPES[suffix])

    def response(self, name: str) -> Response | None:
        found = self.files.get(name)
        if found is None:
            return None
        body, media_type = found
        return Response(body, media_type=media_type, headers={"cache-control": "no-cache"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class SecurityHeaders:
    """ASGI middleware: the headers above on every answer; Host checked for a loopback-bound service."""

    def __init__(self, app: ASGIApp, loopback_only: bool):
        self.app = app
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.loopback_only:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host and not is_loopback(name):
                response = Response(
                    f"Host {host!r} refused: this service answers loopback names only (127.0.0.1, localhost)\n",
                    status_code=421,
                    media_type="text/plain",
                )
                await response(scope, receive, send)
                return

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + HEADERS
            await send(message)

        await self.app(scope, receive, with_headers)
