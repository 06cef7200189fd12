"""The stages' import order: data flows left to right (README, Architecture), and no stage imports one
to its right. Read from the sources (every import, at module top or inside a function), so a lazy
import that breaks the order is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each stage's place, left to right. A module may import its own stage and those left of it.
STAGE_RANK = {
    "schemas": 0,  # the raw format and its identities, shared by both sides
    "capture": 1,  # what a captured program imports
    "pipeline.errors": 2,  # helpers every offline stage shares
    "pipeline.progress": 2,
    "pipeline.parquet_pages": 2,
    "pipeline.runfolder": 3,  # find run folders, check their manifests (no Parquet)
    "pipeline.rawrun": 3,  # read and validate run folders
    "pipeline.symbols": 3,  # debug info by build-ID (beside reading, feeding the stacks)
    "pipeline.stacks": 4,  # flatten, hash, combined order, layout
    "pipeline.db": 5,  # load and read the database
    "pipeline.lake": 6,  # outputs and past one machine
    "pipeline.reports": 6,
    "pipeline.export": 6,
    "pipeline.serve": 6,
    "pipeline.demo": 6,
    "pipeline.doctor": 6,  # reads the symbol search, the database and run folders
    "pipeline.commands": 7,  # the CLI, thin over everything
    "pipeline.cli": 7,
    "pipeline.__main__": 7,
    "pipeline": 7,  # the package's own convenience names
}


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "tbpipe." + ".".join(parts)


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tbpipe" or len(parts) < 2:
        return None
    if parts[1] in ("schemas", "capture"):
        return parts[1]
    if parts[1] == "pipeline":
        return "pipeline." + parts[2] if len(parts) > 2 else "pipeline"
    return None  # the extension (tbpipe._native), usable by all


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("tbpipe", "tbpipe.pipeline"):  # `from tbpipe.pipeline import db` names a stage
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _sources() -> list[Path]:
    return sorted(path for folder in ("schemas", "capture", "pipeline") for path in (ROOT / folder).rglob("*.py"))


def test_every_stage_is_ranked() -> None:
    stages = {_stage(_module_name(path)) for path in _sources()}
    assert stages - set(STAGE_RANK) == set()


@pytest.mark.parametrize("stage", sorted({s for s in STAGE_RANK if "." not in s or s.count(".") == 1}))
def test_no_stage_imports_one_to_its_right(stage: str) -> None:
    wrong = []
    for path in _sources():
        source_stage = _stage(_module_name(path))
        if source_stage != stage:
            continue
        for line, module in _imported_modules(ast.parse(path.read_text(), str(path))):
            target = _stage(module)
            if target is not None and STAGE_RANK[target] > STAGE_RANK[stage]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({target})")
    assert wrong == []


def test_the_capture_imports_nothing_of_the_pipeline() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources()
        if path.relative_to(ROOT).parts[0] in ("capture", "schemas")
        for line, module in _imported_modules(ast.parse(path.read_text()))
        if module.startswith("tbpipe.pipeline")
    ]
    assert wrong == []


def test_the_check_sees_imports_inside_functions() -> None:
    tree = ast.parse("def f():\n    from tbpipe.pipeline.db.read import x\nfrom tbpipe.pipeline import stacks\n")
    assert sorted(_stage(module) for _, module in _imported_modules(tree)) == ["pipeline.db", "pipeline.stacks"]
