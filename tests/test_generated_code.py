"""Generated code as a class of its own, and its lines followed back to the user's, without PyTorch.

A captured process runs a "wrapper" module from a folder its manifest names as generated code (as
Inductor's cache is named), with a `code_origins` part mapping the wrapper's lines to a user line;
the wrapper also calls a library that runs code made with `exec` (as Inductor's Triton launchers
are). The ingest must site the mapped lines at the user's line (one call site with the same line run
directly), an unmapped generated line at the user frame that called the generated code, and nothing
in generated code (tests/test_rules.py holds the in-memory siting to the SQL). Raw runs of schema
version 1 still load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.runs import read_runs, rewrite_as_raw_version
from support.synthetic import write_part

from tbpipe import capture
from tbpipe.schemas import raw

duckdb = pytest.importorskip("duckdb", reason="the call_sites view needs DuckDB (tbpipe ingest)")

from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database  # noqa: E402
from tbpipe.pipeline.rawrun import DamagedRunError  # noqa: E402

MODEL = """\
from tbpipe import capture


def forward(x):
    capture.record("op", "aten::add"); return x + 1  # ORIGIN LINE
"""

# What a compiler would have generated from model.forward: a wrapper whose first call stands for
# the origin line, whose second runs a launcher made by a library, whose third has no origin row.
WRAPPER = """\
from tbpipe import capture
import fakert


def call(x):
    capture.record("op", "aten::add")  # MAPPED LINE
    fakert.launch()  # LAUNCH LINE
    capture.record("op", "aten::empty")  # UNMAPPED LINE
    return x + 1
"""

LIBRARY = """\
def launch():
    scope = {}
    exec("from tbpipe import capture\\ndef launcher():\\n    capture.record('triton_launch', 'kernel_0')\\n", scope)
    return scope["launcher"]()
"""

MAIN = """\
import model
import wrapper


def main():
    model.forward(1)  # EAGER CALL
    wrapper.call(1)  # COMPILED CALL
"""


def line_of(source: str, marker: str) -> int:
    (number,) = [n for n, text in enumerate(source.splitlines(), 1) if text.rstrip().endswith(f"# {marker}")]
    return number


@pytest.fixture(scope="module")
def generated(tmp_path_factory, symbol_cache):
    base = tmp_path_factory.mktemp("generated")
    app, cache = base / "app", base / "cache" / "ab"
    library = base / "venv" / "lib" / "python3.11" / "site-packages"
    for folder in (app, cache, library):
        folder.mkdir(parents=True)
    (app / "model.py").write_text(MODEL)
    (app / "main.py").write_text(MAIN)
    (cache / "wrapper.py").write_text(WRAPPER)
    (library / "fakert.py").write_text(LIBRARY)
    paths = [str(app), str(cache), str(library)]
    sys.path[:0] = paths
    try:
        import main

        with capture.session(base / "runs", flush_interval_s=60):
            main.main()
    finally:
        for path in paths:
            sys.path.remove(path)
        for name in ("main", "model", "wrapper", "fakert"):
            sys.modules.pop(name, None)
    (run_dir,) = [p for p in (base / "runs").iterdir() if p.is_dir()]
    # What the capture writes for a compiled graph: the manifest names the folder of generated code,
    # and a code_origins part maps the wrapper's lines (all but the unmapped one) to the user's line.
    origin = [
        {
            "filename": str(app / "model.py"),
            "qualname": "forward",
            "first_line": line_of(MODEL, "ORIGIN LINE") - 1,
            "line": line_of(MODEL, "ORIGIN LINE"),
        }
    ]
    rows = [
        {
            "file": str(cache / "wrapper.py"),
            "line_lo": 1,
            "line_hi": line_of(WRAPPER, "UNMAPPED LINE") - 1,
            "origin": origin,
        }
    ]
    write_part(run_dir, "code_origins", 99, pa.Table.from_pylist(rows, schema=raw.code_origins_schema()))
    manifest_path = run_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["generated_code"] = {"inductor": str(base / "cache")}
    manifest_path.write_text(json.dumps(manifest))
    db = base / "generated.duckdb"
    summary = ingest_runs([base / "runs"], IngestOptions(db_path=db, cache_dir=symbol_cache, progress=False))
    assert summary.ok, [o.reason for o in summary.outcomes]
    return {"base": base, "app": app, "cache": base / "cache", "db": db}


def rows(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def test_generated_lines_are_sited_at_their_origin_or_the_calling_user_frame(generated) -> None:
    model, main = str(generated["app"] / "model.py"), str(generated["app"] / "main.py")
    sites = rows(
        generated["db"],
        "SELECT name, site_function, site_file, site_line, events FROM call_sites ORDER BY name, site_file",
    )
    origin = line_of(MODEL, "ORIGIN LINE")
    assert sites == [
        # the eager call and the mapped generated line: one site
        ("aten::add", "forward", model, origin, 2),
        # no origin row for that line: the user frame that called the generated code
        ("aten::empty", "main", main, line_of(MAIN, "COMPILED CALL"), 1),
        # made by `exec` in a library called from generated code: its caller's, not user code
        ("kernel_0", "forward", model, origin, 1),
    ]
    assert (
        len({key for (key,) in rows(generated["db"], "SELECT site_key FROM call_sites WHERE name = 'aten::add'")}) == 1
    )


def test_generated_files_are_neither_user_code_nor_sites(generated) -> None:
    cache = str(generated["cache"]) + "/"
    assert rows(generated["db"], "SELECT prefix, generator FROM generated_code") == [(cache, "inductor")]
    classified = dict(rows(generated["db"], "SELECT file, is_generated FROM python_files WHERE NOT is_user"))
    assert classified[cache + "ab/wrapper.py"] is True
    assert not any(f.startswith(cache) for (f,) in rows(generated["db"], "SELECT site_file FROM call_sites"))


def test_traceback_shows_the_origin_inlined_into_the_generated_frame(generated) -> None:
    (traceback,) = rows(
        generated["db"],
        """
        SELECT t.traceback FROM stack_tracebacks t
        WHERE t.stack_id IN (SELECT stack_id FROM events WHERE name = 'kernel_0')
        """,
    )[0]
    model, wrapper = str(generated["app"] / "model.py"), str(generated["cache"] / "ab" / "wrapper.py")
    python = [line for line in traceback.split("\n") if ".py:" in line or line.startswith("<")]
    assert python[:4] == [
        "<string>:3:launcher",
        f"{str(generated['base'])}/venv/lib/python3.11/site-packages/fakert.py:4:launch",
        f"{model}:{line_of(MODEL, 'ORIGIN LINE')}:forward [inlined]",
        f"{wrapper}:{line_of(WRAPPER, 'LAUNCH LINE')}:call [generated]",
    ]


# ------------------------------------------------------------------------------------------ raw versions


def test_a_run_of_raw_schema_version_1_still_loads(tmp_path, symbol_cache) -> None:
    with capture.session(tmp_path / "runs"):
        capture.record("user", "step", n=1)
    (run,) = read_runs(tmp_path / "runs")
    assert run.manifest["schema_version"] == raw.RAW_SCHEMA_VERSION == 5
    rewrite_as_raw_version(run.path, 1)
    summary = ingest_runs(
        [tmp_path / "runs"], IngestOptions(db_path=tmp_path / "v1.duckdb", cache_dir=symbol_cache, progress=False)
    )
    assert summary.ok and [o.status for o in summary.outcomes] == ["ingested"]
    assert rows(tmp_path / "v1.duckdb", "SELECT kind, name FROM events") == [("user", "step")]


def test_a_part_older_than_its_table_is_damaged(tmp_path) -> None:
    with capture.session(tmp_path / "runs"):
        capture.record("user", "step")
    (run,) = read_runs(tmp_path / "runs")
    table = pa.Table.from_pylist([], schema=raw.code_origins_schema())
    metadata = dict(table.schema.metadata)
    metadata[raw.VERSION_KEY] = b"1"  # code_origins came with version 2
    pq.write_table(table.replace_schema_metadata(metadata), run.path / raw.table_file_name("code_origins", 7))
    with pytest.raises(
        DamagedRunError,
        match="expected table 'code_origins' schema version 2 to 5, file says 'code_origins' version '1'",
    ):
        read_runs(tmp_path / "runs")


# ------------------------------------------------------------------------------------------ naming functions

NESTED = """\
import functools


def deco(function):
    return function


class Outer:
    class Inner:
        @deco
        @functools.lru_cache
        def method(self):
            return 1

    def make(self):
        def inner(x):
            return [y * x for y in range(3)]

        return inner


square = lambda x: (  # noqa: E731
    x * x
)


def generator():
    yield from (n for n in range(3))
"""


def test_stack_trace_frames_are_named_as_code_objects_name_their_functions(tmp_path) -> None:
    # Graph nodes' stack traces give file, line and plain name; the capture names the function as the
    # code object does (qualified name and first line), so a compiled line keys like the eager one.
    from tbpipe.capture.torch_compile import origin_frame

    path = tmp_path / "nested.py"
    path.write_text(NESTED)
    top = compile(NESTED, str(path), "exec")
    seen = 0
    stack = [top]
    while stack:
        code = stack.pop()
        stack.extend(c for c in code.co_consts if isinstance(c, type(top)))
        lines = sorted({line for _start, _end, line in code.co_lines() if line is not None})
        for line in lines[-1:]:
            frame = origin_frame(str(path), line, code.co_name)
            expected = getattr(code, "co_qualname", code.co_name) if sys.version_info >= (3, 11) else code.co_name
            assert (frame["qualname"], frame["first_line"], frame["line"]) == (expected, code.co_firstlineno, line)
            seen += 1
    assert seen >= 7
