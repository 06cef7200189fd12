"""Which run folders the ingest finds and which manifests it refuses (the run is then quarantined with
the reason): field by field, each garbage value named with the file, the edges of each rule exact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tbpipe.pipeline import rawrun
from tbpipe.pipeline.errors import UsageError
from tbpipe.schemas import raw
from tbpipe.schemas.format import TABLE_SINCE
from tbpipe.schemas.raw import (
    FORMAT_NAME,
    MANIFEST_FILE,
    OLDEST_READABLE_RAW_SCHEMA_VERSION,
    RAW_SCHEMA_VERSION,
    SCHEMA_KEY,
    VERSION_KEY,
    table_schema,
)

GOOD = {
    "format": FORMAT_NAME,
    "schema_version": RAW_SCHEMA_VERSION,
    "run_id": "run-1",
    "complete": True,
    "started_at": "2026-12-06T04:00:00Z",
}


def manifest_at(tmp_path: Path, manifest: object, name: str = "run") -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    return run_dir


def test_a_good_manifest_is_read_as_written(tmp_path) -> None:
    full = dict(
        GOOD,
        ended_at="2026-12-06T05:00:00+02:00",
        pid=7,
        argv=["train.py"],
        labels={"k": "v"},
        threads={"1234567890123456789": "main"},
        counters={"events": 3},
        files={"events": ["events-000001.parquet"]},
        run_id="A" + "x" * 199,
    )
    assert rawrun.read_manifest(manifest_at(tmp_path, full)) == full


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"format": "other"}, f"not a {FORMAT_NAME} manifest"),
        ({"schema_version": RAW_SCHEMA_VERSION + 1}, f"raw schema version {RAW_SCHEMA_VERSION + 1}, this tbpipe reads"),
        ({"run_id": None}, "manifest has no run_id"),
        ({"run_id": "A" + "x" * 200}, "malformed run_id"),
        ({"run_id": ".hidden"}, "malformed run_id"),
        ({"run_id": "a/b"}, "malformed run_id"),
        ({"complete": None}, "manifest has no 'complete'"),
        ({"complete": 1}, "manifest field 'complete' is int, not bool"),
        ({"started_at": None}, "manifest has no 'started_at'"),
        ({"started_at": "yesterday"}, "manifest field 'started_at' is not an ISO-8601 time: 'yesterday'"),
        ({"started_at": "2026-12-06T04:00:00"}, "manifest field 'started_at' has no time zone"),
        ({"ended_at": "2026-12-06T04:00:00"}, "manifest field 'ended_at' has no time zone"),
        ({"host": 3}, "manifest field 'host' is int, not str"),
        ({"pid": True}, "manifest field 'pid' is True, not int"),
        ({"pid": "7"}, "manifest field 'pid' is str, not int"),
        ({"argv": ["a", 1]}, "manifest field 'argv' holds something other than strings"),
        ({"sys_path": "/srv"}, "manifest field 'sys_path' is str, not list"),
        ({"capture": []}, "manifest field 'capture' is list, not dict"),
        ({"labels": {"k": 1}}, "manifest field 'labels' has a bad entry 'k': 1"),
        ({"generated_code": {"inductor": None}}, "manifest field 'generated_code' has a bad entry"),
        ({"threads": {"main": "x"}}, "manifest field 'threads' has a bad entry 'main'"),
        ({"threads": {"1" * 20: "x"}}, "manifest field 'threads' has a bad entry"),
        ({"counters": {"events": False}}, "manifest counter 'events' is False, not a number"),
        ({"counters": {"events": 1.5}}, "manifest counter 'events' is 1.5, not a number"),
        ({"files": {"events": "events-000001.parquet"}}, "manifest field 'files' lists 'events' as str, not a list"),
        ({"files": {"events": ["stacks-000001.parquet"]}}, "manifest lists a file 'stacks-000001.parquet' that is not"),
        ({"files": {"events": ["events-00001.parquet"]}}, "that is not a events part"),
    ],
)
def test_a_garbled_field_damages_the_run_naming_the_manifest(tmp_path, change, problem) -> None:
    run_dir = manifest_at(tmp_path, dict(GOOD, **change))
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(run_dir)
    assert str(raised.value).startswith(f"{run_dir / MANIFEST_FILE}: ")
    assert problem in str(raised.value)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"files": ["events-000001.parquet"]}, "manifest field 'files' is list, not dict"),
        ({"labels": ["k"]}, "manifest field 'labels' is list, not dict"),
        ({"files": {"events": [3]}}, "manifest lists a file 3 that is not a events part"),
        (
            {"schema_version": 0},
            f"raw schema version 0, this tbpipe reads {OLDEST_READABLE_RAW_SCHEMA_VERSION} to {RAW_SCHEMA_VERSION}",
        ),
    ],
)
def test_each_problem_is_said_whole_after_the_manifests_path(tmp_path, change, problem) -> None:
    run_dir = manifest_at(tmp_path, dict(GOOD, **change))
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(run_dir)
    assert str(raised.value) == f"{run_dir / MANIFEST_FILE}: {problem}"


OPTIONAL_FIELDS = {
    **dict.fromkeys(
        ["parent_run_id", "host", "cwd", "python_version", "python_implementation", "torch_version"]
        + ["cuda_version", "tbpipe_version"],
        ("text", 1, "int, not str"),
    ),
    "pid": (7, "7", "str, not int"),
    **dict.fromkeys(["argv", "sources", "errors", "sys_path"], (["a"], "a", "str, not list")),
    **dict.fromkeys(["capture", "counters"], ({}, [], "list, not dict")),
}


@pytest.mark.parametrize("field", sorted(OPTIONAL_FIELDS))
def test_each_optional_field_may_be_left_out_or_null_but_not_of_another_type(tmp_path, field) -> None:
    good, bad, problem = OPTIONAL_FIELDS[field]
    for index, value in enumerate((good, None)):
        rawrun.read_manifest(manifest_at(tmp_path, dict(GOOD, **{field: value}), f"ok{index}"))
    run_dir = manifest_at(tmp_path, dict(GOOD, **{field: bad}), "bad")
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(run_dir)
    assert str(raised.value) == f"{run_dir / MANIFEST_FILE}: manifest field {field!r} is {problem}"


def test_garbage_is_quoted_up_to_a_limit(tmp_path) -> None:
    long = "x" * 400
    cases = [
        ({"started_at": long}, f"manifest field 'started_at' is not an ISO-8601 time: {'x' * 60!r}"),
        ({"labels": {long: 1}}, f"manifest field 'labels' has a bad entry {long!r}"[:300]),
        ({"files": {"events": [long]}}, f"manifest lists a file {long!r}"[:300]),
    ]
    for index, (change, problem) in enumerate(cases):
        run_dir = manifest_at(tmp_path, dict(GOOD, **change), f"run{index}")
        with pytest.raises(rawrun.DamagedRunError) as raised:
            rawrun.read_manifest(run_dir)
        said = str(raised.value).removeprefix(f"{run_dir / MANIFEST_FILE}: ")
        assert said.startswith(problem) and len(said) <= 300
        if index == 0:
            assert said == problem
    naive = manifest_at(tmp_path, dict(GOOD, started_at="2026-12-06T04:00:00.000000"), "naive")
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(naive)
    assert str(raised.value).endswith("manifest field 'started_at' has no time zone: '2026-12-06T04:00:00.000000'")


def test_a_manifest_that_is_not_a_json_object_damages_the_run(tmp_path) -> None:
    with pytest.raises(rawrun.DamagedRunError, match="not a .* manifest"):
        rawrun.read_manifest(manifest_at(tmp_path, [GOOD]))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MANIFEST_FILE).write_text("{")
    with pytest.raises(rawrun.DamagedRunError, match="manifest is not JSON"):
        rawrun.read_manifest(broken)


def test_a_missing_manifest_names_the_first_four_parts_left(tmp_path) -> None:
    for sequence in range(1, 6):
        (tmp_path / f"events-{sequence:06d}.parquet").write_bytes(b"")
    (tmp_path / "events-1.parquet").write_bytes(b"")
    with pytest.raises(rawrun.MissingManifestError) as raised:
        rawrun.read_manifest(tmp_path)
    assert f"{tmp_path / MANIFEST_FILE}: manifest is missing, 5 Parquet parts are there (" in str(raised.value)
    assert "events-000004.parquet, ...); `tbpipe ingest --recover-manifests`" in str(raised.value)
    parts = ", ".join(f"events-{sequence:06d}.parquet" for sequence in range(1, 5))
    assert str(raised.value) == (
        f"{tmp_path / MANIFEST_FILE}: manifest is missing, 5 Parquet parts are there ({parts}, ...); "
        "`tbpipe ingest --recover-manifests` loads what they hold as an incomplete run without labels"
    )
    (tmp_path / "events-000005.parquet").unlink()  # four: all named, no "..."
    with pytest.raises(rawrun.MissingManifestError, match=rf"4 Parquet parts are there \({parts}\); "):
        rawrun.read_manifest(tmp_path)
    for sequence in range(2, 5):
        (tmp_path / f"events-{sequence:06d}.parquet").unlink()
    with pytest.raises(rawrun.MissingManifestError, match=r"1 Parquet parts are there \(events-000001.parquet\)"):
        rawrun.read_manifest(tmp_path)


# ------------------------------------------------------------------------------------------ finding runs


def test_run_folders_are_those_with_a_manifest_or_a_tables_parts_and_nothing_below_them(tmp_path) -> None:
    with_manifest = manifest_at(tmp_path, GOOD, "a")
    (with_manifest / "inner").mkdir()
    (with_manifest / "inner" / MANIFEST_FILE).write_text("{}")  # a run folder holds no other runs
    parts_only = tmp_path / "deep" / "b"
    parts_only.mkdir(parents=True)
    (parts_only / "stacks-000001.parquet").write_bytes(b"")
    other = tmp_path / "c"
    other.mkdir()
    (other / "notes-000001.parquet").write_bytes(b"")  # not a run's table
    (other / "events-1.parquet").write_bytes(b"")
    os.symlink(tmp_path, tmp_path / "deep" / "loop")  # a link back up the tree is walked once
    assert rawrun.find_run_dirs([tmp_path]) == [with_manifest, parts_only]


def test_a_symlinked_run_folder_is_found_by_its_link(tmp_path) -> None:
    run = manifest_at(tmp_path, GOOD, "elsewhere")
    (tmp_path / "runs").mkdir()
    os.symlink(run, tmp_path / "runs" / "linked")
    assert rawrun.find_run_dirs([tmp_path / "runs"]) == [tmp_path / "runs" / "linked"]


def test_a_root_that_is_missing_or_a_file_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(UsageError, match=f"no such folder: {tmp_path / 'nope'}"):
        rawrun.find_run_dirs([tmp_path / "nope"])
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="is a file: give the folder that holds run folders"):
        rawrun.find_run_dirs([tmp_path / "f"])


# ------------------------------------------------------------------------------------------ parts


def part(
    tmp_path: Path, table: str, version: int, metadata: dict | None = None, schema: pa.Schema | None = None
) -> Path:
    schema = schema or table_schema(table, version)
    written = metadata if metadata is not None else {SCHEMA_KEY: table.encode(), VERSION_KEY: str(version).encode()}
    path = tmp_path / f"{table}-000001.parquet"
    pq.write_table(schema.with_metadata(written).empty_table(), path)
    return path


def test_a_part_of_every_readable_version_of_its_table_is_checked_by_its_footer(tmp_path) -> None:
    for version in range(max(OLDEST_READABLE_RAW_SCHEMA_VERSION, TABLE_SINCE["code_origins"]), RAW_SCHEMA_VERSION + 1):
        assert rawrun.check_part(part(tmp_path, "code_origins", version), "code_origins") == 0
    # Each part against its own version's columns: events and stacks gained columns since.
    for table in ("events", "stacks"):
        for version in range(OLDEST_READABLE_RAW_SCHEMA_VERSION, RAW_SCHEMA_VERSION + 1):
            assert rawrun.check_part(part(tmp_path, table, version), table) == 0


@pytest.mark.parametrize(
    ("table", "version", "metadata", "says"),
    [
        ("events", 1, {SCHEMA_KEY: b"stacks", VERSION_KEY: b"1"}, "file says 'stacks' version '1'"),
        ("events", 1, {SCHEMA_KEY: b"events", VERSION_KEY: str(RAW_SCHEMA_VERSION + 1).encode()}, "version"),
        ("events", 1, {SCHEMA_KEY: b"events", VERSION_KEY: b"x"}, "file says 'events' version 'x'"),
        ("events", 1, {SCHEMA_KEY: b"events"}, "file says 'events' version nothing"),
        ("code_origins", 2, {SCHEMA_KEY: b"code_origins", VERSION_KEY: b"1"}, "file says 'code_origins' version '1'"),
    ],
)
def test_a_part_of_another_table_or_version_is_damage_naming_what_it_says(
    tmp_path, table, version, metadata, says
) -> None:
    path = part(tmp_path, table, version, metadata)
    since = max(OLDEST_READABLE_RAW_SCHEMA_VERSION, TABLE_SINCE[table])
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.check_part(path, table)
    assert str(raised.value).startswith(
        f"{path}: expected table {table!r} schema version {since} to {RAW_SCHEMA_VERSION}, "
    )
    assert says in str(raised.value)


def test_a_part_whose_columns_differ_from_its_versions_schema_is_damage(tmp_path) -> None:
    expected = table_schema("events", RAW_SCHEMA_VERSION)
    first = expected.field(0)
    missing = pa.schema(list(expected)[1:])
    retyped = expected.set(0, first.with_type(pa.large_string() if first.type != pa.large_string() else pa.int8()))
    extra = expected.append(pa.field("more", pa.int8()))
    for schema, problem in (
        (missing, f"no column {first.name!r}"),
        (retyped, f"column {first.name!r} is {retyped.field(0).type}, expected {first.type}"),
        (extra, "unexpected columns ['more']"),
    ):
        path = part(tmp_path, "events", RAW_SCHEMA_VERSION, schema=schema)
        with pytest.raises(rawrun.DamagedRunError, match="columns do not match the 'events' schema: ") as raised:
            rawrun.check_part(path, "events")
        assert str(raised.value).endswith(problem)
        assert str(raised.value).startswith(f"{path}: ")


# ------------------------------------------------------------------------------------------ references


def frames_table(native_stacks, python_stacks, events=None, modules=(0, 1), code=(2**63 + 1,)) -> dict:
    """A run's tables as far as its references go: native frames (module, flags), Python frames (code id)."""
    native = [[{"pc": 1, "module": m, "offset": 0, "flags": f} for m, f in s] for s in native_stacks]
    python = [[{"code_id": c, "offset": 0, "line": 1, "flags": 0} for c in s] for s in python_stacks]
    ids = list(range(1, len(native_stacks) + 1))
    stacks = pa.table(
        {
            "stack_id": pa.array(ids, pa.uint64()),
            "native": pa.array(native, pa.list_(raw.NATIVE_FRAME)),
            "python": pa.array(python, pa.list_(raw.PYTHON_FRAME)),
        }
    )
    tables = {
        "stacks": stacks,
        "modules": pa.table({"module_index": pa.array(modules, pa.int32())}),
        "code": pa.table({"code_id": pa.array(code, pa.uint64())}),
    }
    if events is not None:
        tables["events"] = pa.table({"stack_id": pa.array(events, pa.uint64())})
    return tables


def test_a_run_whose_rows_refer_to_nothing_it_holds_says_how_many_of_each() -> None:
    marker = raw.NATIVE_FRAME_MARKER
    tables = frames_table(
        [[(0, 0), (5, 0), (5, 0), (-1, marker)], [(1, 0), (7, marker | 1), (-1, 0)]],
        [[2**63 + 1, 2**63 + 2], [2**63 + 2, 2**63 + 3, 2**63 + 1]],
        events=[1, 2, None, 3, 9, 9],
    )
    assert rawrun.reference_problems(tables) == [
        "3 events refer to stacks the run does not hold",
        "3 native frames refer to modules the run does not describe",
        "3 Python frames refer to code objects the run does not describe",
    ]


def test_a_run_that_holds_all_it_refers_to_has_no_problem_whatever_its_markers() -> None:
    tables = frames_table([[(0, 0), (-1, raw.NATIVE_FRAME_MARKER)], [(1, 0)]], [[2**63 + 1], []], events=[1, 2, None])
    assert rawrun.reference_problems(tables) == []
    assert rawrun.reference_problems(frames_table([[], []], [[], []], events=[None])) == []
    # Events are checked only when loaded; stacks read without their native frames are not checked there.
    unloaded = frames_table([[(9, 0)]], [[2**63 + 1]])
    assert rawrun.reference_problems(unloaded) == ["1 native frames refer to modules the run does not describe"]
    unloaded["stacks"] = unloaded["stacks"].drop(["native"])
    assert rawrun.reference_problems(unloaded) == []


def test_events_none_of_whose_stacks_the_run_holds_are_all_counted() -> None:
    tables = frames_table([[(0, 0)]], [[]], events=[7, 7, None])
    assert rawrun.reference_problems(tables) == ["2 events refer to stacks the run does not hold"]


def test_only_the_marker_flag_excuses_a_frame() -> None:
    flags = [raw.NATIVE_FRAME_EVAL_LOOP, raw.NATIVE_FRAME_BY_FRAME_POINTER, raw.NATIVE_FRAME_EXACT_PC]
    tables = frames_table([[(-1, f) for f in flags]], [[]])
    assert rawrun.reference_problems(tables) == ["3 native frames refer to modules the run does not describe"]
    # No flag excuses a Python frame.
    python = [[{"code_id": 5, "offset": 0, "line": 1, "flags": f} for f in (0, 1, 2, 3, 128)]]
    tables["stacks"] = tables["stacks"].set_column(2, "python", pa.array(python, pa.list_(raw.PYTHON_FRAME)))
    assert rawrun.reference_problems(tables)[-1] == "5 Python frames refer to code objects the run does not describe"


def test_an_older_part_gets_the_columns_added_since_as_nulls() -> None:
    older = table_schema("stacks", 3)
    current = table_schema("stacks", RAW_SCHEMA_VERSION)
    assert older.names != current.names
    part = older.empty_table()
    grown = rawrun._in_current_columns(pa.concat_tables([part]), "stacks")
    assert grown.schema.names == current.names
    assert [grown.schema.field(n).type for n in current.names] == [current.field(n).type for n in current.names]
    now = current.empty_table()
    assert rawrun._in_current_columns(now, "stacks").schema.names == current.names


def test_a_manifest_that_cannot_be_read_or_parsed_or_has_a_bad_run_id_is_named(tmp_path) -> None:
    folder = tmp_path / "dir"
    (folder / MANIFEST_FILE).mkdir(parents=True)  # there, but not a file
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(folder)
    assert str(raised.value) == f"{folder / MANIFEST_FILE}: manifest unreadable: Is a directory"
    broken = manifest_at(tmp_path, GOOD, "broken")
    (broken / MANIFEST_FILE).write_text("{")
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(broken)
    assert str(raised.value).startswith(f"{broken / MANIFEST_FILE}: manifest is not JSON: ")
    for name, run_id, said in (
        ("none", None, "manifest has no run_id"),
        ("long", "!" * 100, f"manifest has a malformed run_id {'!' * 80!r}"),
    ):
        run_dir = manifest_at(tmp_path, {**GOOD, "run_id": run_id}, name)
        with pytest.raises(rawrun.DamagedRunError) as raised:
            rawrun.read_manifest(run_dir)
        assert str(raised.value) == f"{run_dir / MANIFEST_FILE}: {said}"


def test_a_counters_garbage_is_cut_at_three_hundred_characters(tmp_path) -> None:
    run_dir = manifest_at(tmp_path, {**GOOD, "counters": {"events": "z" * 400}})
    with pytest.raises(rawrun.DamagedRunError) as raised:
        rawrun.read_manifest(run_dir)
    problem = f"manifest counter 'events' is {'z' * 400!r}, not a number"[:300]
    assert str(raised.value) == f"{run_dir / MANIFEST_FILE}: {problem}"
