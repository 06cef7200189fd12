"""`-` means standard output for every `--out`/`-o` that names a file; `tbpipe query`'s narrow layout; the
commands' one-line summaries in `--help`."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import TBPIPE
from rich.console import Console

from tbpipe.pipeline.commands.query import write_table


@pytest.fixture(scope="module")
def nights(tmp_path_factory, symbol_cache):
    from support.serve import environment, nights_database

    env = environment(symbol_cache)
    return nights_database(tmp_path_factory.getbasetemp(), env), env


def run(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*TBPIPE, *args], capture_output=True, cwd=cwd, timeout=120, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return done


def test_dash_is_standard_output(nights, tmp_path: Path) -> None:
    db, env = nights
    report = run(env, tmp_path, "report", "--db", str(db), "--candidate", "commit=c4", "--baseline", "commit=c3",
                 "--format", "json", "--out", "-")  # fmt: skip
    assert json.loads(report.stdout)["verdict"].startswith("3 regressions")
    html = run(env, tmp_path, "report", "--db", str(db), "--candidate", "commit=c4", "--baseline", "commit=c3",
               "--format", "html", "-o", "-")  # fmt: skip
    assert html.stdout.startswith(b"<!DOCTYPE html>")
    pprof = run(env, tmp_path, "export", "--db", str(db), "--run", "latest", "-f", "pprof", "--out", "-")
    assert gzip.decompress(pprof.stdout)  # a whole gzip stream on standard output
    query = run(env, tmp_path, "query", "--db", str(db), "-f", "csv", "-o", "-", "SELECT count(*) AS n FROM runs")
    assert query.stdout.decode().split() == ['"n"', "4"]
    assert not (tmp_path / "-").exists()  # no file named '-' anywhere


def test_query_picks_a_narrow_layout_on_a_narrow_terminal() -> None:
    import pyarrow as pa

    result = pa.table({"function": ["a_rather_long_function_name" * 2], "file": ["/srv/app/model.py"], "line": [12]})
    narrow = Console(width=40, force_terminal=True, record=True, color_system=None)
    write_table(result, narrow, 10)
    text = narrow.export_text()
    assert text.startswith("-- row 1 ") and "line      12\n" in text and "file      /srv/app/model.py\n" in text
    assert "a_rather_long_function_name" * 2 in text.replace("\n", "")  # wrapped, whole
    assert "┃" not in text  # not a folded table
    wide = Console(width=200, force_terminal=True, record=True, color_system=None)
    write_table(result, wide, 10)
    assert "┃" in wide.export_text()
    piped = Console(width=40, force_terminal=False, record=True, color_system=None)
    write_table(result, piped, 10)
    assert "┃" in piped.export_text()  # a pipe keeps the table (scripts read --format csv)


@pytest.mark.parametrize("group", ["", "lake", "debuginfo"])
def test_each_command_is_one_line_in_its_groups_help(group) -> None:
    """A command's summary in `tbpipe --help` is its docstring's first paragraph on one line (on a
    terminal wide enough), not cut where the source happens to wrap it."""
    from tbpipe.pipeline.cli import app

    typer_app = next((g.typer_instance for g in app.registered_groups if g.name == group), app)
    commands = [info.name or info.callback.__name__ for info in typer_app.registered_commands]
    commands += [g.name for g in typer_app.registered_groups]
    shown = subprocess.run(
        [*TBPIPE, *group.split(), "--help"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    panel = shown.stdout.split("Commands")[1].split("╰")[0].splitlines()[1:]
    assert sorted(line.strip("│ ").split()[0] for line in panel) == sorted(commands)  # a row each


def test_runs_are_listed_whole_in_a_pipe_and_on_a_narrow_terminal(nights, tmp_path: Path) -> None:
    """`tbpipe runs` cuts no value: into a pipe the table keeps its natural width (rich would assume 80
    columns and cut the columns that must not wrap); on a terminal narrower than the table each run is
    a block of `column  value` lines."""
    db, env = nights
    ids = run(env, tmp_path, "query", "--db", str(db), "-f", "csv", "SELECT run_id FROM runs").stdout.decode()
    ids = [line.strip('"') for line in ids.split()[1:]]
    events = run(env, tmp_path, "query", "--db", str(db), "-f", "csv", "SELECT sum(events) FROM runs").stdout
    piped = run({**env, "COLUMNS": "80"}, tmp_path, "runs", "--db", str(db)).stdout.decode()
    rows = [line for line in piped.splitlines() if line.startswith("│ 2")]
    assert sorted(line.split()[1] for line in rows) == sorted(ids) and len(ids) == 4
    assert not any("…" in line for line in rows)
    shown_events = [int(cells.split("│")[5].replace(",", "")) for cells in rows]
    assert sum(shown_events) == int(events.split()[1])
    narrow = {**env, "COLUMNS": "60", "TTY_COMPATIBLE": "1", "NO_COLOR": "1"}
    terminal = re.sub(r"\x1b\[[0-9;]*m", "", run(narrow, tmp_path, "runs", "--db", str(db)).stdout.decode())
    assert terminal.startswith("4 runs\n") and terminal.count("-- row ") == 4
    assert sorted(re.findall(r"^run +(\S+)$", terminal, re.M)) == sorted(ids)
    assert "┃" not in terminal and max(len(line) for line in terminal.splitlines()) <= 60


def test_an_error_is_one_line_however_narrow_the_log(tmp_path: Path) -> None:
    """An error message is not wrapped at the console's width: a log search finds it whole, with its
    path in one piece."""
    missing = tmp_path / ("a-folder-with-a-rather-long-name-" * 3) / "nightly.duckdb"
    shown = subprocess.run(
        [*TBPIPE, "report", "--db", str(missing), "--candidate", "latest", "--baseline-window", "3"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert shown.returncode == 2
    assert shown.stderr.count("\n") == 1 and f"no database at {missing}" in shown.stderr
