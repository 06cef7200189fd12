"""`tbpipe ingest` without typer: the fast argument parser agrees with typer's, or declines, and the
command run either way ends alike."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from support.typer_spy import typer_kwargs

from tbpipe.pipeline.commands import ingest as command

CASES = [
    ["runs"],
    ["a", "b/c", "--db", "x.duckdb"],
    ["--db=x.duckdb", "runs", "--no-progress"],
    ["runs", "--debug-dir", "d1", "--debug-dir=d2", "--cache-dir", "/tmp/c", "--offline", "--progress"],
    ["--user-code", "/srv/app/", "--user-code=!vendor/", "--recover-manifests"],
    ["runs", "--debuginfod", "http://a:1", "--debuginfod", "http://b:2", "--db", "1", "--db", "2"],
    ["--progress", "--no-progress", "runs"],
    [],
]
DECLINED = [
    ["--help"],
    ["runs", "--wait", "5"],
    ["runs", "--engine", "spark", "--lake", "l"],
    ["runs", "--runs-per-transaction", "1"],
    ["runs", "--db"],
    ["runs", "--db", "--offline"],
    ["runs", "--db="],
    ["runs", "--offline=1"],
    ["runs", "-"],
    ["runs", "-x"],
    [""],
    ["--", "runs"],
]


def _typer_kwargs(argv: list[str]) -> dict:
    return typer_kwargs(command, command.ingest, argv)


@pytest.mark.parametrize("argv", CASES)
def test_fast_parser_agrees_with_typer(argv):
    fast = command.parse_fast(argv)
    assert fast is not None
    # What the fast parser leaves out, `ingest` takes from its own defaults, as typer does.
    defaults = {name: p.default for name, p in inspect.signature(command.ingest).parameters.items()}
    assert {**defaults, **fast} == _typer_kwargs(argv)


@pytest.mark.parametrize("argv", DECLINED)
def test_fast_parser_declines_what_it_does_not_model(argv):
    assert command.parse_fast(argv) is None


def test_the_fast_path_fails_and_succeeds_as_typer_does(tmp_path: Path) -> None:
    def tbpipe(*args: str, fast: bool) -> subprocess.CompletedProcess:
        # `--wait 600` (the default) is not in the fast parser's subset: typer parses that line.
        extra = () if fast else ("--wait", "600")
        return subprocess.run(
            [sys.executable, "-m", "tbpipe.pipeline", "ingest", *args, *extra],
            capture_output=True,
            text=True,
            timeout=120,
            env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "TBPIPE_CACHE_DIR": str(tmp_path / "cache")},
        )

    (tmp_path / "empty").mkdir()
    for args in ([str(tmp_path / "nowhere"), "--db", str(tmp_path / "t.duckdb")], []):
        fast, slow = tbpipe(*args, fast=True), tbpipe(*args, fast=False)
        assert (fast.returncode, fast.stdout, fast.stderr) == (slow.returncode, slow.stdout, slow.stderr)
        assert fast.returncode == 2 and fast.stderr.startswith("tbpipe: ")
    fast = tbpipe(str(tmp_path / "empty"), "--db", str(tmp_path / "t.duckdb"), fast=True)
    slow = tbpipe(str(tmp_path / "empty"), "--db", str(tmp_path / "t.duckdb"), fast=False)
    assert fast.returncode == slow.returncode == 0
    assert fast.stdout.split("time")[0] == slow.stdout.split("time")[0]  # the table, but its time


def test_a_plain_command_line_imports_neither_typer_nor_pydantic(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code = (
        "import sys\n"
        "from tbpipe.pipeline.cli import main\n"
        "sys.argv = ['tbpipe', 'ingest', *sys.argv[1:]]\n"
        "try:\n"
        "    main()\n"  # typer's ends with sys.exit(0)
        "finally:\n"
        "    print('IMPORTED', sorted(m for m in ('typer', 'pydantic', 'click') if m in sys.modules))\n"
    )
    for extra, imported in (((), "[]"), (("--wait", "600"), "['pydantic', 'typer']")):
        result = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "empty"), "--db", str(tmp_path / "t.duckdb"), *extra],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "TBPIPE_CACHE_DIR": str(tmp_path / "cache")},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1] == f"IMPORTED {imported}"
