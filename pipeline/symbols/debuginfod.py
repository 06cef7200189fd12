"""A debuginfod client: debug files and executables by build-ID from HTTP servers, kept in the
client cache that elfutils' tools and gdb share with the locator.

Servers: the `--debuginfod URL`s first, then `$DEBUGINFOD_URLS` (space-separated), tried in order
until one answers with a usable file (`GET <url>/buildid/<hex>/debuginfo`, or `/executable`).
The cache is elfutils' layout: `<cache>/<hex>/debuginfo` and `.../executable`, where a zero-length
file is a negative entry: every server answered 404, and none is asked again for that build-ID
until the entry is older than `<cache>/cache_miss_s` seconds (600 unless that file says otherwise).
A server that is down, slow, or answers with an error is not a negative answer: the next ingest
asks again.

`$DEBUGINFOD_TIMEOUT` (seconds, default 90) bounds the wait for a connection and for each piece of
an answer, `$DEBUGINFOD_MAXTIME` a whole transfer and `$DEBUGINFOD_MAXSIZE` the size of a file.
A download goes to a temporary file beside its target and is renamed into place only once it is
complete, an ELF file and of the build-ID asked for: no reader ever sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from tbpipe.pipeline.errors import first_line
from tbpipe.pipeline.progress import DownloadProgress, size_text
from tbpipe.pipeline.symbols.elf import ELF_MAGIC, read_build_id
from tbpipe.pipeline.symbols.model import ElfFileError, short_build_id

KINDS = ("debuginfo", "executable")
DEFAULT_TIMEOUT_S = 90.0  # elfutils' default for DEBUGINFOD_TIMEOUT
DEFAULT_CACHE_MISS_S = 600  # elfutils' default for <cache>/cache_miss_s
DEFAULT_JOBS = 4  # downloads at once

# What came of asking one server for one file.
DOWNLOADED, NOT_FOUND, FAILED, SKIPPED = "downloaded", "not found", "failed", "skipped"


def debuginfod_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The client cache: `$DEBUGINFOD_CACHE_PATH`, else `$XDG_CACHE_HOME` or `~/.cache`, + debuginfod_client."""
    env = os.environ if environ is None else environ
    configured = env.get("DEBUGINFOD_CACHE_PATH")
    if configured:
        return configured
    xdg = env.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "debuginfod_client")


def cache_path(cache_dir: str, build_id: str, kind: str) -> str:
    return os.path.join(cache_dir, build_id, kind)


def cache_miss_s(cache_dir: str) -> float:
    """How long a negative entry holds: `<cache>/cache_miss_s` (elfutils' setting file), else 600 s."""
    try:
        with open(os.path.join(cache_dir, "cache_miss_s")) as handle:
            return max(0.0, float(handle.read().strip()))
    except (OSError, ValueError):
        return float(DEFAULT_CACHE_MISS_S)


def negative_entry_age(path: str) -> float | None:
    """Seconds since a negative entry at `path` was written; None when `path` is not one.

    elfutils writes an empty file (older versions one with mode 000); tbpipe does the same."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if info.st_size and info.st_mode & 0o777:
        return None
    return max(0.0, time.time() - info.st_mtime)


def _env_float(environ: Mapping[str, str], name: str) -> float | None:
    text = environ.get(name, "").strip()
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


class DebuginfodHooks:
    """Seams for tests and tools: called on the downloading threads."""

    def answered(self, server: str, build_id: str, kind: str, attempt: Attempt) -> None:
        """After each answer of a server (or failure to get one)."""


@dataclass(frozen=True)
class DebuginfodSettings:
    """Which servers to ask and how (picklable: the Spark job ships it to its executors).

    `urls`: servers asked first (`--debuginfod`); `environment`: then `$DEBUGINFOD_URLS`;
    `offline`: ask nothing (the cache is still read); `timeout_s`: None for `$DEBUGINFOD_TIMEOUT`
    or 90 s; `cache_dir`: None for `debuginfod_cache_dir()` of the process that downloads;
    `jobs`: downloads at once; `hooks`: see `DebuginfodHooks` (never shipped)."""

    urls: tuple[str, ...] = ()
    environment: bool = True
    offline: bool = False
    timeout_s: float | None = None
    cache_dir: str | None = None
    jobs: int = DEFAULT_JOBS
    hooks: DebuginfodHooks | None = field(default=None, compare=False)

    def servers(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """The servers to ask, in order, each once (none when offline)."""
        if self.offline:
            return []
        env = os.environ if environ is None else environ
        listed = list(self.urls) + (env.get("DEBUGINFOD_URLS", "").split() if self.environment else [])
        out: list[str] = []
        for url in listed:
            url = url.strip().rstrip("/")
            if url and url not in out:
                out.append(url)
        return out

    def resolved(self, environ: Mapping[str, str] | None = None) -> DebuginfodSettings:
        """These settings with this process's environment read in: what other machines should use."""
        env = os.environ if environ is None else environ
        timeout = self.timeout_s or _env_float(env, "DEBUGINFOD_TIMEOUT") or DEFAULT_TIMEOUT_S
        return replace(self, urls=tuple(self.servers(env)), environment=False, timeout_s=timeout, hooks=None)


@dataclass
class Attempt:
    """One server asked for one file: what came back, how big, how long it took."""

    server: str
    outcome: str  # DOWNLOADED, NOT_FOUND, FAILED, SKIPPED
    seconds: float = 0.0
    http_status: int | None = None
    size: int | None = None  # bytes of the file written (downloaded) or received (failed)
    detail: str = ""  # why it failed, or was skipped

    def line(self, kind: str = "debuginfo") -> str:
        """'debuginfod URL: 200, 8.8 kB in 12 ms' and the like, for `looked_in`."""
        took = f"{self.seconds * 1000:.0f} ms" if self.seconds < 10 else f"{self.seconds:.1f} s"
        head = f"debuginfod {self.server}{_kind_note(kind)}: "
        if self.outcome == DOWNLOADED:
            return head + f"{self.http_status}, {size_text(self.size or 0)} in {took}"
        if self.outcome == NOT_FOUND:
            return head + f"{self.http_status} not found in {took}"
        if self.outcome == SKIPPED:
            return head + f"not asked: {self.detail}"
        return head + f"failed after {took}: {self.detail}"


@dataclass
class Fetched:
    """What the servers gave for one build-ID and kind: the file in the cache, or nothing and why."""

    build_id: str
    kind: str
    path: str | None = None
    server: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    negative: str | None = None  # why no server was asked (a fresh negative entry)

    def lines(self) -> list[str]:
        out = [attempt.line(self.kind) for attempt in self.attempts]
        if self.negative:
            out.append(self.negative)
        return out


class DebuginfodClient:
    """Asks servers for files by build-ID, into the cache; one per process or job (thread-safe).

    `progress`: a bar with bytes on a terminal (None: when stderr is one); `describe`: instead of
    a bar, a callable that gets a line of text now and then (the ingest's own bar shows it)."""

    def __init__(
        self,
        servers: Iterable[str],
        cache_dir: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_time_s: float | None = None,
        max_size: int | None = None,
        jobs: int = DEFAULT_JOBS,
        progress: bool | None = None,
        describe: Callable[[str], None] | None = None,
        hooks: DebuginfodHooks | None = None,
    ):
        self.servers = list(servers)
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self.max_time_s = max_time_s
        self.max_size = max_size
        self.jobs = max(1, jobs)
        self.progress = progress
        self.describe = describe
        self.hooks = hooks or DebuginfodHooks()
        self._lock = threading.Lock()
        self._http: Any = None
        self._results: dict[tuple[str, str], Fetched] = {}
        self._down: dict[str, str] = {}  # server -> why it is not asked again by this client
        self._negative_hits = 0

    @classmethod
    def from_settings(
        cls,
        settings: DebuginfodSettings,
        environ: Mapping[str, str] | None = None,
        *,
        progress: bool | None = None,
        describe: Callable[[str], None] | None = None,
    ) -> DebuginfodClient | None:
        """A client for `settings`, or None when there is no server to ask (or offline)."""
        env = os.environ if environ is None else environ
        servers = settings.servers(env)
        if not servers:
            return None
        max_size = _env_float(env, "DEBUGINFOD_MAXSIZE")
        return cls(
            servers,
            settings.cache_dir or debuginfod_cache_dir(env),
            timeout_s=settings.timeout_s or _env_float(env, "DEBUGINFOD_TIMEOUT") or DEFAULT_TIMEOUT_S,
            max_time_s=_env_float(env, "DEBUGINFOD_MAXTIME"),
            max_size=int(max_size) if max_size else None,
            jobs=settings.jobs,
            progress=progress,
            describe=describe,
            hooks=settings.hooks,
        )

    # ------------------------------------------------------------------ asking

    def fetched(self, build_id: str, kind: str = "debuginfo") -> Fetched | None:
        """What this client already got for (build_id, kind), if it asked."""
        with self._lock:
            return self._results.get((build_id, kind))

    def fetch(self, build_id: str, kind: str = "debuginfo") -> Fetched:
        """The file for `build_id` from the first server that has it (asked once per client)."""
        return self.fetch_many([build_id], kind)[build_id]

    def fetch_many(self, build_ids: Iterable[str], kind: str = "debuginfo") -> dict[str, Fetched]:
        """`fetch` for many build-IDs, `jobs` downloads at once, with one progress display."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        wanted = list(dict.fromkeys(build_ids))
        out: dict[str, Fetched] = {}
        todo = []
        for build_id in wanted:
            known = self.fetched(build_id, kind)
            if known is not None:
                out[build_id] = known
            else:
                todo.append(build_id)
        if todo:
            with DownloadProgress(self.progress, self.describe) as progress:
                if len(todo) == 1 or self.jobs == 1:
                    results = [self._fetch_one(b, kind, progress) for b in todo]
                else:
                    with ThreadPoolExecutor(self.jobs, thread_name_prefix="tbpipe-debuginfod") as pool:
                        results = list(pool.map(lambda b: self._fetch_one(b, kind, progress), todo))
            for build_id, result in zip(todo, results):
                out[build_id] = result
        return out

    def _fetch_one(self, build_id: str, kind: str, progress: DownloadProgress) -> Fetched:
        result = Fetched(build_id, kind)
        target = cache_path(self.cache_dir, build_id, kind)
        age = negative_entry_age(target)
        if age is not None:
            hold = cache_miss_s(self.cache_dir)
            if age <= hold:
                result.negative = (
                    f"debuginfod{_kind_note(kind)}: not asked: every server answered 404 {_age_text(age)} ago "
                    f"(negative cache entry {target}, kept {_age_text(hold)})"
                )
                with self._lock:
                    self._negative_hits += 1
                    self._results[(build_id, kind)] = result
                return result
            with contextlib.suppress(OSError):
                os.unlink(target)  # expired: ask again
        for server in self.servers:
            with self._lock:
                down = self._down.get(server)
            if down is not None:
                attempt = Attempt(server, SKIPPED, detail=f"down earlier in this run ({down})")
            else:
                attempt = self._download(server, build_id, kind, target, progress)
                if attempt.outcome == FAILED and attempt.http_status is None and _server_unreachable(attempt):
                    with self._lock:
                        self._down.setdefault(server, attempt.detail)
            result.attempts.append(attempt)
            self.hooks.answered(server, build_id, kind, attempt)
            if attempt.outcome == DOWNLOADED:
                result.path, result.server = target, server
                break
        if result.path is None and result.attempts and all(a.outcome == NOT_FOUND for a in result.attempts):
            _write_negative_entry(target)
        with self._lock:
            self._results[(build_id, kind)] = result
        return result

    def _client(self) -> Any:
        with self._lock:
            if self._http is None:
                # httpx is slow to import: only a process that asks a server pays for it (not a warm addr2line).
                import httpx

                from tbpipe.capture import __version__

                self._http = httpx.Client(
                    timeout=httpx.Timeout(self.timeout_s),
                    follow_redirects=True,
                    headers={"User-Agent": f"tbpipe/{__version__}"},
                    limits=httpx.Limits(max_connections=self.jobs * 2, max_keepalive_connections=self.jobs * 2),
                )
            return self._http

    def _download(self, server: str, build_id: str, kind: str, target: str, progress: DownloadProgress) -> Attempt:
        import httpx

        started = time.monotonic()
        url = f"{server}/buildid/{build_id}/{kind}"
        attempt = Attempt(server, FAILED)
        received = 0
        expected: int | None = None
        temp: str | None = None
        counted = False
        response = None
        try:
            with self._client().stream("GET", url) as response:
                attempt.http_status = response.status_code
                if response.status_code == 404:
                    attempt.outcome = NOT_FOUND
                    return attempt
                if response.status_code != 200:
                    attempt.detail = f"HTTP {response.status_code} {response.reason_phrase}".strip()
                    return attempt
                expected = _expected_size(response)
                if self.max_size and expected and expected > self.max_size:
                    attempt.detail = f"{size_text(expected)} is over DEBUGINFOD_MAXSIZE ({size_text(self.max_size)})"
                    return attempt
                directory = os.path.dirname(target)
                os.makedirs(directory, mode=0o700, exist_ok=True)
                fd, temp = tempfile.mkstemp(prefix=f".{kind}.", suffix=".part", dir=directory)
                progress.start_file(expected)
                counted = True
                with os.fdopen(fd, "wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
                        received += len(chunk)
                        progress.advance(len(chunk))
                        if self.max_time_s and time.monotonic() - started > self.max_time_s:
                            raise _TooLong(f"not complete after {self.max_time_s:g} s (DEBUGINFOD_MAXTIME)")
                        if self.max_size and received > self.max_size:
                            raise _TooLong(f"over DEBUGINFOD_MAXSIZE ({size_text(self.max_size)})")
                if expected is not None and received != expected:
                    attempt.detail = f"truncated body: got {received:,} of {expected:,} bytes"
                    return attempt
                problem = _unusable(temp, build_id)
                if problem:
                    attempt.detail = problem
                    return attempt
                os.chmod(temp, 0o400)  # as elfutils keeps its downloads
                os.replace(temp, target)
                temp = None
                attempt.outcome, attempt.size = DOWNLOADED, received
                return attempt
        except httpx.TimeoutException:
            attempt.detail = f"no answer within {self.timeout_s:g} s (DEBUGINFOD_TIMEOUT)"
        except httpx.ConnectError as error:
            attempt.detail = f"cannot connect: {_reason(error)}"
        except (httpx.RemoteProtocolError, httpx.ReadError) as error:
            if counted:  # the body began: it was cut short (sizes as sent, before any decoding)
                sent = response.headers.get("content-length", "?")
                shown = f"{int(sent):,}" if sent.isdigit() else sent
                attempt.detail = f"truncated body: got {response.num_bytes_downloaded:,} of {shown} bytes"
            else:
                attempt.detail = f"connection broken: {_reason(error)}"
        except httpx.HTTPError as error:
            attempt.detail = f"{type(error).__name__}: {_reason(error)}"
        except _TooLong as error:
            attempt.detail = str(error)
        except OSError as error:
            attempt.detail = f"cannot write the cache {os.path.dirname(target)}: {error.strerror or error}"
        finally:
            attempt.seconds = time.monotonic() - started
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                attempt.size = received
            if counted:
                progress.finish_file(expected, received)
        return attempt

    # ------------------------------------------------------------------ reporting

    def report(self) -> list[str]:
        """One line per server asked (files, bytes, 404s, failures and why), and one for the negative cache."""
        with self._lock:
            results = list(self._results.values())
            negative_hits = self._negative_hits
        lines = []
        for server in self.servers:
            downloaded, size, missing = 0, 0, 0
            failures: dict[str, list[str]] = {}
            for result in results:
                for position, attempt in enumerate(result.attempts):
                    if attempt.server != server:
                        continue
                    if attempt.outcome == DOWNLOADED:
                        downloaded += 1
                        size += attempt.size or 0
                    elif attempt.outcome == NOT_FOUND:
                        missing += 1
                    elif attempt.outcome == FAILED:
                        tried_next = position + 1 < len(result.attempts)
                        detail = attempt.detail + ("; the next server was tried" if tried_next else "")
                        failures.setdefault(detail, []).append(result.build_id)
            skipped = sum(1 for r in results for a in r.attempts if a.server == server and a.outcome == SKIPPED)
            if not (downloaded or missing or failures or skipped):
                continue
            parts = []
            if downloaded:
                parts.append(f"{downloaded} file{'s' if downloaded != 1 else ''} downloaded ({size_text(size)})")
            if missing:
                parts.append(f"{missing} not found")
            for detail, build_ids in failures.items():
                shown = ", ".join(short_build_id(b) for b in build_ids[:3]) + (
                    f" and {len(build_ids) - 3} more" if len(build_ids) > 3 else ""
                )
                parts.append(f"failed for {len(build_ids)} ({shown}): {detail}")
            if skipped:
                parts.append(f"not asked for {skipped} more (down: {self._down.get(server, '')})")
            lines.append(f"{server}: " + "; ".join(parts))
        if negative_hits:
            lines.append(
                f"{negative_hits} build-ID{'s' if negative_hits != 1 else ''} not asked: every server answered 404 "
                f"within the last {_age_text(cache_miss_s(self.cache_dir))} (negative cache in {self.cache_dir})"
            )
        return lines

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.close()
                self._http = None


class _TooLong(Exception):
    """A transfer past DEBUGINFOD_MAXTIME or DEBUGINFOD_MAXSIZE."""


def _expected_size(response: Any) -> int | None:
    """The file's size as the server announces it: X-DEBUGINFOD-SIZE, else an unencoded Content-Length."""
    for name in ("x-debuginfod-size", "content-length"):
        value = response.headers.get(name)
        if name == "content-length" and response.headers.get("content-encoding", "identity") != "identity":
            continue  # the size on the wire, not of the file
        if value and value.strip().isdigit():
            return int(value)
    return None


def _unusable(path: str, build_id: str) -> str | None:
    """Why a downloaded file cannot stand for `build_id` (None when it can)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError as error:
        return f"cannot read the download: {error.strerror or error}"
    if not head.startswith(ELF_MAGIC):
        return f"not an ELF file (starts with {head[:8]!r})"
    try:
        found = read_build_id(path)
    except ElfFileError as error:
        return f"not a readable ELF file: {first_line(error)}"
    if found is None:
        return "the file has no build-ID note"
    if found != build_id:
        return f"wrong build-ID: the file's is {short_build_id(found)}"
    return None


def _write_negative_entry(target: str) -> None:
    """An empty file in place of the target, written as elfutils writes it (atomically here)."""
    directory = os.path.dirname(target)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=".negative.", suffix=".part", dir=directory)
        os.close(fd)
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    except OSError:
        pass  # without it the servers are asked again next time: slower, not wrong


def _server_unreachable(attempt: Attempt) -> bool:
    return attempt.detail.startswith(("cannot connect", "no answer within"))


def _reason(error: BaseException) -> str:
    text = first_line(error)
    return text if text and text != type(error).__name__ else type(error).__name__


def _kind_note(kind: str) -> str:
    return "" if kind == "debuginfo" else f" ({kind})"


def _age_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
