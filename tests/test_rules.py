"""Every rule defined once, its fast paths held to its reference on random cases (hypothesis).

One property test per rule, each drawing random stacks (or what the rule reads) and comparing
every fast path with the reference definition beside it:

- the combined order (pipeline/stacks/order.py): `combined_order`, per stack in Python, against
  `combined_orders`, the extension's pass over a batch;
- stack identity, code hash and module key (schemas/identity.py, schemas/modulekey.py):
  `raw_stack_hashes` and the scalar rules against the extension's hash as the ingest
  (`flatten_run`) and the capture call it, and the Arrow column encoders;
- siting (pipeline/db/ingest/siting.py): `stack_sites_from` (SQL) against `sites_of_laid_out`;
- site counts (pipeline/db/ingest/site_counts.py): `count_sites` (SQL) against `site_counts_of`
  (numpy) and `spark_site_counts` (Spark);
- an op event's attributes as JSON text (schemas/op_attributes.py): `event_attrs_text` against the
  DuckDB SQL (the ingest's) and the Spark column (the lake's).

Hand-written cases with expected answers stay with their stages (test_stacks.py, test_siting.py).
"""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.db.connection import open_database, query_rows
from tbpipe.pipeline.db.ingest.site_counts import COUNTED_SITE_COLUMNS, count_sites, site_counts_of, spark_site_counts
from tbpipe.pipeline.db.ingest.siting import reference_sites, sites_of_laid_out
from tbpipe.pipeline.db.ingest.tables import IngestDb
from tbpipe.pipeline.stacks import layout, order
from tbpipe.pipeline.stacks.flatten import flatten_run
from tbpipe.pipeline.stacks.origins import ORIGIN_FLAG
from tbpipe.schemas import identity, raw
from tbpipe.schemas.modulekey import ModuleKey, module_key_column
from tbpipe.schemas.op_attributes import event_attrs_sql, event_attrs_text

E, M, ENTRY = raw.NATIVE_FRAME_EVAL_LOOP, raw.NATIVE_FRAME_MARKER, raw.PYTHON_FRAME_ENTRY
BY_FP, EXACT, RESOLVED = raw.NATIVE_FRAME_BY_FRAME_POINTER, raw.NATIVE_FRAME_EXACT_PC, raw.PYTHON_FRAME_LINE_RESOLVED

# Few examples of many stacks each: every test here takes a few seconds on two cores. No example
# database: a failure is reported with the case that makes it, and each run draws afresh.
QUICK = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
# Text Arrow can hold (no lone surrogates), often with the characters that separate or trim.
TEXT = st.text(st.characters(exclude_categories=("Cs",)) | st.sampled_from("\x1f /\t0x"), max_size=12)


# ------------------------------------------------------------------------------------------ combined order

NATIVE_FLAGS = st.sampled_from([0, 0, E, E, M, E | M, EXACT, BY_FP, E | BY_FP]) | UINT32
PYTHON_FLAGS = st.sampled_from([0, 0, ENTRY, ENTRY, RESOLVED, ENTRY | RESOLVED, ORIGIN_FLAG]) | UINT32
ORDER_STACK = st.tuples(st.lists(NATIVE_FLAGS, max_size=10), st.lists(PYTHON_FLAGS, max_size=8), st.integers(0, 15))


@QUICK
@given(stacks=st.lists(ORDER_STACK, max_size=25))
def test_combined_order_fast_path_is_the_reference(stacks) -> None:
    expected = []
    for native, python, status in stacks:
        ordered = order.combined_order(native, python, native_captured=not status & raw.STACK_NO_NATIVE)
        expected.append((ordered.slots, ordered.problem))
    fast = order.combined_orders(
        status=np.array([status for _n, _p, status in stacks], np.uint32),
        native_lengths=np.array([len(native) for native, _p, _s in stacks], np.int64),
        python_lengths=np.array([len(python) for _n, python, _s in stacks], np.int64),
        native_flags=np.array([f for native, _p, _s in stacks for f in native], np.uint32),
        python_flags=np.array([f for _n, python, _s in stacks for f in python], np.uint32),
    )
    # The fast path's slots by stack, as (kind, index among that stack's frames of the kind).
    starts = {
        True: np.cumsum([0] + [len(python) for _n, python, _s in stacks]),
        False: np.cumsum([0] + [len(native) for native, _p, _s in stacks]),
    }
    got: list[list] = [[] for _ in stacks]
    for owner, source, is_python in zip(fast.owner.tolist(), fast.source.tolist(), fast.is_python.tolist()):
        got[owner].append(("python" if is_python else "native", source - int(starts[is_python][owner])))
    assert list(zip(got, fast.problem.to_pylist())) == expected
    assert fast.slot.tolist() == [slot for slots, _problem in expected for slot in range(len(slots))]


# ------------------------------------------------------------------------------------------ identity

HEX = st.text("0123456789abcdefABCDEF", min_size=1, max_size=130)
BUILD_IDS = (
    st.none()
    | st.just("")
    | HEX
    | st.builds(
        lambda pad, prefix, digits: pad + prefix + digits + pad,
        st.sampled_from(["", " ", "\n"]),
        st.sampled_from(["", "0x", "0X"]),
        HEX,
    )
    | TEXT
    | st.text(min_size=195, max_size=260)  # garbage kept to its first 200 characters
)
MODULE_ROWS = st.lists(st.tuples(st.integers(-1, 6), BUILD_IDS, TEXT), max_size=6)
CODE_IDS = st.sampled_from([0, 1, 7, 2**63, 2**64 - 1]) | UINT64
CODE_ROWS = st.lists(st.tuples(CODE_IDS, TEXT, TEXT, INT32), max_size=6)
NATIVE_FRAMES = st.lists(
    st.tuples(st.integers(-1, 7), st.sampled_from([0, 1, 4096]) | UINT64, NATIVE_FLAGS), max_size=8
)
PYTHON_FRAMES = st.lists(st.tuples(CODE_IDS, INT32, INT32, PYTHON_FLAGS), max_size=6)
RAW_STACKS = st.lists(st.tuples(NATIVE_FRAMES, PYTHON_FRAMES, UINT32), max_size=20)


def _raw_tables(stacks: list, modules: list, code: list) -> dict[str, pa.Table]:
    """A raw run's stacks, modules and code tables (schemas.raw) of the drawn rows."""
    return {
        "stacks": pa.Table.from_pylist(
            [
                {
                    "stack_id": stack_id,
                    "thread_id": 1,
                    "status": status,
                    "native": [{"module": m, "offset": o, "flags": f} for m, o, f in native],
                    "python": [{"code_id": c, "offset": o, "line": line, "flags": f} for c, o, line, f in python],
                }
                for stack_id, (native, python, status) in enumerate(stacks, start=1)
            ],
            schema=raw.stacks_schema(),
        ),
        "modules": pa.Table.from_pylist(
            [
                {"module_index": index, "path": path, "build_id": build_id, "load_bias": 0}
                for index, build_id, path in modules
            ],
            schema=raw.modules_schema(),
        ),
        "code": pa.Table.from_pylist(
            [{"code_id": c, "filename": f, "qualname": q, "first_line": line} for c, f, q, line in code],
            schema=raw.code_schema(),
        ),
    }


@QUICK
@given(stacks=RAW_STACKS, modules=MODULE_ROWS, code=CODE_ROWS, cut=st.integers(0, 20))
def test_identity_fast_paths_are_the_reference(stacks, modules, code, cut) -> None:
    tables = _raw_tables(stacks, modules, code)
    build_ids = pa.array([b for _i, b, _p in modules], pa.string())
    paths = pa.array([p for _i, _b, p in modules], pa.string())

    # Module key: `ModuleKey.of` against the Arrow encoder, on the remembered keys' path and (a
    # column longer than it remembers) the column operations'.
    keys = [str(ModuleKey.of(b, p)) for _i, b, p in modules]
    assert module_key_column(build_ids, paths).to_pylist() == keys
    long = pa.array(np.arange(5000) % max(len(keys), 1), pa.int64()) if keys else pa.array([], pa.int64())
    assert module_key_column(build_ids.take(long), paths.take(long)).to_pylist() == [keys[i] for i in long.to_pylist()]

    # Module and code hashes: the MD5 of the key's text, by hashlib, against the capture's path
    # (Python values) and the ingest's (Arrow columns).
    module_hashes = [identity.md5_low64_of(key) for key in keys]
    assert identity.module_hashes((b, p) for _i, b, p in modules).tolist() == module_hashes
    assert identity.md5_low64(module_key_column(build_ids, paths)).tolist() == module_hashes
    code_rows = [(f, q, line) for _c, f, q, line in code]
    code_hashes = [identity.md5_low64_of(identity.code_key_text(*row)) for row in code_rows]
    assert identity.code_hashes(code_rows).tolist() == code_hashes
    code_table = tables["code"]
    column = identity.code_hash_column(code_table["filename"], code_table["qualname"], code_table["first_line"])
    assert column.tolist() == code_hashes
    texts = keys + [f for f, _q, _l in code_rows]
    assert identity.md5_low64(pa.array(texts, pa.large_string())).tolist() == [identity.md5_low64_of(t) for t in texts]

    # Stack hash: the reference against the ingest's path and the capture's (a sliced chunk).
    reference = identity.raw_stack_hashes(tables["stacks"], tables["modules"], tables["code"])
    assert flatten_run(tables).hashes.tolist() == reference.tolist()  # stack ids 1.. are in order
    part = tables["stacks"].slice(min(cut, len(stacks)))
    captured = identity.hash_stack_lists(
        *(part.column(name).chunk(0) for name in ("status", "native", "python")),
        np.array([i for i, _b, _p in modules], np.int64),
        identity.module_hashes((b, p) for _i, b, p in modules),
        np.array([c for c, *_rest in code], np.uint64),
        identity.code_hashes(code_rows),
    )
    assert captured.tolist() == reference[min(cut, len(stacks)) :].tolist()


# ------------------------------------------------------------------------------------------ siting

GENERATED = ["/tmp/gen/inductor/", "/tmp/gen/triton/"]
PYTHON_FILES = [
    "/srv/app/train.py",
    "/srv/app/lib/model.py",
    "/venv/lib/python3.11/site-packages/mylib/nn.py",
    "/usr/lib/python3.11/threading.py",
    "<frozen runpy>",
    "<string>",
    "/tmp/gen/inductor/ab/cab.py",  # generated: under a `generated_code` prefix when drawn
    "/home/u/torchinductor_u/x/y.py",  # generated by the built-in rule
    "<eval_with_key>.3",
]
MODULES = ["/usr/lib/libc.so.6", "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so", "/tmp/gen/triton/k.so",
           "/venv/lib/python3.11/site-packages/tbpipe/_native.cpython-311-x86_64-linux-gnu.so"]  # fmt: skip
# Native functions: the program's, and the recording machinery's (never a site while another frame is).
NATIVE_FUNCTIONS = [None, "malloc", "at::matmul", "at::RecordFunction::runStartCallbacks()",
                    "at::Tensor c10::Dispatcher::callWithDispatchKeySlowPath<at::Tensor>(at::Tensor const&)"]  # fmt: skip
RULE_PREFIXES = ["/srv/app/", "/srv/app/lib/", "mylib/", "/usr/lib/python3.11/", "<string>", "<frozen", "/tmp/gen/"]
LINES = st.none() | st.integers(1, 60)
# Drawn often: the files whose frames the rule treats apart (code run from a string, generated code,
# a code object the run did not describe).
PYTHON_FILE = st.one_of(
    *[st.sampled_from(["/srv/app/train.py", "<string>", "/home/u/torchinductor_u/x/y.py", None])] * 3,
    st.sampled_from(PYTHON_FILES),
)
PYTHON_FRAME = st.builds(
    lambda file, function, line, first_line: {
        "kind": "python",
        "file": file,
        "function": function if file else None,  # a code object the run did not describe: neither
        "line": line,
        "first_line": first_line,
    },
    PYTHON_FILE,
    st.sampled_from(["f", "Model.forward", "<module>"]),
    LINES,
    LINES,
)
NATIVE_FRAME = st.builds(
    lambda module, function, line: {
        "kind": "native",
        "module": module,
        "function": function,
        "file": "lib.cc" if function else None,
        "line": line if function else None,
        "address": 4096,
    },
    st.sampled_from(MODULES),
    st.sampled_from(NATIVE_FUNCTIONS),
    LINES,
)
MARKER_FRAME = st.just({"kind": "marker", "function": "<native walk stopped: unknown pc>", "address": 1})
# Many stacks an example: a batch costs the same few statements whatever its size.
SITED_STACKS = st.lists(
    st.lists(st.one_of(*[PYTHON_FRAME] * 4, NATIVE_FRAME, MARKER_FRAME), max_size=10), min_size=10, max_size=40
)
RULES = st.lists(st.tuples(st.sampled_from(RULE_PREFIXES), st.booleans()), max_size=4, unique_by=lambda rule: rule[0])
FRAME_COLUMNS = {
    "kind": pa.string(),
    "function": pa.string(),
    "file": pa.string(),
    "line": pa.int32(),
    "first_line": pa.int32(),
    "module": pa.string(),
    "module_key": pa.string(),
    "address": pa.uint64(),
    "exact": pa.bool_(),
    "inlined": pa.bool_(),
    "reason": pa.string(),
}


RULE_SCHEMA = pa.schema([("prefix", pa.string()), ("is_user", pa.bool_())])
PORTABLE_SCHEMA = pa.schema([("file", pa.string()), ("portable_file", pa.string())])


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    """A database the examples fill and empty again."""
    connection = open_database(tmp_path_factory.mktemp("rules") / "rules.duckdb")
    try:
        yield connection
    finally:
        connection.close()


def _empty(con, *tables: str) -> None:
    for table in tables:
        con.execute(f"DELETE FROM {table}")


def _laid_out(stacks: list[list[dict]]) -> layout.Frames:
    """The stacks as the layout hands them over: a row per frame, each distinct frame once."""
    distinct: dict[tuple, int] = {}
    rows = {"stack_id": [], "depth": [], "slot": [], "chain_depth": [], "frame": []}
    for stack_id, frames in enumerate(stacks, start=1):
        for depth, frame in enumerate(frames):
            content = tuple(frame.get(name, False if name == "inlined" else None) for name in FRAME_COLUMNS)
            for name, value in zip(rows, (stack_id, depth, depth, 0, distinct.setdefault(content, len(distinct)))):
                rows[name].append(value)
    contents = list(distinct)
    frames = pa.table(
        {name: pa.array([c[i] for c in contents], kind) for i, (name, kind) in enumerate(FRAME_COLUMNS.items())}
    )
    counts = np.array([len(frames_) for frames_ in stacks], np.int64)
    return layout.Frames(
        rows=pa.table(
            {name: pa.array(values, pa.int64() if name == "stack_id" else pa.int32()) for name, values in rows.items()}
        ),
        frames=frames,
        per_stack_frames=counts,
        stack_order=np.arange(1, len(stacks) + 1, dtype=np.int64),
        symbolized_depth=np.full(len(stacks), -1, np.int32),
    )


def _python(file: str | None, line: int = 3) -> dict:
    return {"kind": "python", "file": file, "function": "f" if file else None, "line": line, "first_line": 1}


@settings(QUICK, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Code run from a string inside generated code, called by user code through a code object the run
# did not describe: the caller that decides is the next Python frame out whose file is known.
@example(
    stacks=[[_python("<string>"), _python(None), _python(PYTHON_FILES[0]), _python(PYTHON_FILES[7])]],
    rules=[],
    generated=[],
    portable={},
)
@given(
    stacks=SITED_STACKS,
    rules=RULES,
    generated=st.lists(st.sampled_from(GENERATED), unique=True),
    portable=st.dictionaries(st.sampled_from([f for f in PYTHON_FILES if f.startswith("/")]), TEXT.filter(bool)),
)
def test_siting_fast_path_is_the_reference(con, stacks, rules, generated, portable) -> None:
    laid_out = _laid_out(stacks)
    _empty(con, "frames", "stack_frame_rows", "stacks", "user_code", "generated_code", "source_files")
    db = IngestDb(con)
    db.insert(
        "INSERT INTO frames BY NAME SELECT *, frame_id AS frame_hash FROM {}",
        laid_out.frames.append_column("frame_id", pa.array(np.arange(laid_out.frames.num_rows), pa.int32())),
    )
    db.insert("INSERT INTO stack_frame_rows BY NAME SELECT * EXCLUDE (frame), frame AS frame_id FROM {}", laid_out.rows)
    stack_rows = pa.table({"stack_id": range(1, len(stacks) + 1), "frames": [len(frames) for frames in stacks]})
    db.insert("INSERT INTO stacks SELECT stack_id, stack_id, 0, 0, 0, frames, NULL, NULL, 'run' FROM {}", stack_rows)
    rule_rows = pa.table({"prefix": [r[0] for r in rules], "is_user": [r[1] for r in rules]}, RULE_SCHEMA)
    db.insert("INSERT INTO user_code SELECT prefix, is_user, 'user', now() FROM {}", rule_rows)
    db.insert(
        "INSERT INTO generated_code SELECT prefix, 'inductor', NULL FROM {}",
        pa.table({"prefix": pa.array(generated, pa.string())}),
    )
    names = pa.table({"file": list(portable), "portable_file": list(portable.values())}, PORTABLE_SCHEMA)
    db.insert("INSERT INTO source_files SELECT file, portable_file, NULL FROM {}", names)

    reference = reference_sites(con, 0)
    fast = sites_of_laid_out(db, laid_out, np.arange(1, len(stacks) + 1, dtype=np.int64), portable)
    assert fast.column_names == reference.column_names
    assert fast.to_pylist() == reference.to_pylist()


# ------------------------------------------------------------------------------------------ site counts

SITE_FILES = st.sampled_from([None, "a.py", "b.py", "B.py", "é.py", "ab.py"])
SITE_ROW = st.tuples(st.sampled_from([None, 1, 2]), SITE_FILES, st.none() | st.integers(1, 4), st.booleans())


@st.composite
def site_count_cases(draw) -> tuple[list, list]:
    """(`stack_sites` rows of stacks 1.., event counts): few runs, names and sites, so that a site
    often has several stacks in a run, their events often tied."""
    sites = draw(st.lists(SITE_ROW, min_size=2, max_size=12))
    stack = st.none() | st.integers(1, len(sites) + 2)  # the last two: stacks without a sited row
    row = st.tuples(st.integers(1, 2), st.integers(1, 2), stack, st.sampled_from([5, 5, 1, 10**6]))
    counts = draw(st.lists(row, min_size=8, max_size=40, unique_by=lambda count: count[:3]))
    return sites, counts


COUNT_COLUMNS = ("run_number", "name_id", "site_id", "events", "site_file", "site_line", "site_is_user")


def _count_tables(sites: list, counts: list) -> tuple[pa.Table, pa.Table]:
    """(event counts, the `stack_sites` rows of stacks 1.. by stack id); counts name stacks without
    a row too."""
    stack_sites = pa.table(
        {
            "stack_id": pa.array(range(1, len(sites) + 1), pa.int64()),
            **{
                name: pa.array([row[i] for row in sites], COUNTED_SITE_COLUMNS[name])
                for i, name in enumerate(("site_id", "site_file", "site_line", "site_is_user"))
            },
        }
    )
    columns = ("run_number", "name_id", "stack_id", "events")
    kinds = (pa.int32(), pa.int32(), pa.int64(), pa.int64())
    event_counts = pa.table(
        {name: pa.array([row[i] for row in counts], kind) for i, (name, kind) in enumerate(zip(columns, kinds))}
    )
    return event_counts, stack_sites


def _counted_by_reference(con, event_counts: pa.Table, stack_sites: pa.Table) -> list[tuple]:
    _empty(con, "stack_sites", "event_counts", "site_counts")
    db = IngestDb(con)
    db.insert("INSERT INTO stack_sites BY NAME SELECT * FROM {}", stack_sites)
    db.insert("INSERT INTO event_counts BY NAME SELECT * FROM {}", event_counts)
    count_sites(db, None)
    return sorted(query_rows(con, f"SELECT {', '.join(COUNT_COLUMNS)} FROM site_counts"), key=repr)


@settings(QUICK, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=site_count_cases())
def test_site_counts_fast_path_is_the_reference(con, case) -> None:
    event_counts, stack_sites = _count_tables(*case)
    fast = site_counts_of(event_counts, stack_sites)
    rows = [tuple(row[name] for name in COUNT_COLUMNS) for row in fast.to_pylist()]
    assert sorted(rows, key=repr) == _counted_by_reference(con, event_counts, stack_sites)
    # In the order of `site_counts_by_site`: by site, none last.
    site_ids = fast["site_id"].to_pylist()
    assert site_ids == sorted(site_ids, key=lambda site: (site is None, site or 0))


@settings(QUICK, max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=site_count_cases())
def test_site_counts_spark_path_is_the_reference(con, spark, case) -> None:
    event_counts, stack_sites = _count_tables(*case)
    counted = spark_site_counts(spark.createDataFrame(event_counts), spark.createDataFrame(stack_sites))
    rows = [tuple(row) for row in counted.select(*COUNT_COLUMNS).collect()]
    assert sorted(rows, key=repr) == _counted_by_reference(con, event_counts, stack_sites)


# ------------------------------------------------------------------------------------------ op attributes

INT64 = st.integers(-(2**63), 2**63 - 1)
OP_COLUMN_VALUES = {
    "op_id": INT64,
    "op_depth": INT32,
    "op_parent": INT64,
    "op_seq": INT64,
    "op_seq_thread": INT64,
    "op_bwd_seq": INT64,
    "op_fwd_thread": INT64,
    "op_bwd_node": TEXT,
    "op_scope": TEXT,
}
# Raw events as an events part holds them: an op's attributes in its columns, any other event's in `attrs`.
RAW_EVENT = st.fixed_dictionaries(
    {
        "attrs": st.none() | st.sampled_from(['{"grid":[1,1,1]}', "{}"]),
        **{column: st.none() | values for column, values in OP_COLUMN_VALUES.items()},
    }
)


def _raw_events(rows: list[dict]) -> pa.Table:
    schema = raw.events_schema()
    return pa.table({name: pa.array([row[name] for row in rows], schema.field(name).type) for name in rows[0]})


@QUICK
@given(rows=st.lists(RAW_EVENT, min_size=1, max_size=20))
def test_op_attributes_duckdb_path_is_the_reference(rows) -> None:
    events = _raw_events(rows)  # noqa: F841 - read by DuckDB by its name
    texts = duckdb.connect().execute(f"SELECT {event_attrs_sql('e', 'e.attrs')} FROM events e").fetchall()
    assert [text for (text,) in texts] == [event_attrs_text(row) for row in rows]
