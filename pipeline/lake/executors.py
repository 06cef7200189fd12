"""What the Spark job needs of its executors, checked before it hands them work.

Executors are other processes, usually on other machines: another working folder, another Python
environment, other local disks. So the driver hands them only absolute paths (and `file:` URIs where
Spark's own reader reads), and before the first step one task per executor core reports which tbpipe
its Python imports and whether it sees the lake's folder. A different tbpipe version, a tbpipe that
does not import, or a lake the executors cannot see stops the job with one line naming the host and
the path, instead of failing in the middle of a step or quarantining every run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tbpipe.pipeline.lake.store import LakeError

SYMBOL_STORE_CONF = "spark.tbpipe.symbolStore"  # each executor's symbol store (relative: under its own folder)
PACKAGE_HINT = (
    "ship this environment to the executors: `tbpipe lake package` and the --conf settings it prints "
    "(spark.archives, spark.pyspark.python)"
)


def local_path(given: str | os.PathLike) -> Path:
    """A run folder or lake given on the command line as the absolute path executors can use: a
    relative path is taken from the driver's working folder; a `file:` URI is its path. Other URIs
    (hdfs:, s3a:) are refused: runs are read, and the lake written, through the file system the driver
    and the executors both mount."""
    text = os.fspath(given)
    parsed = urlparse(text)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).absolute()
    if parsed.scheme and len(parsed.scheme) > 1:
        raise LakeError(
            f"{text}: the Spark ingest reads runs and writes the lake through a file system that the driver and "
            f"every executor mount (a local path or file: URI, shared for a cluster), not {parsed.scheme}:"
        )
    return Path(text).expanduser().absolute()


def symbol_store(conf: dict[str, str], cache_dir: Path | None) -> str | None:
    """The symbol store executors use: `spark.tbpipe.symbolStore` (relative: under each executor's
    working folder; absolute: a shared or per-machine path), else --cache-dir made absolute on the
    driver, else None (each executor's default store: $TBPIPE_CACHE_DIR or its user cache folder)."""
    configured = conf.get(SYMBOL_STORE_CONF, "").strip()
    if configured:
        return configured
    return str(Path(cache_dir).expanduser().absolute()) if cache_dir else None


def _probe_function(lake: str) -> Any:
    """The task that reports an executor: defined here, so that it is shipped by value and runs before
    anything of tbpipe is imported there (a tbpipe that does not import is what it reports)."""

    def probe(_rows):
        import os
        import socket
        import sys

        version = location = problem = None
        try:
            import tbpipe.capture as capture

            version, location = capture.__version__, os.path.dirname(os.path.dirname(capture.__file__))
        except Exception as error:  # every failure is reported, whatever raised it
            problem = f"{type(error).__name__}: {error}"
        if problem is None:
            try:
                import tbpipe._native  # noqa: F401 - the extension must import too
            except Exception as error:
                problem = f"its extension does not import: {type(error).__name__}: {error}"
        yield (
            socket.gethostname(),
            sys.executable,
            version,
            location,
            problem,
            os.path.isdir(lake) and os.access(lake, os.W_OK),
        )

    return probe


def check_executors(spark: Any, lake: Path, expected_version: str) -> list[tuple]:
    """Runs the probe on the executors (two tasks per core the job has); raises LakeError naming the
    host and the problem when one imports another tbpipe, cannot import it, or cannot write the lake.
    Returns the distinct reports (host, python, version, location, problem, lake writable)."""
    context = spark.sparkContext
    tasks = max(2, 2 * context.defaultParallelism)
    reports = sorted(set(context.parallelize(range(tasks), tasks).mapPartitions(_probe_function(str(lake))).collect()))
    for host, python, version, location, problem, lake_ok in reports:
        where = f"the executor on {host} (Python {python})"
        if version is None:
            raise LakeError(f"{where} cannot import tbpipe ({problem}): {PACKAGE_HINT}")
        if version != expected_version:
            raise LakeError(
                f"{where} imports tbpipe {version} from {location}, this driver runs tbpipe {expected_version}: "
                f"{PACKAGE_HINT}"
            )
        if problem:
            raise LakeError(f"{where} imports tbpipe {version} from {location}, but {problem}: {PACKAGE_HINT}")
        if not lake_ok:
            raise LakeError(
                f"{where} cannot write the lake folder {lake}: the lake must be on a file system that the driver "
                "and every executor share"
            )
    return reports


def report_line(report: tuple) -> str:
    """One executor environment, for the ingest's summary."""
    host, python, version, location, _problem, _lake_ok = report
    return f"{host}: tbpipe {version} from {location}, Python {python}"


def unreachable_runs(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prepared runs whose folder the executor that took them could not read."""
    return [run for run in runs if run["status"] == "unreachable"]


def refuse_unreachable(runs: Sequence[dict[str, Any]]) -> None:
    """A LakeError naming the run folders (and the executors' hosts) that the driver listed but the
    executors cannot read: the runs are not damaged, they are on a disk the executors do not share."""
    lines = [run["reason"] for run in runs]
    shown = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    raise LakeError(
        f"{len(lines)} run folder(s) the driver listed cannot be read by the executors: {shown}. Put the runs on a "
        "file system that the driver and every executor share (the same path on every machine)"
    )
