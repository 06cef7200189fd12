"""A real `tbpipe serve` for the service's tests and its benchmark: a uvicorn server in a child
process on a free loopback port, and nightly runs of a small program captured with `tbpipe run`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

TBPIPE = [sys.executable, "-m", "tbpipe.pipeline"]

# Night N of a small program: version 2 doubles `softmax`, adds a `layernorm` site and a `gemm_splitk`
# kernel at the gemm site; the others stay.
PROGRAM_V1 = """import sys

from tbpipe import capture


def gemms():
    for name in ("gemm", "gemm", "gemm"):
        capture.record("kernel_launch", name)  # the gemm site


def softmaxes(n):
    for _ in range(n):
        capture.record("kernel_launch", "softmax")  # the softmax site


def matmuls():
    for _ in range(2):
        capture.record("op", "aten::mm")  # the mm site


def main():
    capture.record("step", "train")
    gemms()
    softmaxes(4)
    matmuls()


main()
"""


def program_v2() -> str:
    text = PROGRAM_V1.replace('("gemm", "gemm", "gemm")', '("gemm", "gemm", "gemm", "gemm_splitk")')
    text = text.replace("    softmaxes(4)", "    softmaxes(8)\n    added()")
    return text.replace(
        "def main():",
        'def added():\n    capture.record("kernel_launch", "layernorm")  # the layernorm site\n\n\ndef main():',
    )


def line_of(text: str, marker: str) -> int:
    (number,) = [i for i, line in enumerate(text.splitlines(), 1) if marker in line]
    return number


def capture_nights(root: Path, env: dict[str, str]) -> Path:
    """Nights 1-3 run version 1, night 4 version 2, each from its own checkout; returns the runs folder."""
    runs = root / "runs"
    for night, text in ((1, PROGRAM_V1), (2, PROGRAM_V1), (3, PROGRAM_V1), (4, program_v2())):
        checkout = root / f"build-{night}" / "repo"
        checkout.mkdir(parents=True)
        (checkout / "app.py").write_text(text)
        result = subprocess.run(
            [*TBPIPE, "run", "--out", str(runs), "--label", "suite=app", "--label", f"commit=c{night}", "--",
             sys.executable, "app.py"],
            cwd=checkout, capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    return runs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`tbpipe serve` in a child process on 127.0.0.1; `url` once it answers."""

    def __init__(self, db: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None):
        self.db = db
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or db.with_name(db.name + f".serve-{self.port}.log")
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*TBPIPE, "serve", "--db", str(db), "--port", str(self.port), *args],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tbpipe serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/api/ingest", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"tbpipe serve did not answer within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log_file.close()
        return self.process.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(predicate, timeout_s: float = 120.0, poll_s: float = 0.2, what: str = "condition"):
    """Polls `predicate` until it returns something truthy (returned); fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def environment(symbol_cache: Path) -> dict[str, str]:
    return dict(os.environ, TBPIPE_CACHE_DIR=str(symbol_cache))


def nights_database(base: Path, env: dict[str, str]) -> Path:
    """The four nights captured and ingested once per test session (under `base`); the database's path."""
    root = base / "serve-nights"
    db = root / "tbpipe.duckdb"
    if (root / "ready").exists():
        return db
    root.mkdir(parents=True, exist_ok=True)
    runs = capture_nights(root, env)
    result = subprocess.run(
        [*TBPIPE, "ingest", str(runs), "--db", str(db)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (root / "ready").write_text("")
    return db
