"""`export`: the chosen events of a database, in one format, to a file (atomically) or a stream."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tbpipe.pipeline.errors import TbpipeError, UsageError
from tbpipe.pipeline.export.chrome_trace import write_chrome_trace
from tbpipe.pipeline.export.collapsed import write_collapsed
from tbpipe.pipeline.export.formats import ExportFormat
from tbpipe.pipeline.export.pprof import write_pprof
from tbpipe.pipeline.export.source import ExportFilter, ExportSource
from tbpipe.pipeline.progress import StepProgress


class ExportOutputError(TbpipeError):
    """The export cannot be written where it was asked to go."""


@dataclass(frozen=True)
class ExportSummary:
    format: ExportFormat
    run_ids: list[str]
    events: int  # events the output holds (samples' values, lines' counts or trace events)
    path: Path | None  # None: written to a stream


def export_to(source: ExportSource, fmt: ExportFormat, out: BinaryIO, *, traceback_args: bool = False) -> int:
    """Writes the source's events in `fmt` to the binary stream `out`; returns the events written."""
    if fmt is ExportFormat.pprof:
        return write_pprof(source, out)
    if fmt is ExportFormat.collapsed:
        return write_collapsed(source, out)

    return write_chrome_trace(source, out, traceback_args=traceback_args)


def _os_reason(error: OSError) -> str:
    return error.strerror or str(error)


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A new file that becomes `path` only when the block finishes without an error."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ExportOutputError(f"cannot write {path}: it is a directory")
    if not folder.is_dir():
        raise ExportOutputError(f"cannot write {path}: folder {folder} does not exist")
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=folder)
    except OSError as error:
        raise ExportOutputError(f"cannot write {path}: {_os_reason(error)}") from None
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as stream:
            yield stream
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise ExportOutputError(f"cannot write {path}: {_os_reason(error)}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export(
    con: Any,
    choice: ExportFilter,
    fmt: ExportFormat,
    out: Path | str | None = None,
    *,
    traceback_args: bool = False,
    frames: str = "all",
    progress: bool | None = False,
) -> ExportSummary:
    """Exports the events `choice` names from the database behind `con` as `fmt` to the file `out`
    (None or '-': standard output), their stacks focused by `frames` (a mode of `stacks.focus`);
    `progress`: a bar over the events on stderr (None: on a terminal, `progress.on_terminal`).
    Raises NoEventsError, RunSelectionError or ExportOutputError."""
    fmt = ExportFormat(fmt)
    if str(out) == "-":
        out = None
    if out is None and fmt.binary and sys.stdout.isatty():
        raise UsageError(f"--format {fmt.value} writes binary data: give --out FILE or redirect standard output")
    path = Path(out) if out is not None else None
    with StepProgress(f"export {fmt.value}", 0, progress) as bar, ExportSource(con, choice, frames, bar) as source:
        if path is None:
            stream = sys.stdout.buffer
            events = export_to(source, fmt, stream, traceback_args=traceback_args)
            stream.flush()
        else:
            with _atomic_file(path) as stream:
                events = export_to(source, fmt, stream, traceback_args=traceback_args)
        return ExportSummary(fmt, list(source.run_ids), events, path)
