"""Siting (sql/user_code.sql, sql/call_sites.sql) against hand-written expectations.

The macros run on a real database opened by `open_database` with inputs written here; the views
run on a database built by the real ingest from a run folder whose stacks are written by hand, so
every expected site and count below is read off the stacks, not off the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from support.synthetic import manifest_for, write_run

from tbpipe.pipeline.db import IngestOptions, ingest_runs, open_database
from tbpipe.pipeline.db.connection import query_rows
from tbpipe.schemas import raw

# (file, prefix, matches): the rule the macro documents, case by case.
PREFIX_CASES = [
    ("/srv/app/train.py", "/srv/app/", True),
    # An absolute prefix must start the path ...
    ("/tmp/srv/app/train.py", "/srv/app/", False),
    ("/venv/lib/python3.11/site-packages/srv/app/hooks.py", "/srv/app/", False),
    ("/srv/application/train.py", "/srv/app/", False),
    # ... and so must one starting with '<'.
    ("<frozen runpy>", "<frozen", True),
    ("/srv/<frozen runpy>", "<frozen", False),
    # A relative prefix matches at the start or after any '/', never inside a folder name.
    ("/venv/lib/python3.11/site-packages/mylib/nn.py", "mylib/", True),
    ("mylib/nn.py", "mylib/", True),
    ("/venv/lib/python3.11/site-packages/notmylib/nn.py", "mylib/", False),
    ("/venv/lib/python3.11/site-packages/mylib_extra/nn.py", "mylib/", False),
    ("/home/me/src/srv/app/x.py", "srv/app/", True),
]

# (file, is a library file by the built-in rule)
LIBRARY_CASES = [
    ("<frozen importlib._bootstrap>", True),
    ("<frozen runpy>", True),
    ("/usr/lib/python3.11/threading.py", True),
    ("/usr/lib64/python3.12/os.py", True),
    ("/opt/python/lib/python3.13t/asyncio/events.py", True),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", True),
    ("/usr/lib/python3/dist-packages/numpy/core/numeric.py", True),
    ("/venv/lib/python3.11/site-packages/tbpipe/capture/api.py", True),
    ("/home/me/checkout/tbpipe/pipeline/cli.py", True),
    ("/srv/app/train.py", False),
    ("/srv/app/frozen/model.py", False),
    ("/srv/app/site-packages-notes/model.py", False),
    ("/home/me/lib/python-tools/run.py", False),
    ("<string>", False),
]


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    connection = open_database(tmp_path_factory.mktemp("macros") / "macros.duckdb")
    try:
        yield connection
    finally:
        connection.close()


@pytest.mark.parametrize("file,prefix,matches", PREFIX_CASES)
def test_user_code_prefix_matches(con, file, prefix, matches) -> None:
    assert query_rows(con, "SELECT user_code_prefix_matches(?, ?)", [file, prefix]) == [(matches,)]


@pytest.mark.parametrize("file,library", LIBRARY_CASES)
def test_is_library_python_file(con, file, library) -> None:
    assert query_rows(con, "SELECT is_library_python_file(?)", [file]) == [(library,)]


# ------------------------------------------------------------------------------ sites of a hand-written run

TRAIN = "/srv/app/train.py"
HOOKS = "/venv/lib/python3.11/site-packages/srv/app/hooks.py"  # a library that merely contains /srv/app/
ELSEWHERE = "/tmp/srv/app/tool.py"  # user code by the built-in rule, outside /srv/app/
FROZEN = "<frozen importlib._bootstrap>"
THREADING = "/usr/lib/python3.11/threading.py"

CODE = [
    # code_id, filename, qualname
    (10, FROZEN, "_call_with_frames_removed"),
    (11, HOOKS, "hook"),
    (12, TRAIN, "main"),
    (13, ELSEWHERE, "tool"),
    (14, THREADING, "Thread.run"),
]

# stack_id -> Python frames (code_id, line), innermost first; no native frames were taken.
STACKS = {
    1: [(10, 241), (12, 7)],  # a frozen frame inside user code: the user line is the site
    2: [(11, 3), (12, 9)],  # a library frame inside user code
    3: [(13, 20), (12, 11)],  # innermost user frame outside the --user-code prefix
    4: [(14, 1010)],  # no user frame at all: the innermost frame is the site
    5: [],  # nothing to site
}

# (name, stack_id or None, events)
EVENTS = [("frozen", 1, 3), ("hooked", 2, 2), ("tool", 3, 4), ("thread", 4, 1), ("empty", 5, 1), ("nostack", None, 6)]


def _hand_written_run() -> dict[str, pa.Table]:
    python_type = raw.stacks_schema().field("python").type
    stacks = pa.table(
        {
            "stack_id": pa.array(list(STACKS), pa.uint64()),
            "thread_id": pa.array([1] * len(STACKS), pa.int64()),
            "status": pa.array([raw.STACK_NO_NATIVE] * len(STACKS), pa.uint32()),
            "native": pa.array([[] for _ in STACKS], raw.stacks_schema().field("native").type),
            "python": pa.array(
                [
                    [
                        {
                            "code_id": code,
                            "offset": 0,
                            "line": line,
                            "flags": raw.PYTHON_FRAME_ENTRY if i == len(frames) - 1 else 0,
                        }
                        for i, (code, line) in enumerate(frames)
                    ]
                    for frames in STACKS.values()
                ],
                python_type,
            ),
        }
    )
    code = pa.table(
        {
            "code_id": pa.array([c[0] for c in CODE], pa.uint64()),
            "filename": [c[1] for c in CODE],
            "qualname": [c[2] for c in CODE],
            "first_line": pa.array([1] * len(CODE), pa.int32()),
        }
    )
    names = [name for name, _stack, count in EVENTS for _ in range(count)]
    stack_ids = [stack for _name, stack, count in EVENTS for _ in range(count)]
    events = pa.table(
        {
            "ts": pa.array([1_767_225_600_000_000_000 + i for i in range(len(names))], pa.int64()).cast(
                pa.timestamp("ns", tz="UTC")
            ),
            "thread_id": pa.array([1] * len(names), pa.int64()),
            "kind": ["kernel_launch"] * len(names),
            "name": names,
            "stack_id": pa.array(stack_ids, pa.uint64()),
            "attrs": pa.nulls(len(names), pa.string()),
        }
    )
    return {"events": events, "stacks": stacks, "code": code, "modules": raw.modules_schema().empty_table()}


@pytest.fixture(scope="module")
def sited_db(tmp_path_factory, symbol_cache) -> Path:
    root = tmp_path_factory.mktemp("siting")
    write_run(root / "runs" / "hand", manifest_for("20260101T000000-1-hand"), _hand_written_run())
    db = root / "t.duckdb"
    summary = ingest_runs(
        [root / "runs"],
        IngestOptions(db_path=db, cache_dir=symbol_cache, progress=False, wait_s=30, user_code=["/srv/app/"]),
    )
    assert summary.ok and summary.ingested == 1
    return db


def _rows(db: Path, sql: str) -> list[tuple]:
    con = open_database(db, read_only=True)
    try:
        return query_rows(con, sql)
    finally:
        con.close()


def test_python_files_say_which_files_are_user_code(sited_db) -> None:
    files = {
        file: (is_user, rule) for file, is_user, rule in _rows(sited_db, "SELECT file, is_user, rule FROM python_files")
    }
    assert files == {
        TRAIN: (True, "/srv/app/"),
        ELSEWHERE: (True, None),
        HOOKS: (False, None),
        FROZEN: (False, None),
        THREADING: (False, None),
    }


def test_every_event_is_counted_at_its_site(sited_db) -> None:
    sites = _rows(sited_db, "SELECT name, site_function, site_file, site_line, events FROM call_sites")
    assert sorted(sites, key=lambda row: row[0]) == [
        ("empty", None, None, None, 1),
        ("frozen", "main", TRAIN, 7, 3),
        ("hooked", "main", TRAIN, 9, 2),
        ("nostack", None, None, None, 6),
        ("thread", "Thread.run", THREADING, 1010, 1),
        ("tool", "tool", ELSEWHERE, 20, 4),
    ]
    # Nothing is lost between the events and the view: every event of the run, stack or not.
    assert _rows(sited_db, "SELECT sum(events) FROM call_sites") == [(sum(count for _n, _s, count in EVENTS),)]
    assert _rows(sited_db, "SELECT sum(events) FROM kernel_launch_sites") == [(sum(c for _n, _s, c in EVENTS),)]


def test_stack_sites_mark_user_frames(sited_db) -> None:
    # Each stack reached through its events' name (one stack per name here).
    got = _rows(
        sited_db,
        "SELECT DISTINCT e.name, t.function, t.line, s.site_is_user, s.site_kind FROM events e "
        "JOIN stack_sites s USING (stack_id) LEFT JOIN sites t USING (site_id) ORDER BY e.name",
    )
    assert got == [
        ("empty", None, None, False, None),
        ("frozen", "main", 7, True, "python"),
        ("hooked", "main", 9, True, "python"),
        ("thread", "Thread.run", 1010, False, "python"),
        ("tool", "tool", 20, True, "python"),
    ]


# ------------------------------------------------------------------------------ threads without Python frames

LIBTORCH = "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"
OBSERVER = "/cache/torch-observer/torch-2.13/_tbpipe_torch_observer.cpython-311-x86_64-linux-gnu.so"
# A gloo worker thread's stack as tbpipe records an op on it, innermost first (function, module): the
# frames the rule passes over, then the first that is neither tbpipe's nor torch's recording machinery.
GLOO_SKIPPED = [
    ("tbpipe::observer::on_op_start(at::RecordFunction const&)", OBSERVER),
    ("at::RecordFunction::runStartCallbacks()", LIBTORCH),
    ("std::_Function_handler<void (), c10d::ProcessGroupGloo::AsyncWork::recordAsyncWorkProfilingInfo(char const*, "
     "std::optional<std::vector<at::Tensor> > const&)::{lambda()#1}>::_M_invoke(std::_Any_data const&)", LIBTORCH),
    ("_ZZN2at21wrapPropagateTLSStateISt8functionIFvvEEEEDaT_ENKUlDpOT_E_clIJEEEDaS7_", LIBTORCH),
]  # fmt: skip
GLOO_SITE = ("c10d::ProcessGroupGloo::AsyncWork::execute(c10::intrusive_ptr<c10d::ProcessGroupGloo::AsyncWork> const&)",
             LIBTORCH)  # fmt: skip
GLOO_OUTER = [("c10d::ProcessGroupGloo::runLoop(int)", LIBTORCH), ("start_thread", "/usr/lib/libc.so.6")]
# An op on an autograd engine thread: the dispatcher's profiling path is passed over too.
ENGINE = [
    ("at::RecordFunction::runStartCallbacks()", LIBTORCH),
    ("at::Tensor c10::Dispatcher::callWithDispatchKeySlowPath<at::Tensor, at::Tensor const&>(c10::TypedOperatorHandle"
     "<at::Tensor (at::Tensor const&)> const&, at::StepCallbacks&, c10::DispatchKeySet, c10::KernelFunction const&, "
     "at::Tensor const&)", LIBTORCH),
    ("at::_ops::neg::call(at::Tensor const&)", LIBTORCH),
    ("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)", LIBTORCH),
]  # fmt: skip


def _native_stacks(con, stacks: dict[int, list[tuple[str, str]]]) -> None:
    """The stacks' frames straight into the tables `stack_sites_from` reads (native frames, one row each)."""
    for table in ("frames", "stack_frame_rows", "stacks", "user_code", "generated_code", "source_files"):
        con.execute(f"DELETE FROM {table}")
    frame_ids: dict[tuple[str, str], int] = {}
    for stack_id, frames in stacks.items():
        for depth, (function, module) in enumerate(frames):
            if (function, module) not in frame_ids:
                frame_ids[(function, module)] = frame_id = len(frame_ids)
                con.execute(
                    "INSERT INTO frames VALUES (?, ?, 'native', ?, 'x.cc', 1, NULL, ?, 'k', 4096, false, false, NULL)",
                    [frame_id, frame_id, function, module],
                )
            con.execute(
                "INSERT INTO stack_frame_rows VALUES (?, ?, ?, 0, ?)",
                [stack_id, depth, depth, frame_ids[(function, module)]],
            )
        con.execute(
            "INSERT INTO stacks VALUES (?, ?, 0, ?, 0, ?, NULL, NULL, 'run')",
            [stack_id, stack_id, len(frames), len(frames)],
        )


def test_an_op_on_a_thread_without_python_frames_is_sited_past_the_recording_machinery(con) -> None:
    from tbpipe.pipeline.db.ingest.siting import reference_sites
    from tbpipe.pipeline.stacks.focus import is_recording_machinery

    assert all(is_recording_machinery(*frame) for frame in GLOO_SKIPPED)
    assert not any(is_recording_machinery(*frame) for frame in [GLOO_SITE, *GLOO_OUTER])
    only_machinery = GLOO_SKIPPED[1:2]
    _native_stacks(con, {1: [*GLOO_SKIPPED, GLOO_SITE, *GLOO_OUTER], 2: ENGINE, 3: only_machinery})
    sites = {row["stack_id"]: row for row in reference_sites(con, 0).to_pylist()}
    assert (sites[1]["site_function"], sites[1]["site_depth"]) == (GLOO_SITE[0], len(GLOO_SKIPPED))
    assert (sites[2]["site_function"], sites[2]["site_depth"]) == (ENGINE[2][0], 2)
    # A stack of nothing but the machinery is still sited (no event goes uncounted): at its innermost frame.
    assert (sites[3]["site_function"], sites[3]["site_depth"]) == (only_machinery[0][0], 0)
    assert not any(row["site_is_user"] for row in sites.values())
