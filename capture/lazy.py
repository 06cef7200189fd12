"""Names of a package imported from its submodules on first use (PEP 562), shared by the packages
whose import must stay cheap (`tbpipe.capture`, `tbpipe.pipeline.symbols`, `tbpipe.pipeline.export`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, names: dict[str, str], namespace: dict[str, Any]) -> tuple[Callable, Callable]:
    """`(__getattr__, __dir__)` for `package`: each of `names` (name -> submodule) is imported from
    its submodule when first read, then kept in `namespace` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
