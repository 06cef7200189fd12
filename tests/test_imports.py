"""Imports sit at the top of their module, where a reader sees what it depends on. An import inside a
function is allowed only where it is listed here, with why: a costly package that only some commands
need, or a start-up path that must stay short (the CLI before a command runs, a captured program,
`tbpipe addr2line`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Costly and optional: each serves one feature, and importing it up front would slow every other
# command (or a captured program) for nothing.
OPTIONAL_PACKAGES = {
    "torch": "the torch-ops, CUDA and torch.compile sources: only programs that use torch",
    "triton": "Triton's launch hooks: only programs that use Triton",
    "pyspark": "the Spark ingest and lake (an extra)",
    "pandas": "what PySpark's Arrow UDFs hand over",
    "sqlglot": "the views in Spark SQL (the Spark extra)",
    "fastapi": "tbpipe serve",
    "starlette": "tbpipe serve",
    "uvicorn": "tbpipe serve",
    "jinja2": "HTML reports and the service's pages",
    "httpx": "debuginfod servers, asked only for modules without local debug info",
    "google": "protobuf, for pprof exports",
    "playwright": "browser checks",
    "rich": "progress bars, drawn only when stderr is a terminal",
    "venv_pack": "tbpipe lake package (the Spark extra)",
}

# Start-up paths: every import in these files may wait until it is needed.
START_PATHS = {
    "pipeline/cli.py": "the CLI's start: `tbpipe --help` and each command load their library on use",
    "pipeline/commands/": "each subcommand imports its library when it runs, not when the CLI starts",
    "capture/": "a captured program's start under `tbpipe run`: nothing heavy before the first event needs it",
    "pipeline/__init__.py": "`tbpipe.pipeline.symbolize` for in-process use, without the whole pipeline",
    "pipeline/symbols/": "`tbpipe addr2line` and the symbolizer's worker processes: each loads what a lookup needs",
}

# Single imports placed in a function on purpose, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    (
        "schemas/modulekey.py",
        "pyarrow",
    ): "module keys are pure Python for the symbolizer's start; columns of them need Arrow",
    ("schemas/modulekey.py", "pyarrow.compute"): "as above",
    (
        "pipeline/db/ingest/flow.py",
        "tbpipe.pipeline.db.ingest.stages",
    ): "the stages that read runs (numpy, pyarrow) load only when a run needs reading or the upkeep has work;"
    " an ingest of runs already loaded costs the database's opening (tests/test_ingest_nothing_to_do.py)",
    (
        "pipeline/db/ingest/tuning.py",
        "numpy",
    ): "numpy's huge-page switch, turned off by the stages, which import numpy anyway: the ingest's"
    " options (`IngestLimits`) and an ingest with nothing to do import no numpy",
    ("pipeline/serve/__init__.py", "tbpipe.pipeline.serve.app"): "`create_app` on first use: it imports FastAPI",
    (
        "pipeline/serve/app.py",
        "tbpipe.pipeline.serve",
    ): "the routes' modules import the app's types: loaded once the app exists",
    (
        "pipeline/serve/errors.py",
        "tbpipe.pipeline.serve.pages",
    ): "the pages import these errors: the page renderer is taken when an error page is made",
    **{
        (
            "pipeline/lake/executors.py",
            module,
        ): "the executors' probe is shipped by value and reports a tbpipe that does not import"
        for module in ("os", "socket", "sys", "tbpipe.capture", "tbpipe._native")
    },
}


def _lazy_imports() -> list[tuple[str, int, str]]:
    found = []
    for folder in ("schemas", "capture", "pipeline"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text(), relative)
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Import):
                        found += [(relative, node.lineno, alias.name) for alias in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                        found.append((relative, node.lineno, node.module))
    return sorted(set(found))


def _allowed(relative: str, module: str) -> bool:
    top = module.split(".")[0]
    if top in OPTIONAL_PACKAGES or (relative, module) in EXCEPTIONS:
        return True
    return any(relative == path or (path.endswith("/") and relative.startswith(path)) for path in START_PATHS)


def test_imports_inside_functions_are_the_listed_ones() -> None:
    wrong = [f"{path}:{line} imports {module}" for path, line, module in _lazy_imports() if not _allowed(path, module)]
    assert wrong == []


def test_every_listed_exception_is_still_there() -> None:
    present = {(path, module) for path, _line, module in _lazy_imports()}
    assert set(EXCEPTIONS) <= present
