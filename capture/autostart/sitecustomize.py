"""Started by `tbpipe run`: records this Python process into its own run.

`tbpipe run` puts this folder first on PYTHONPATH, so every Python process of
the captured program (children included) imports it at start-up. It then hands
over to any other sitecustomize module further down the path.
"""

import importlib.util
import os
import sys


def _start_recording() -> None:
    try:
        from tbpipe.capture.autostart_session import start_from_environment
    except ImportError as error:  # a child running another Python without tbpipe
        print(f"tbpipe: not recording {sys.executable} (pid {os.getpid()}): {error}", file=sys.stderr)
        return
    start_from_environment()


def _chain_to_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_tbpipe_chained_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain_to_next_sitecustomize()
_start_recording()
