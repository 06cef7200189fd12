"""Focus modes (pipeline/stacks/focus.py): the reference rule on real frames, the numpy path held to
it on random stacks, and what the views built on it show (`tbpipe show --frames`, exports)."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from conftest import TBPIPE
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.stacks import focus
from tbpipe.pipeline.stacks.focus import (
    INTERPRETER,
    MARKER,
    NATIVE,
    NATIVE_OWN,
    PAD,
    PY,
    PY_LAUNCHER,
    PY_OWN,
    FrameRules,
    StartUp,
    focus_frames,
    focus_matrix,
    focus_reference,
    modes_of_frames,
)

LIBPYTHON = "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"
TORCH_CPU = "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"


def native(function: str, module: str) -> dict:
    return {"kind": "native", "function": function, "file": None, "module": module}


def python(function: str, file: str) -> dict:
    return {"kind": "python", "function": function, "file": file, "module": None}


# A worker thread's aten::relu as the torch-ops source records it (innermost first), the way the
# database held it for a real capture: RecordFunction's callback, the op, the binding, CPython's call
# machinery, the user's two functions, CPython again, threading's bootstrap, thread start-up.
THREAD_STACK = [
    native("at::RecordFunction::runStartCallbacks()", TORCH_CPU),
    native("c10::Dispatcher::runRecordFunction(at::RecordFunction&, ...)", TORCH_CPU),
    native("at::_ops::relu::call(at::Tensor const&)", TORCH_CPU),
    native("torch::autograd::THPVariable_relu(_object*, _object*, _object*)", "/venv/torch/lib/libtorch_python.so"),
    native("cfunction_call", LIBPYTHON),
    native("_PyObject_MakeTpCall", LIBPYTHON),
    python("f", "/srv/app/t.py"),
    python("work", "/srv/app/t.py"),
    native("_PyEval_EvalFrame", LIBPYTHON),
    native("_PyEval_Vector", LIBPYTHON),
    python("Thread.run", "/usr/lib/python3.11/threading.py"),
    python("Thread._bootstrap_inner", "/usr/lib/python3.11/threading.py"),
    python("Thread._bootstrap", "/usr/lib/python3.11/threading.py"),
    native("_PyEval_Vector", LIBPYTHON),
    native("thread_run", LIBPYTHON),
    native("pythread_wrapper", LIBPYTHON),
    native("start_thread", "/lib/x86_64-linux-gnu/libc.so.6"),
    native("__GI___clone3", "/lib/x86_64-linux-gnu/libc.so.6"),
]


# A script's stack on CPython 3.10 (pyenv's build, innermost first), as the database held it for a
# real capture: 3.10 calls each Python function through C, so CPython's eval machinery (with
# `_PyEval_EvalFrame`, inlined from pycore_ceval.h) lies between every two Python frames.
LIBPYTHON_310 = "/opt/python/3.10.13/lib/libpython3.10.so.1.0"
CPYTHON_310 = "/tmp/python-build/Python-3.10.13/"  # where it was built
SCRIPT_STACK_310 = [
    python("softmaxes", "/srv/app/app.py"),
    *[
        frame
        for caller in ("main", "<module>")
        for frame in (
            {**native("_PyEval_EvalFrame", LIBPYTHON_310), "file": CPYTHON_310 + "Include/internal/pycore_ceval.h"},
            {**native("_PyEval_Vector", LIBPYTHON_310), "file": CPYTHON_310 + "Python/ceval.c"},
            python(caller, "/srv/app/app.py"),
        )
    ],
    *[native(f, LIBPYTHON_310) for f in ("_PyEval_EvalFrame", "_PyEval_Vector", "PyEval_EvalCode", "run_mod")],
    *[native(f, LIBPYTHON_310) for f in ("_PyRun_SimpleFileObject", "Py_RunMain", "Py_BytesMain")],
    native("__libc_start_main", "/lib/x86_64-linux-gnu/libc.so.6"),
    native("_start", "/opt/python/3.10.13/bin/python3.10"),
]


def names(frames) -> list[str]:
    return [f.text if isinstance(f, StartUp) else f["function"] for f in frames]


def test_program_mode_on_a_real_thread_stack() -> None:
    shown = focus_frames(THREAD_STACK, "program")
    assert names(shown) == [
        "at::_ops::relu::call(at::Tensor const&)",
        "torch::autograd::THPVariable_relu(_object*, _object*, _object*)",
        "f",
        "work",
        "[start-up] 10 frames of process and interpreter start-up",
    ]
    assert names(focus_frames(THREAD_STACK, "python")) == [
        "f", "work", "Thread.run", "Thread._bootstrap_inner", "Thread._bootstrap",
    ]  # fmt: skip
    assert len(focus_frames(THREAD_STACK, "native")) == len(THREAD_STACK) - 5
    assert focus_frames(THREAD_STACK, "all") == THREAD_STACK


def test_program_mode_folds_the_eval_frames_of_cpython_3_10() -> None:
    assert names(focus_frames(SCRIPT_STACK_310, "program")) == [
        "softmaxes",
        "main",
        "<module>",
        "[start-up] 9 frames of process and interpreter start-up",
    ]
    assert len(focus_frames(SCRIPT_STACK_310, "native")) == len(SCRIPT_STACK_310) - 3


def test_classes_of_frames() -> None:
    rules = FrameRules(("/work/src/tbpipe-checkout/capture/",))
    assert rules.classify("python", "Session.flush", "/work/src/tbpipe-checkout/capture/sessions.py", None) == PY_OWN
    assert rules.classify("python", "record", "/venv/site-packages/tbpipe/capture/x.py", None) == PY_OWN
    assert rules.classify("python", "_run_code", "<frozen runpy>", None) == PY_LAUNCHER
    assert rules.classify("python", "worker", "/usr/lib/python3.12/multiprocessing/process.py", None) == PY_LAUNCHER
    assert rules.classify("python", "main", "/usr/lib/python3.12/json/tool.py", None) == PY
    assert rules.classify("native", "_start", None, "/usr/bin/python3.11") == INTERPRETER
    assert rules.classify("native", "PyObject_Call", None, LIBPYTHON) == INTERPRETER
    assert rules.classify("native", "gather", None, "/x/tbpipe/_native.cpython-311-x86_64-linux-gnu.so") == NATIVE_OWN
    assert rules.classify("native", "cuptiX", None, "/usr/local/cuda/lib64/libcupti.so.12") == NATIVE_OWN
    assert rules.classify("native", "memcpy", None, "/lib/x86_64-linux-gnu/libc.so.6") == NATIVE
    assert rules.classify("native", None, None, "/usr/lib/libpythonic.so") == NATIVE
    assert rules.classify("marker", "<native walk stopped: no CFI>", None, None) == MARKER


def test_the_reference_rule_on_edge_cases() -> None:
    # No Python frame: nothing to fold above; tbpipe's own frames still hidden.
    assert focus_reference([NATIVE_OWN, NATIVE, INTERPRETER, NATIVE], "program") == focus.Focus([1, 2, 3], 0)
    # Only launcher frames: the innermost Python frame is the entry point.
    assert focus_reference([NATIVE, PY_LAUNCHER, PY_LAUNCHER, NATIVE], "program") == focus.Focus([0, 1], 2)
    # An interpreter run between two native frames stays; one touching a Python frame folds.
    assert focus_reference([INTERPRETER, NATIVE, INTERPRETER, NATIVE, INTERPRETER, PY], "program").kept == [
        0,
        1,
        2,
        3,
        5,
    ]
    # tbpipe's frames do not separate an interpreter run from its Python frame.
    assert focus_reference([NATIVE, INTERPRETER, PY_OWN, PY], "program").kept == [0, 3]
    assert focus_reference([], "program") == focus.Focus([], 0)
    with pytest.raises(ValueError, match="frames must be one of program, python, native, all"):
        focus_reference([PY], "mine")


# Real stacks are runs of one class (a library's frames, the interpreter's): drawn as runs of 1-4.
_runs = st.lists(st.tuples(st.sampled_from(focus.CLASSES), st.integers(1, 4)), max_size=12)
_stacks = st.lists(_runs.map(lambda runs: [c for c, n in runs for _ in range(n)]), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(stacks=_stacks, mode=st.sampled_from(focus.MODES))
def test_the_numpy_rule_is_the_reference_on_random_stacks(stacks: list[list[int]], mode: str) -> None:
    width = max(map(len, stacks))
    matrix = np.full((len(stacks), width), PAD)
    for i, stack in enumerate(stacks):
        matrix[i, : len(stack)] = stack
    rows = focus_matrix(matrix, mode)
    for i, stack in enumerate(stacks):
        expected = focus_reference(stack, mode)
        got = rows.columns[i, : rows.lengths[i]].tolist()
        assert (got, int(rows.start_up[i])) == (expected.kept, expected.start_up)
        assert (rows.columns[i, rows.lengths[i] :] == -1).all()


def test_modes_of_frames_place_the_start_up_row_after_the_entry_point() -> None:
    rows = modes_of_frames(THREAD_STACK)
    at = next(i for i, (frame, _) in enumerate(rows) if isinstance(frame, StartUp))
    assert rows[at - 1][0]["function"] == "work" and rows[at][1] == ("program",)
    for mode in focus.MODES:
        shown = [frame for frame, modes in rows if mode in modes]
        assert shown == focus_frames(THREAD_STACK, mode)


# ------------------------------------------------------------------------------------------ CLI views


@pytest.fixture(scope="module")
def nights(tmp_path_factory, symbol_cache):
    from support.serve import environment, nights_database

    env = environment(symbol_cache)
    return nights_database(tmp_path_factory.getbasetemp(), env), env


def tbpipe(env: dict, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*TBPIPE, *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done


def test_show_frames_modes(nights) -> None:
    db, env = nights
    (stack_id,) = tbpipe(env, "query", "--db", str(db), "-f", "csv", "SELECT min(stack_id) FROM stacks").stdout.split()[
        1:
    ]
    program = tbpipe(env, "show", "--db", str(db), "--stack", stack_id).stdout.splitlines()
    assert program[0].endswith("innermost first (program frames shown)")
    assert re.fullmatch(r"\[start-up\] \d+ frames of process and interpreter start-up", program[-1])
    assert all("/app.py:" in line for line in program[1:-1])  # the program's own frames, nothing else
    everything = tbpipe(env, "show", "--db", str(db), "--stack", stack_id, "--frames", "all").stdout.splitlines()
    folded = int(program[-1].split()[1])
    # Every frame is shown, folded into the start-up row, or CPython's call machinery folded into the
    # Python frame beside it: 3.10 calls each Python function through C (_PyEval_Vector and the
    # inlined _PyEval_EvalFrame between two Python frames); from 3.11 on, one eval loop runs both.
    inner = everything[1 : len(everything) - folded]
    assert [line for line in inner if "/app.py:" in line] == program[1:-1]
    modules = tbpipe(env, "query", "--db", str(db), "-f", "csv", "SELECT module FROM stack_frames WHERE stack_id = "
                     f"{stack_id} AND kind = 'native' AND depth < {len(inner)} ORDER BY depth").stdout.split()[1:]  # fmt: skip
    assert len(modules) == len(inner) - len(program[1:-1])
    assert all(re.fullmatch(r"(lib)?python3\.\d+(\.so\.1\.0)?", m.strip('"').rsplit("/", 1)[-1]) for m in modules)
    assert any(":Py_BytesMain" in line for line in everything)
    native = tbpipe(env, "show", "--db", str(db), "--stack", stack_id, "--frames", "native").stdout
    assert "/app.py:" not in native and ":Py_BytesMain" in native
    wrong = subprocess.run([*TBPIPE, "show", "--db", str(db), "--stack", stack_id, "--frames", "mine"],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert wrong.returncode == 2 and "--frames is one of program, python, native, all, not 'mine'" in wrong.stderr


def test_exports_are_focused_and_keep_their_counts(nights) -> None:
    db, env = nights
    run = ("--db", str(db), "--run", "latest", "-f", "collapsed", "-o", "-")
    counts = {}
    for mode in focus.MODES:
        lines = tbpipe(env, "export", *run, "--frames", mode).stdout.splitlines()
        counts[mode] = sum(int(line.rsplit(" ", 1)[1]) for line in lines)
        roots = {line.split(";", 1)[0] for line in lines}
        if mode == "program":
            assert roots == {"[start-up]"} and all(";<module> (" in line for line in lines)
        if mode == "python":
            assert all(root.startswith("<module> (") for root in roots)
        if mode == "all":
            assert all(root.startswith("_start") for root in roots)
    assert len(set(counts.values())) == 1 and counts["all"] == 16  # the newest night's 16 events in every mode
