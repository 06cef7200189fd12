"""The export's rules over captured runs: events without a stack counted under one frame in collapsed
stacks and in pprof, one pprof sample per stack with its labels, the profile's comment. The writers'
rules are stated on hand-made inputs in tests/test_pprof_rules.py; these check that a real export of
captured and ingested runs puts them together (too slow for every mutant of `make mutate`)."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from tbpipe import capture
from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.export import ExportFilter, ExportFormat, export
from tbpipe.pipeline.export.profile_proto import message


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, symbol_cache) -> tuple[Path, str, str]:
    """A run whose events have no stack (nothing walked) and one whose events have one."""
    root = tmp_path_factory.mktemp("pprof_rules")
    with capture.session(root / "runs", python=False, native=False, labels={"commit": "bare"}):
        for _ in range(3):
            capture.record("kernel_launch", "k")
    with capture.session(root / "runs", labels={"commit": "walked"}):
        for _ in range(2):
            capture.record("kernel_launch", "k")
    path = root / "tbpipe.duckdb"
    assert ingest_runs([root / "runs"], IngestOptions(db_path=path, cache_dir=symbol_cache, progress=False)).ok
    with open_database(path, read_only=True) as con:
        ids = dict(query_rows(con, "SELECT labels['commit'], run_id FROM runs"))
    return path, ids["bare"], ids["walked"]


def exported(db: Path, fmt: str, out: Path, *runs: str) -> int:
    with open_database(db, read_only=True) as con:
        return export(con, ExportFilter(runs=runs), ExportFormat(fmt), out).events


def test_events_without_a_stack_count_under_one_frame(two_runs, tmp_path: Path) -> None:
    db, bare, walked = two_runs
    out = tmp_path / "both.txt"
    assert exported(db, "collapsed", out, bare, walked) == 5
    lines = out.read_text().splitlines()
    assert lines[-1] == "[no stack] 3" and len(lines) == 2 and lines[0].endswith(" 2")
    assert "test_events_without_a_stack_count_under_one_frame" not in lines[0]  # recorded by the fixture
    assert exported(db, "collapsed", out, bare) == 3 and out.read_text() == "[no stack] 3\n"
    assert exported(db, "collapsed", out, walked) == 2 and "[no stack]" not in out.read_text()


def read_profile(path: Path):
    profile = message("Profile")()
    profile.ParseFromString(gzip.decompress(path.read_bytes()))
    return profile, list(profile.string_table)


def test_a_pprof_sample_per_stack_with_its_labels(two_runs, tmp_path: Path) -> None:
    db, bare, walked = two_runs
    out = tmp_path / "both.pb.gz"
    assert exported(db, "pprof", out, bare, walked) == 5
    assert out.read_bytes()[4:8] == bytes(4)  # no time in the gzip header: equal exports are equal files
    profile, strings = read_profile(out)
    assert [(strings[t.type], strings[t.unit]) for t in profile.sample_type] == [("events", "count")]
    assert (strings[profile.period_type.type], profile.period, strings[profile.default_sample_type]) == (
        "events",
        1,
        "events",
    )
    locations = {location.id: location for location in profile.location}
    functions = {function.id: strings[function.name] for function in profile.function}
    samples = {}
    for sample in profile.sample:
        labels = {strings[label.key]: strings[label.str] for label in sample.label}
        leaf = [functions[line.function_id] for line in locations[sample.location_id[0]].line]
        samples[labels["run"]] = (sample.value[0], leaf, labels, len(sample.location_id))
    assert samples[bare][:2] == (3, ["[no stack]"]) and samples[bare][3] == 1
    assert samples[walked][0] == 2 and samples[walked][3] > 1
    for _, _, labels, _ in samples.values():
        assert (labels["kind"], labels["name"]) == ("kernel_launch", "k")
        assert re.fullmatch(r"MainThread \(\d+\)", labels["thread"]), labels
    (comment,) = [strings[c] for c in read_profile(out)[0].comment]
    assert comment == f"tbpipe export of runs {bare}, {walked}"
    exported(db, "pprof", out, bare)
    alone, strings = read_profile(out)
    assert [strings[c] for c in alone.comment] == [f"tbpipe export of run {bare}"]
