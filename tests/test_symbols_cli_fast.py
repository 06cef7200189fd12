"""`tbpipe addr2line` without typer: the fast argument parser agrees with typer's, or declines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.typer_spy import typer_kwargs

from tbpipe.pipeline.commands import addr2line as command

CASES = [
    ["-afiC", "-e", "/lib/x.so"],
    ["-e/lib/x.so", "-f", "0x10", "20"],
    ["--exe=/lib/x.so", "--json", "--jobs", "3", "0x1"],
    ["-ae", "lib.so", "-p", "-s", "--demangle", "--", "0x5"],
    ["--build-id", "abcd", "--cache-dir", "/tmp/c", "--debug-dir", "a", "--debug-dir=b", "--debug-root", "r"],
    ["0x1", "-i", "0x2", "--inlines", "--addresses", "--functions", "--pretty-print", "--basenames"],
    ["-e", "a", "-e", "b"],
]
DECLINED = [
    ["-h"],
    ["--help"],
    ["-x"],
    ["--exe"],
    ["-e", "-f"],
    ["--jobs", "x"],
    ["--json=1"],
    ["--func"],
    ["-"],
    ["-e", ""],
]


def _typer_kwargs(argv: list[str]) -> dict:
    return typer_kwargs(command, command.addr2line, argv)


@pytest.mark.parametrize("argv", CASES)
def test_fast_parser_agrees_with_typer(argv):
    fast = command.parse_fast(argv)
    assert fast is not None
    expected = {k: v for k, v in _typer_kwargs(argv).items() if v not in (None, False, [])}
    assert {k: v for k, v in fast.items() if v not in (None, False, [])} == expected


@pytest.mark.parametrize("argv", DECLINED)
def test_fast_parser_declines_what_it_does_not_model(argv):
    assert command.parse_fast(argv) is None


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-c", "from tbpipe.pipeline.cli import main; main()", "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout
    for name in ("run", "demo", "ingest", "query", "runs", "show", "addr2line", "debuginfo"):
        assert f" {name} " in out


def test_app_attribute_has_every_command():
    from tbpipe.pipeline import cli

    names = {c.name for c in cli.app.registered_commands} | {g.name for g in cli.app.registered_groups}
    assert {"run", "demo", "ingest", "query", "runs", "show", "addr2line", "debuginfo"} <= names
    assert Path(cli.__file__).name == "cli.py"
