"""One module per `tbpipe` subcommand; each stays a thin layer over the library API."""

from __future__ import annotations

# `--frames` of the commands that print tracebacks (show, report, ranks): a focus mode (stacks/focus.py).
FRAMES_HELP = (
    "Tracebacks' frames: program (start-up and CPython's own frames folded, tbpipe's hidden), python, native or all."
)


def checked_frames(frames: str) -> str:
    """A `--frames` value, or the usage error that names the focus modes."""
    from tbpipe.pipeline.errors import UsageError
    from tbpipe.pipeline.stacks.focus import MODES

    if frames not in MODES:
        raise UsageError(f"--frames is one of {', '.join(MODES)}, not {frames!r}")
    return frames
