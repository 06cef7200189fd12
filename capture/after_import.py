"""Run a function right after a module's top-level import finishes, without importing it.

`tbpipe run` starts sources at interpreter start-up, before the program imports
torch or triton. Importing them there would cost seconds and change the
program's import order (environment variables it sets before `import torch`),
so a source that needs one of them waits for the program's own import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from tbpipe.capture.errors import SourceError


class AfterImport:
    """A finder placed first on sys.meta_path: it finds `name` with the other
    finders, wraps the loader's exec_module and calls `callback(module)` once
    the module has executed. It never changes what is imported. (A finder needs
    only `find_spec`; importlib.abc's base class would cost every session's
    start the import of importlib.resources and tempfile.)"""

    def __init__(self, name: str, callback: Callable[[Any], None]):
        self.name = name
        self.callback = callback
        self._searching = False
        self.fired = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self._searching or self.fired:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._searching = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        watcher = self

        def exec_module(module: Any) -> None:
            if getattr(module, "__name__", None) != watcher.name:
                original(module)  # a loader shared with other modules
                return
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # the loader's own method again
                except AttributeError:
                    pass
            watcher._fire(module)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            print(f"tbpipe: cannot watch for `import {self.name}`; its events are not recorded", file=sys.stderr)
        return spec

    def _fire(self, module: Any) -> None:
        if self.fired:
            return
        self.fired = True
        remove(self)
        try:
            self.callback(module)
        except Exception as error:  # never break the program's import
            print(f"tbpipe: after `import {self.name}`: {type(error).__name__}: {error}", file=sys.stderr)


def install(name: str, callback: Callable[[Any], None]) -> AfterImport:
    watcher = AfterImport(name, callback)
    sys.meta_path.insert(0, watcher)
    return watcher


def remove(watcher: AfterImport | None) -> None:
    if watcher is not None and watcher in sys.meta_path:
        sys.meta_path.remove(watcher)


def fully_imported(name: str) -> Any:
    """The module if it is in sys.modules and done executing, else None."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    return None if getattr(spec, "_initializing", False) else module


def installed(name: str) -> bool:
    """Whether `import name` would find something, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class AttachWhenImported:
    """A source's attach step for a package the program imports itself (torch, triton).

    `start()` attaches at once when the package is already imported, else once the program's own
    `import` of it finishes; `cancel()` forgets a pending attach. Both hold `lock`, which the source
    shares for its own state, so an import finishing while the session stops never attaches late.
    """

    def __init__(self, module_name: str, source: str, package: str, attach: Callable[[Any], Any], lock: Any):
        self.module_name = module_name
        self.source = source  # the source's name, for messages
        self.package = package  # the package's name as people know it ("PyTorch")
        self.attach = attach
        self.lock = lock
        self._watcher: AfterImport | None = None

    def start(self) -> str:
        """The source's status line; SourceError when the package is not installed at all."""
        with self.lock:
            module = fully_imported(self.module_name)
            if module is not None:
                self.attach(module)
                return "recording"
            if not installed(self.module_name):
                raise SourceError(
                    f"the {self.source} source needs {self.package}, which is not installed for this Python "
                    f"({sys.executable})"
                )
            if self._watcher is None:
                self._watcher = install(self.module_name, self._on_import)
            return f"recording (from `import {self.module_name}` on)"

    def cancel(self) -> None:
        with self.lock:
            remove(self._watcher)
            self._watcher = None

    def _on_import(self, module: Any) -> None:
        with self.lock:
            if self._watcher is None:
                return  # the session stopped while the package was importing
            self._watcher = None
            self.attach(module)
