"""Where tbpipe keeps files that outlive a run: `$TBPIPE_CACHE_DIR`, else the user's cache folder.

The symbol store (`tbpipe.pipeline.symbols.store`) and the torch-ops observer built against the
installed PyTorch (`tbpipe.capture.torch_observer`) both live under it. It is defined here, on the
capture side, because the capture library never imports the pipeline.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """TBPIPE_CACHE_DIR, else the platform's user cache dir + /tbpipe."""
    configured = os.environ.get("TBPIPE_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    if os.uname().sysname == "Darwin":
        return Path.home() / "Library" / "Caches" / "tbpipe"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) else Path.home() / ".cache"
    return base / "tbpipe"
