"""debuginfod servers for the symbolizer's tests and its benchmark: elfutils' real `debuginfod` over a
folder of ELF files on a free loopback port, and a small server that answers wrongly on purpose."""

from __future__ import annotations

import gzip
import http.server
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from support.serve import free_port

_METRIC = re.compile(r"^([a-z_]+)(\{[^}]*\})?\s+([0-9.e+-]+)$")


def debuginfod_missing() -> str:
    """Why the real server cannot run here ('' when it can)."""
    return "" if shutil.which("debuginfod") else "elfutils' debuginfod is not installed (Debian: debuginfod)"


class DebuginfodServer:
    """`debuginfod -F FOLDER` (elfutils) on 127.0.0.1; `url` once its first scan of the folder is done."""

    def __init__(self, folder: Path, workdir: Path):
        self.folder = folder
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts the server (again after `stop`, on a new port) and waits for its scan."""
        self.port = free_port()
        self.log = self.workdir / f"debuginfod-{self.port}.log"
        with open(self.log, "wb") as log:
            # -F: index the folder's ELF files; -t 0: no periodic rescans (SIGUSR1 asks for one);
            # -g 0: no grooming; -d: a database of its own per start.
            self.process = subprocess.Popen(
                ["debuginfod", "-p", str(self.port), "-d", str(self.workdir / f"index-{self.port}.sqlite"),
                 "-F", "-t", "0", "-g", "0", str(self.folder)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_scanned(1)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus metrics as {'name{labels}': value}; {} when it does not answer."""
        import httpx

        try:
            text = httpx.get(self.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        out = {}
        for line in text.splitlines():
            match = _METRIC.match(line.strip())
            if match:
                out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
        return out

    def requests(self) -> int:
        """Files asked for so far (debuginfo, executable, source): what a client that asks nothing leaves alone."""
        return int(
            sum(v for k, v in self.metrics().items() if k.startswith("http_requests_total") and "metrics" not in k)
        )

    def rescan(self) -> None:
        """Makes the server index the folder again (files added since) and waits until it has."""
        done = self.metrics().get('thread_work_total{role="traverse"}', 0)
        self.process.send_signal(signal.SIGUSR1)
        self._wait_scanned(done + 1)

    def _wait_scanned(self, traversals: float, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"debuginfod exited with {self.process.returncode}:\n{self.output()}")
            metrics = self.metrics()
            if (
                metrics.get('thread_work_total{role="traverse"}', 0) >= traversals
                and metrics.get('thread_work_pending{role="scan"}', 1) == 0
                and metrics.get('thread_busy{role="scan"}', 1) == 0
            ):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"debuginfod did not finish scanning {self.folder} within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> DebuginfodServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up on a slow answer: the write fails, as it should


class MisbehavingServer:
    """A loopback HTTP server answering `GET /buildid/<id>/<kind>` wrongly on purpose.

    Modes: '500' (an error status), 'truncated' (a Content-Length it does not keep), 'not-elf' (an
    HTML page), 'wrong-build-id' (another build-ID's file), 'slow' (answers after `delay` s),
    'gzip' (the right file, gzip-encoded when the client accepts it, after `delay` s: a good
    server). `files`: build-ID -> the bytes a good server would send."""

    def __init__(self, mode: str, files: dict[str, bytes], delay: float = 0.0):
        self.mode, self.files, self.delay = mode, files, delay
        self.requests = 0
        self.encodings: list[str] = []  # Accept-Encoding of each request
        self.most_at_once = 0
        self._at_once = 0
        self._lock = threading.Lock()
        self.httpd = _QuietServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                with server._lock:
                    server.requests += 1
                    server.encodings.append(self.headers.get("Accept-Encoding", ""))
                    server._at_once += 1
                    server.most_at_once = max(server.most_at_once, server._at_once)
                try:
                    server.answer(self)
                finally:
                    with server._lock:
                        server._at_once -= 1

        return Handler

    def answer(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        parts = handler.path.strip("/").split("/")
        body = self.files.get(parts[1]) if len(parts) == 3 and parts[0] == "buildid" else None
        if body is None:
            self._send(handler, 404, b"not found")
            return
        mode = self.mode
        if mode in ("slow", "gzip"):
            time.sleep(self.delay)
        if mode == "500":
            self._send(handler, 500, b"internal error")
        elif mode == "truncated":
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body[: len(body) // 3])
            handler.wfile.flush()
            handler.close_connection = True
        elif mode == "not-elf":
            self._send(handler, 200, b"<html><body>debuginfod moved</body></html>")
        elif mode == "wrong-build-id":
            self._send(handler, 200, next(data for key, data in self.files.items() if key != parts[1]))
        elif mode == "gzip" and "gzip" in handler.headers.get("Accept-Encoding", ""):
            self._send(handler, 200, gzip.compress(body), {"Content-Encoding": "gzip", "X-DEBUGINFOD-SIZE": len(body)})
        else:
            self._send(handler, 200, body)

    @staticmethod
    def _send(handler, status: int, body: bytes, headers: dict | None = None) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            handler.send_header(name, str(value))
        handler.end_headers()
        handler.wfile.write(body)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def cache_leftovers(cache: Path) -> list[str]:
    """Files in a debuginfod cache that no reader may take for a file: partial downloads."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and p.name.startswith("."))


def files_in(cache: Path) -> dict[str, int]:
    """'<build-ID>/<kind>' -> size of each file in a debuginfod cache (0: a negative entry)."""
    return {
        f"{p.parent.name}/{p.name}": os.path.getsize(p)
        for p in cache.glob("*/*")
        if p.is_file() and p.name in ("debuginfo", "executable")
    }
