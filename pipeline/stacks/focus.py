"""Focus modes: which frames of a combined stack a view shows, and what it folds. The one home of
the rule: the icicles (`serve/flame.py`), the tracebacks of the service, the HTML and Markdown
reports, `tbpipe show`, `tbpipe ranks` and the exports all ask this module.

Modes (`MODES`, default `program`):

- `program`  the program's own story, on a stack innermost first:
  1. tbpipe's frames and the recording machinery's are hidden: tbpipe's Python packages, its
     extension and observer library, CUPTI, torch's RecordFunction callbacks;
  2. every frame outer of the program's entry point is folded into one row (`START_UP`): the entry
     point is the outermost Python frame outside the launchers (runpy, threading, multiprocessing,
     concurrent.futures), else the innermost Python frame; a stack without Python frames keeps them;
  3. CPython's own frames (the interpreter binary or libpython: its eval and call machinery) next to
     a Python frame, after step 1, are folded into that Python frame.
- `python`   Python frames only.
- `native`   native frames (and the markers where a native walk stopped) only.
- `all`      every frame.

Focusing never drops an event: a view weighs the focused stack as it weighed the whole one, so
totals and each leaf's count stay the same in every mode.

`focus_reference` is the definition, over one stack's frame classes; `focus_matrix` is the same
rule over many stacks at once (numpy), for the icicles; `tests/test_focus.py` holds the two equal
on random stacks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

MODES = ("program", "python", "native", "all")
MODE_LABELS = {"program": "program", "python": "Python", "native": "native", "all": "all frames"}  # a page's switch
DEFAULT_MODE = "program"
START_UP = "[start-up]"  # the row frames outer of the entry point fold into

# Frame classes.
PAD = -1  # past the end of a stack (focus_matrix)
PY = 0  # a Python frame of the program or its libraries
PY_LAUNCHER = 1  # a Python frame of the standard library's launchers (runpy, threading, ...)
PY_OWN = 2  # a Python frame of tbpipe
NATIVE = 3
INTERPRETER = 4  # a native frame of CPython itself
NATIVE_OWN = 5  # a native frame of tbpipe or of the recording machinery
MARKER = 6  # the native walk stopped here
CLASSES = (PY, PY_LAUNCHER, PY_OWN, NATIVE, INTERPRETER, NATIVE_OWN, MARKER)

_PYTHON = (PY, PY_LAUNCHER, PY_OWN)
_NATIVE = (NATIVE, INTERPRETER, NATIVE_OWN, MARKER)
_OWN = (PY_OWN, NATIVE_OWN)
_PROGRAM_PYTHON = (PY, PY_LAUNCHER)

# tbpipe's Python packages wherever they are installed (an editable install's folders come as prefixes).
_OWN_PYTHON_FILE = re.compile(r"/tbpipe/(capture|pipeline|schemas)/")
# Standard-library modules that start code rather than being the program: what runs above a script
# run with -m, a thread's target, a worker process's function.
_LAUNCHER_FILE = re.compile(
    r"^<frozen (runpy|threading)>$"
    r"|/lib(64)?/python\d+\.\d+t?/(runpy|threading|multiprocessing/(process|popen_\w+|spawn|forkserver|pool)"
    r"|concurrent/futures/(thread|process))\.py$"
)
# CPython: the interpreter binary (python3.11, python3) or its shared library (libpython3.11.so.1.0).
_INTERPRETER_MODULE = re.compile(r"^(lib)?python(\d+(\.\d+)?[a-z]*)?(\.so(\.[\d.]+)?)?$")
# The recording machinery's native frames, by module file name and by function: what the focus modes
# hide, and what siting passes over (pipeline/db/ingest/siting.py, sql/call_sites.sql hand these
# patterns to DuckDB, whose RE2 reads them as Python's `re` does). Modules: tbpipe's extension and
# observer, CUPTI (the recorder of CUDA launches).
RECORDING_MODULE = re.compile(r"^(_native|_native_test|_tbpipe_torch_observer)\..*\.so$|^libcupti\.so")
# Functions: tbpipe's own; torch's RecordFunction (the callbacks that call tbpipe's observer); the
# dispatcher's profiling path (taken only while RecordFunction callbacks are on; a demangled
# template's name starts with its return type); a collective's profiling callback (gloo's worker
# threads start an op's RecordFunction from it) and the wrapper carrying the profiler's thread-local
# state to that thread (its lambda's name stays mangled).
RECORDING_FUNCTION = re.compile(
    r"^(at::RecordFunction::|c10::Dispatcher::runRecordFunction\b|tbpipe::)"
    r"|(^|[\s>])c10::Dispatcher::callWithDispatchKeySlowPath<"
    r"|::recordAsyncWorkProfilingInfo\("
    r"|(^|[\s:])(_ZZN2at21)?wrapPropagateTLSState"
)


def is_recording_machinery(function: str | None, module: str | None) -> bool:
    """Whether a native frame is tbpipe's or torch's recording machinery (never a program's own)."""
    base = os.path.basename(module) if module else ""
    return bool(RECORDING_MODULE.search(base) or (function and RECORDING_FUNCTION.search(function)))


def tbpipe_source_dirs() -> tuple[str, ...]:
    """tbpipe's own package folders here (an editable install's are not under a `tbpipe/` folder)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return tuple(os.path.join(root, name) + os.sep for name in ("capture", "pipeline", "schemas"))


@dataclass(frozen=True)
class FrameRules:
    """What is tbpipe's own Python code: `own_prefixes` (path prefixes, e.g. the database's
    `user_code` rows of origin 'tbpipe') beside the built-in rule."""

    own_prefixes: tuple[str, ...] = ()

    def classify(self, kind: str, function: str | None, file: str | None, module: str | None) -> int:
        """The class of one frame (PY ... MARKER)."""
        if kind == "marker":
            return MARKER
        if kind == "python":
            if file and (_OWN_PYTHON_FILE.search(file) or file.startswith(self.own_prefixes)):
                return PY_OWN
            if file and _LAUNCHER_FILE.search(file):
                return PY_LAUNCHER
            return PY
        if is_recording_machinery(function, module):
            return NATIVE_OWN
        base = os.path.basename(module) if module else ""
        if base and _INTERPRETER_MODULE.match(base):
            return INTERPRETER
        return NATIVE


DEFAULT_RULES = FrameRules(tbpipe_source_dirs())


def check_mode(mode: str) -> str:
    """`mode`, or ValueError naming the modes."""
    if mode not in MODES:
        raise ValueError(f"frames must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


@dataclass(frozen=True)
class Focus:
    """One stack focused: `kept`, indices of the frames shown (innermost first, as given), and
    `start_up`, how many frames outer of the entry point fold into the START_UP row (0: no row,
    which then comes after the last kept frame)."""

    kept: list[int]
    start_up: int


def focus_reference(classes: Sequence[int], mode: str) -> Focus:
    """The definition: one stack's frame classes, innermost first, focused by `mode`."""
    check_mode(mode)
    indices = range(len(classes))
    if mode == "all":
        return Focus(list(indices), 0)
    if mode == "python":
        return Focus([i for i in indices if classes[i] in _PYTHON], 0)
    if mode == "native":
        return Focus([i for i in indices if classes[i] in _NATIVE], 0)
    visible = [i for i in indices if classes[i] not in _OWN]
    pythons = [i for i in visible if classes[i] in _PROGRAM_PYTHON]
    start_up = 0
    if pythons:
        programs = [i for i in pythons if classes[i] == PY]
        entry = programs[-1] if programs else pythons[0]
        start_up = len(classes) - 1 - entry
        visible = [i for i in visible if i <= entry]
    kept: list[int] = []
    at = 0
    while at < len(visible):
        if classes[visible[at]] != INTERPRETER:
            kept.append(visible[at])
            at += 1
            continue
        end = at
        while end < len(visible) and classes[visible[end]] == INTERPRETER:
            end += 1
        inner = classes[visible[at - 1]] if at > 0 else PAD
        outer = classes[visible[end]] if end < len(visible) else PAD
        if inner not in _PROGRAM_PYTHON and outer not in _PROGRAM_PYTHON:
            kept.extend(visible[at:end])
        at = end
    return Focus(kept, start_up)


@dataclass(frozen=True)
class FocusedRows:
    """Many stacks focused (`focus_matrix`): row i shows `columns[i, :lengths[i]]` (indices into its
    input row, innermost first; -1 past the end) and folds `start_up[i]` frames into START_UP."""

    columns: np.ndarray
    lengths: np.ndarray
    start_up: np.ndarray


def _compact(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the kept columns first in their order (then the others), and how many are kept."""
    return np.argsort(~keep, axis=1, kind="stable"), keep.sum(axis=1)


def focus_matrix(classes: np.ndarray, mode: str) -> FocusedRows:
    """`focus_reference` over every row of `classes` (stacks × frames, innermost first, PAD past the end)."""
    check_mode(mode)
    classes = np.asarray(classes, dtype=np.int64)
    stacks, width = classes.shape
    columns = np.arange(width)
    valid = classes != PAD
    start_up = np.zeros(stacks, dtype=np.int64)
    if mode == "all":
        keep = valid
    elif mode == "python":
        keep = np.isin(classes, _PYTHON)
    elif mode == "native":
        keep = np.isin(classes, _NATIVE)
    else:
        visible = valid & ~np.isin(classes, _OWN)
        pythons = np.isin(classes, _PROGRAM_PYTHON)
        outermost_program = np.where(classes == PY, columns, -1).max(axis=1, initial=-1)
        innermost_python = np.where(pythons, columns, width).min(axis=1, initial=width)
        has_python = innermost_python < width
        entry = np.where(outermost_program >= 0, outermost_program, np.where(has_python, innermost_python, width))
        start_up = np.where(has_python, valid.sum(axis=1) - 1 - entry, 0)
        visible &= columns[None, :] <= entry[:, None]
        # Interpreter runs next to a Python frame, among the visible frames.
        order, count = _compact(visible)
        shown = np.where(columns[None, :] < count[:, None], np.take_along_axis(classes, order, axis=1), PAD)
        interpreter = shown == INTERPRETER
        inner = np.maximum.accumulate(np.where(~interpreter, columns, -1), axis=1)
        outer = np.minimum.accumulate(np.where(~interpreter, columns, width)[:, ::-1], axis=1)[:, ::-1]
        padded = np.concatenate([shown, np.full((stacks, 1), PAD)], axis=1)  # column `width`: PAD
        inner_class = np.take_along_axis(padded, np.where(inner >= 0, inner, width), axis=1)
        outer_class = np.take_along_axis(padded, outer, axis=1)
        folded = interpreter & (np.isin(inner_class, _PROGRAM_PYTHON) | np.isin(outer_class, _PROGRAM_PYTHON))
        second, lengths = _compact((columns[None, :] < count[:, None]) & ~folded)
        picked = np.take_along_axis(order, second, axis=1)
        return FocusedRows(np.where(columns[None, :] < lengths[:, None], picked, -1), lengths, start_up)
    order, lengths = _compact(keep)
    return FocusedRows(np.where(columns[None, :] < lengths[:, None], order, -1), lengths, start_up)


# ------------------------------------------------------------------------------------------ frame lists

T = TypeVar("T")


@dataclass(frozen=True)
class StartUp:
    """The row that frames outer of the program's entry point fold into, in a focused traceback."""

    frames: int
    kind: str = "folded"

    @property
    def text(self) -> str:
        return f"{START_UP} {self.frames} frame{'s' if self.frames != 1 else ''} of process and interpreter start-up"


def frame_fields(frame: Any) -> tuple[str, str | None, str | None, str | None]:
    """(kind, function, file, module) of a frame as any reader gives it: a dict with `name`/`filename`
    (`stacks.render`) or `function`/`file` (the service's JSON), or an object with those attributes."""
    if isinstance(frame, dict):
        function = frame.get("function", frame.get("name"))
        return frame["kind"], function, frame.get("file", frame.get("filename")), frame.get("module")
    return frame.kind, getattr(frame, "function", None), getattr(frame, "file", None), getattr(frame, "module", None)


def focus_frames(
    frames: Sequence[T],
    mode: str,
    rules: FrameRules = DEFAULT_RULES,
    fields: Callable[[T], tuple] = frame_fields,
) -> list[T | StartUp]:
    """A traceback (innermost first) focused by `mode`: the frames shown, and a StartUp row last
    where program mode folds the start-up frames."""
    focus = focus_reference([rules.classify(*fields(f)) for f in frames], mode)
    out: list[T | StartUp] = [frames[i] for i in focus.kept]
    if focus.start_up:
        out.append(StartUp(focus.start_up))
    return out


def modes_of_frames(
    frames: Sequence[T], rules: FrameRules = DEFAULT_RULES, fields: Callable[[T], tuple] = frame_fields
) -> list[tuple[T | StartUp, tuple[str, ...]]]:
    """Each frame with the modes that show it, and the StartUp row (program mode only) after the
    entry point: for a page that switches modes without asking the server again."""
    classes = [rules.classify(*fields(f)) for f in frames]
    shown = {mode: focus_reference(classes, mode) for mode in MODES}
    kept = {mode: set(focus.kept) for mode, focus in shown.items()}
    rows: list[tuple[T | StartUp, tuple[str, ...]]] = []
    start_up = shown["program"]
    last_kept = max(start_up.kept, default=-1)
    for i, frame in enumerate(frames):
        rows.append((frame, tuple(mode for mode in MODES if i in kept[mode])))
        if start_up.start_up and i == last_kept:
            rows.append((StartUp(start_up.start_up), ("program",)))
    return rows


def rules_from(own_prefixes: Iterable[str]) -> FrameRules:
    """The rules with these prefixes of tbpipe's own Python code added (a database's 'tbpipe' rows)."""
    return FrameRules(tuple(dict.fromkeys((*DEFAULT_RULES.own_prefixes, *own_prefixes))))
