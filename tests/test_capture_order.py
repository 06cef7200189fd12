"""Frame order and interleaving of combined tracebacks, checked against the interpreter itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import traceback

import pytest

from tbpipe import _native, _native_test, capture
from tbpipe.pipeline import symbolize


def python_frames(frames: list[dict]) -> list[tuple[str, int, str]]:
    return [(f["filename"], f["line"], f["name"].rsplit(".", 1)[-1]) for f in frames if f["kind"] == "python"]


def expected_from(summary: traceback.StackSummary) -> list[tuple[str, int, str]]:
    return [(f.filename, f.lineno, f.name) for f in reversed(summary)]


def index_of(frames: list[dict], predicate) -> int:
    for i, frame in enumerate(frames):
        if predicate(frame):
            return i
    raise AssertionError(f"no matching frame in:\n{_show(frames)}")


def _show(frames: list[dict]) -> str:
    return "\n".join(f"{f['kind']:7s} {f['filename']}:{f['line']}:{f['name']}" for f in frames)


def native_named(*names: str):
    return lambda f: f["kind"] == "native" and any(f["name"] == n or f["name"].startswith(n + ".") for n in names)


def python_named(name: str):
    return lambda f: f["kind"] == "python" and f["name"].rsplit(".", 1)[-1] == name


def recurse(depth: int, leaf):
    return leaf() if depth == 0 else recurse(depth - 1, leaf)


@pytest.mark.parametrize("depth", [0, 5, 60])
def test_python_frames_match_extract_stack(depth: int) -> None:
    def leaf():
        tb = capture.gather(); summary = traceback.extract_stack()  # noqa: E702  # fmt: skip
        return tb, summary

    tb, summary = recurse(depth, leaf)
    (frames,) = symbolize([tb])
    assert python_frames(frames) == expected_from(summary)


def test_python_only_gather_has_no_native_frames() -> None:
    tb = capture.gather(python=True, native=False); summary = traceback.extract_stack()  # noqa: E702  # fmt: skip
    (frames,) = symbolize([tb])
    assert all(f["kind"] == "python" for f in frames)
    assert python_frames(frames) == expected_from(summary)


def test_sorted_key_callback_sits_under_list_sort() -> None:
    captured = []

    def key(value: int) -> int:
        captured.append(capture.gather())
        return value

    def caller() -> list[int]:
        return sorted([2, 1], key=key)

    caller()
    frames = symbolize(captured[:1])[0]
    key_at = index_of(frames, python_named("key"))
    sort_at = index_of(frames, native_named("list_sort_impl", "list_sort"))
    caller_at = index_of(frames, python_named("caller"))
    test_at = index_of(frames, python_named("test_sorted_key_callback_sits_under_list_sort"))
    # The callback is innermost; the C sort that called it comes next, then its Python caller.
    assert key_at == 0, _show(frames)
    assert key_at < sort_at < caller_at < test_at, _show(frames)
    assert frames[key_at + 1]["kind"] == "native", "C frames directly under the callback"
    # No eval-loop frame is left over: each one was replaced by the Python frames it runs.
    assert not any(native_named("_PyEval_EvalFrameDefault")(f) for f in frames), _show(frames)
    # The interpreter's own start-up frames are the outermost ones.
    main_at = index_of(frames, native_named("Py_RunMain", "Py_BytesMain", "main"))
    assert all(f["kind"] != "python" for f in frames[main_at:]), _show(frames)


def test_libc_qsort_callback_through_ctypes() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    compare_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
    captured = []

    def compare(a, b) -> int:
        if not captured:
            captured.append(capture.gather())
        return a[0] - b[0]

    def sort_with_qsort() -> None:
        values = (ctypes.c_int * 4)(4, 3, 2, 1)
        libc.qsort(values, 4, ctypes.sizeof(ctypes.c_int), compare_type(compare))

    sort_with_qsort()
    frames = symbolize(captured)[0]
    compare_at = index_of(frames, python_named("compare"))
    qsort_at = index_of(
        frames, lambda f: f["kind"] == "native" and "libc.so" in (f["module"] or "") and "sort" in f["name"]
    )
    caller_at = index_of(frames, python_named("sort_with_qsort"))
    assert compare_at == 0
    assert compare_at < qsort_at < caller_at, _show(frames)
    # libffi / ctypes machinery sits between the callback and qsort, and between qsort and the caller.
    assert all(f["kind"] == "native" for f in frames[compare_at + 1 : caller_at]), _show(frames)


def test_gather_with_gil_released_names_new_code() -> None:
    # A code object no gather has seen before, captured while the GIL is released
    # (as in a C callback): its names are copied and its line resolved on the spot.
    namespace: dict = {}
    exec(
        "def fresh_function(gather):\n    return gather()\n",
        {"__name__": "fresh_module", "__file__": "<fresh>"},
        namespace,
    )
    tb = namespace["fresh_function"](_native_test.gather_with_gil_released)
    flags = [f for _, _, f in tb.python]
    assert flags[0] & _native.PYTHON_FRAME_LINE_RESOLVED
    (frames,) = symbolize([tb])
    python = [f for f in frames if f["kind"] == "python"]
    assert (python[0]["name"], python[0]["filename"], python[0]["line"]) == ("fresh_function", "<string>", 2)
    assert python_named("test_gather_with_gil_released_names_new_code")(python[1])


def test_gather_on_a_thread() -> None:
    result = {}

    def work():
        result["tb"] = capture.gather(); result["summary"] = traceback.extract_stack()  # noqa: E702  # fmt: skip

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    (frames,) = symbolize([result["tb"]])
    assert python_frames(frames) == expected_from(result["summary"])
    # The thread's outermost native frames are libc's thread start, not the interpreter's main.
    assert frames[-1]["kind"] == "native" and "libc.so" in frames[-1]["module"], _show(frames)


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="3.10 runs one Python frame per C eval call, torch is right there"
)
def test_torch_misplaces_python_frames_where_tbpipe_does_not() -> None:
    torch_profiler = pytest.importorskip(
        "torch._C._profiler", reason="torch 2.13 CPU is installed for CPython 3.11 only"
    )
    captured = {}

    def key(value: int) -> int:
        captured["torch"] = torch_profiler.gather_traceback(python=True, script=False, cpp=True)
        captured["ours"] = capture.gather()
        return value

    def caller() -> list[int]:
        return sorted([1], key=key)

    caller()
    theirs = torch_profiler.symbolize_tracebacks([captured["torch"]])[0]
    theirs = [{"kind": "native" if not f["filename"].endswith(".py") else "python", **f} for f in theirs]
    ours = symbolize([captured["ours"]])[0]

    def order(frames):
        return (
            index_of(frames, lambda f: f["name"] == "key" or f["name"].endswith(".key")),
            index_of(frames, lambda f: f["name"] in ("list_sort_impl", "list_sort")),
            index_of(frames, lambda f: f["name"] == "caller" or f["name"].endswith(".caller")),
        )

    key_at, sort_at, caller_at = order(ours)
    assert key_at < sort_at < caller_at, _show(ours)
    # torch gives each eval-loop frame one Python frame, so `caller` lands inside the sort.
    key_at, sort_at, caller_at = order(theirs)
    assert caller_at < sort_at, "torch fixed its interleaving: update this anchor test"


def test_gather_on_a_native_thread_without_python() -> None:
    tb = _native_test.gather_on_native_thread()
    assert tb.python == []
    (frames,) = symbolize([tb])
    assert frames and all(f["kind"] == "native" for f in frames), _show(frames)
    # It walked through the thread body to libc's thread start, not into a marker.
    assert not any(f["kind"] == "marker" for f in frames), _show(frames)
    assert "libc.so" in (frames[-1]["module"] or ""), _show(frames)
