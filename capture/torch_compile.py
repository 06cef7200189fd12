"""torch.compile awareness: where generated code came from, and compile events.

Switched on with the sources that record from inside compiled code (`torch-ops`, `cuda`,
`triton`), from the program's first use of Dynamo (`import torch._dynamo`) on; it never imports
torch itself. It does three things:

- **Origins of generated code** (the run's `code_origins` parts). Inductor keeps, for every
  wrapper module it loads, a line map: from each run of generated lines to the stack trace of the
  FX node those lines execute (`torch._inductor.codecache.PyCodeCache.linemaps`, which PyTorch's
  own tools read through `PyCodeCache.stack_frames_for_code`). After each compile (Dynamo's
  compile-end callback) and at each flush, the maps of wrappers loaded since are turned into rows:
  generated file, line range, the user frames innermost first. The ingest places those frames
  inside the generated frame, so an op, kernel launch or Triton launch made by compiled code is
  sited at the line of the user's code that the graph node came from.
- **Compile events**, recorded with the compiling thread's stack from Dynamo's structured trace
  (a handler on the `torch.__trace` logger, the one that `TORCH_TRACE` and tlparse read):
    `graph_break`  name: the kind of break (the first line of the reason `torch._dynamo.explain`
                   gives); attrs: reason, file, line, compile_id. Sited at the line that broke the
                   graph: the event is recorded from a small function of a pseudo-file
                   (EVENT_CARRIER_FILE) whose line has a `code_origins` row naming the user's frames.
    `compile`      name: the compiled function (`<name> (backward)` for its backward graph); attrs:
                   seconds, compile_id, file, first_line, ops, graph_breaks, and fail_type /
                   fail_reason when the compile failed. Sited at the line that called the function.
    `recompile`    name: the function; attrs: reason (the failing guard, as Dynamo words it),
                   compile_id, file, first_line. Sited at the call that failed the guards.
  Dynamo's compile callbacks (`torch._dynamo.callback_handler`) time what the trace does not:
  CUDA graph recordings (a `compile` event named `cudagraph recording`).
- **Generated-code folders** for the manifest (`generated_code`): Inductor's cache folder as this
  process configured it (`TORCHINDUCTOR_CACHE_DIR` or Inductor's default) and Triton's cache.

What is missing in a PyTorch version is said once on stderr and in the manifest
(`torch_compile_notes`); nothing of PyTorch's is replaced or patched. Costs: at compile time, the structured trace's artifacts are
formatted while the handler is attached (as with TORCH_TRACE); after compilation nothing runs per
call of compiled code.
"""

from __future__ import annotations

import ast
import functools
import linecache
import logging
import os
import re
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

from tbpipe import _native
from tbpipe.capture import after_import

# Pseudo-file of the functions that compile events are recorded from (see _carrier).
EVENT_CARRIER_FILE = "<tbpipe: torch.compile event>"
_TRACE_LOGGER = "torch.__trace"
_NO_LINE_END = 2**31 - 1
_RESUME_PREFIX = "torch_dynamo_resume_in_"

_STACK_TRACE_FRAME = re.compile(r'File "(.+)", line (\d+), in (.+)\n')
_STACK_TRACE_LINE = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
# How FX prints a node's innermost frame above it in a graph's readable code.
_GRAPH_NODE_COMMENT = re.compile(r"^\s*#.*?\bFile: (.+):(\d+) in (.+?), code: (.*)$", re.MULTILINE)
_BREAK_AT = re.compile(r"^Graph break in user code at (.*):(\d+)$")


@dataclass
class CompileHandle:
    status: str


@dataclass
class _Compile:
    """What is known of one compile id (frame id, frame compile id) while it is compiled."""

    function: str | None = None


@dataclass
class _State:
    lock: Any = field(default_factory=threading.RLock)
    attached: bool = False
    watcher: Any = None  # after_import watcher for torch._dynamo
    handler: logging.Handler | None = None
    callbacks: tuple[Any, Any, Any] | None = None  # (callback handler, start, end)
    missing: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # code_origins rows, in the order found
    linemaps_seen: dict[str, Any] = field(default_factory=dict)  # wrapper path -> the line map harvested
    wrapper_compiles: dict[str, tuple] = field(default_factory=dict)  # wrapper path -> compile key
    traced: dict[tuple, set] = field(default_factory=dict)  # compile key -> frames Dynamo traced
    carriers: dict[tuple, tuple[int, Any]] = field(default_factory=dict)  # origin -> (line, function)
    compiles: dict[tuple, _Compile] = field(default_factory=dict)
    started: dict[tuple, float] = field(default_factory=dict)  # (trigger, compile id) -> perf_counter
    # How often PyTorch called in (benchmarks check that nothing runs per call of compiled code).
    calls: dict[str, int] = field(default_factory=lambda: {"trace_records": 0, "compile_callbacks": 0})


_state = _State()


def _after_fork_in_child() -> None:
    # A parent thread that held the lock at fork time does not exist in the child.
    _state.lock = threading.RLock()


# -- switching on and off ------------------------------------------------------------------------


def start() -> CompileHandle:
    """Follows torch.compile from now on (at once when Dynamo is imported, else from its import)."""
    with _state.lock:
        module = after_import.fully_imported("torch._dynamo")
        if module is not None:
            _attach(module)
            return CompileHandle(_status("recording"))
        if not after_import.installed("torch"):  # a top-level lookup: imports nothing
            return CompileHandle("PyTorch is not installed: nothing to follow")
        if _state.watcher is None:
            _state.watcher = after_import.install("torch._dynamo", _on_dynamo_import)
        return CompileHandle("recording (from torch.compile's first use on)")


def stop(handle: CompileHandle | None = None) -> None:
    with _state.lock:
        after_import.remove(_state.watcher)
        _state.watcher = None
        if not _state.attached:
            return
        _state.attached = False
        if _state.handler is not None:
            logging.getLogger(_TRACE_LOGGER).removeHandler(_state.handler)
            _state.handler = None
        if _state.callbacks is not None:
            handler, on_start, on_end = _state.callbacks
            for remove, callback in (
                (handler.remove_start_callback, on_start),
                (handler.remove_end_callback, on_end),
            ):
                try:
                    remove(callback)
                except ValueError:
                    pass  # removed by the program (torch._dynamo.reset() clears them)
            _state.callbacks = None


def notes() -> list[str]:
    """What following torch.compile could not do in this process (each said once on stderr too)."""
    return list(_state.missing)


def _status(base: str) -> str:
    return base if not _state.missing else f"{base}; {'; '.join(_state.missing)}"


def _on_dynamo_import(module: Any) -> None:
    with _state.lock:
        if _state.watcher is None:
            return  # the session stopped while Dynamo was importing
        _state.watcher = None
        _attach(module)


def _say_missing(what: str) -> None:
    if what not in _state.missing:
        _state.missing.append(what)
        print(f"tbpipe: {what}", file=sys.stderr)


def _attach(dynamo: Any) -> None:
    if _state.attached:
        return
    _state.attached = True
    _state.handler = _TraceHandler()
    logging.getLogger(_TRACE_LOGGER).addHandler(_state.handler)
    callback_module = sys.modules.get("torch._dynamo.callback")
    handler = getattr(callback_module, "callback_handler", None) or getattr(dynamo, "callback_handler", None)
    if handler is None or not hasattr(handler, "register_start_callback"):
        _say_missing(
            "torch.compile: this PyTorch has no Dynamo compile callbacks (torch._dynamo.callback_handler); "
            "CUDA graph recordings are not timed and line maps are read at flush time only"
        )
        return
    handler.register_start_callback(_on_compile_start)
    handler.register_end_callback(_on_compile_end)
    _state.callbacks = (handler, _on_compile_start, _on_compile_end)


# -- Dynamo's compile callbacks ---------------------------------------------------------------------


def _trigger_name(args: Any) -> str:
    trigger = getattr(args, "callback_trigger", None)
    return str(getattr(trigger, "name", trigger))


def counters() -> dict[str, int]:
    """Structured-trace records and compile callbacks received since the process started."""
    return dict(_state.calls)


def _tell_torch_ops_observer(compiling: bool) -> None:
    """The torch-ops observer leaves out the ops run while torch.compile compiles (type promotion, shape
    checks, tracing: the compiler's); the dispatch mode never sees them."""
    observer = sys.modules.get("_tbpipe_torch_observer")
    if observer is not None:
        observer.compiling(compiling)


def _on_compile_start(args: Any) -> None:
    _state.calls["compile_callbacks"] += 1
    _tell_torch_ops_observer(True)
    try:
        _state.started[(_trigger_name(args), getattr(args, "compile_id", None))] = time.perf_counter()
    except Exception:
        pass


def _on_compile_end(args: Any) -> None:
    _state.calls["compile_callbacks"] += 1
    _tell_torch_ops_observer(False)
    try:
        trigger = _trigger_name(args)
        compile_id = getattr(args, "compile_id", None)
        began = _state.started.pop((trigger, compile_id), None)
        harvest_line_maps()
        # Frame compiles and lazy backward compiles have their own metrics in the trace.
        if began is not None and trigger not in ("DYNAMO", "LAZY_BACKWARD"):
            name = trigger.lower().replace("_", " ")
            _native.record("compile", name, seconds=round(time.perf_counter() - began, 6), compile_id=str(compile_id))
    except Exception as error:
        _say_missing(f"torch.compile: compile-end callback failed ({type(error).__name__}: {error})")


# -- Dynamo's structured trace ------------------------------------------------------------------------


class _TraceHandler(logging.Handler):
    """Reads the structured trace records that matter here; never raises into Dynamo."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        _state.calls["trace_records"] += 1
        metadata = getattr(record, "metadata", None)
        if not isinstance(metadata, dict):
            return
        try:
            artifact = metadata.get("artifact")
            if artifact is not None:
                if isinstance(artifact, dict) and artifact.get("name") == "dynamo_graph_break_reason":
                    _graph_break(metadata, getattr(record, "payload", None))
            elif "dynamo_output_graph" in metadata:
                _dynamo_graph(metadata, getattr(record, "payload", None))
            elif "inductor_output_code" in metadata:
                _output_code(metadata)
            elif "compilation_metrics" in metadata:
                _compiled(metadata, metadata["compilation_metrics"], backward=False)
            elif "bwd_compilation_metrics" in metadata:
                _compiled(metadata, metadata["bwd_compilation_metrics"], backward=True)
        except Exception as error:
            _say_missing(
                f"torch.compile: a structured trace record was not understood ({type(error).__name__}: {error})"
            )


def _compile_key(metadata: dict[str, Any]) -> tuple:
    return (metadata.get("compiled_autograd_id"), metadata.get("frame_id"), metadata.get("frame_compile_id"))


def _compile_id_text(metadata: dict[str, Any], metrics: dict[str, Any] | None = None) -> str:
    if metrics and metrics.get("compile_id"):
        return str(metrics["compile_id"])
    return f"{metadata.get('frame_id')}/{metadata.get('frame_compile_id')}"


def _compiled(metadata: dict[str, Any], metrics: dict[str, Any], backward: bool) -> None:
    """A frame (or its backward graph) finished compiling: its compile event, and its recompile event."""
    if not isinstance(metrics, dict):
        return
    harvest_line_maps()
    key = _compile_key(metadata)
    known = _state.compiles.setdefault(key, _Compile())
    function = metrics.get("co_name") or known.function
    if not backward:
        known.function = function
    name = str(function or "<unknown frame>")
    seconds = metrics.get("entire_frame_compile_time_s")
    if seconds is None and metrics.get("duration_us") is not None:
        seconds = metrics["duration_us"] / 1e6
    attrs: dict[str, Any] = {"compile_id": _compile_id_text(metadata, metrics)}
    if seconds is not None:
        attrs["seconds"] = round(float(seconds), 6)
    for key_out, key_in in (
        ("file", "co_filename"),
        ("first_line", "co_firstlineno"),
        ("ops", "graph_op_count"),
        ("graph_breaks", "num_graph_breaks"),
        ("fail_type", "fail_type"),
        ("fail_reason", "fail_reason"),
    ):
        if metrics.get(key_in) is not None:
            attrs[key_out] = metrics[key_in]
    _native.record("compile", f"{name} (backward)" if backward else name, **attrs)
    reason = metrics.get("recompile_reason")
    if reason and not backward:
        recompile = {"reason": str(reason), "compile_id": attrs["compile_id"]}
        for key_out in ("file", "first_line"):
            if key_out in attrs:
                recompile[key_out] = attrs[key_out]
        _native.record("recompile", name, **recompile)


def explain_reason(reason: str) -> str:
    """The reason as `torch._dynamo.explain` words it: without the one-line context that Dynamo's log
    puts before it ("Encountered graph break when attempting to trace CALL: ...:")."""
    head, separator, rest = reason.partition(":\n\n")
    return rest.strip() if separator and "\n" not in head else reason.strip()


def parse_graph_break(payload: str) -> tuple[str | None, int | None, str, list[tuple[str, int, str]]]:
    """(file, line, reason, user traceback frames outermost first) from a `dynamo_graph_break_reason`
    payload; file and line are None, and the frames empty, for a payload of another shape."""
    file = line = None
    lines = payload.split("\n")
    match = _BREAK_AT.match(lines[0]) if lines else None
    if match:
        file, line = match.group(1), int(match.group(2))
    reason = payload
    marker = "Graph Break Reason: "
    at = payload.find(marker)
    if at >= 0:
        end = len(payload)
        for stop in ("\n\nStack variable source attribution:", "\n\nUser code traceback:"):
            found = payload.find(stop, at)
            if found >= 0:
                end = min(end, found)
        reason = payload[at + len(marker) : end]
    frames: list[tuple[str, int, str]] = []
    traceback_at = payload.find("\nUser code traceback:\n")
    if traceback_at >= 0:
        section = payload[traceback_at + len("\nUser code traceback:\n") :].split("\n\n", 1)[0] + "\n"
        frames = [(f, int(n), name) for f, n, name in _STACK_TRACE_FRAME.findall(section)]
    return file, line, explain_reason(reason), frames


def _graph_break(metadata: dict[str, Any], payload: Any) -> None:
    if not isinstance(payload, str):
        return
    file, line, reason, frames = parse_graph_break(payload)
    # The traceback starts with frames that are on this thread's stack now (the call that started
    # the compile); the others are the compiled code's, which Dynamo traced instead of running.
    on_stack = set()
    frame = sys._getframe(1)
    while frame is not None:
        on_stack.add((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    first_traced = 0
    while first_traced < len(frames) and (frames[first_traced][0], frames[first_traced][1]) in on_stack:
        first_traced += 1
    traced = frames[first_traced:]
    if not traced and file is not None and line is not None:
        traced = [(file, line, "<unknown>")]
    attrs: dict[str, Any] = {"reason": reason, "compile_id": _compile_id_text(metadata)}
    if file is not None:
        attrs["file"], attrs["line"] = file, line
    name = reason.split("\n", 1)[0].strip() or "graph break"
    origin = tuple(origin_frame(f, n, name_) for f, n, name_ in reversed(traced))
    if origin:
        _carrier(origin)("graph_break", name, attrs)
    else:
        _native.record("graph_break", name, **attrs)


# -- carriers: where events that happened at a line not on the stack are recorded from -----------------

_CARRIER_TEMPLATE = compile(
    "def torch_compile_event(kind, name, attrs):\n    record(kind, name, **attrs)\n", EVENT_CARRIER_FILE, "exec"
)
_CARRIER_CODE = next(c for c in _CARRIER_TEMPLATE.co_consts if isinstance(c, types.CodeType))


def _carrier(origin: tuple[dict[str, Any], ...]) -> Any:
    """A function whose only line, a line of its own in EVENT_CARRIER_FILE, records an event; that line
    has a `code_origins` row naming `origin`, so the ingest sites the event at the user's line."""
    key = tuple(tuple(sorted(frame.items())) for frame in origin)
    with _state.lock:
        known = _state.carriers.get(key)
        if known is not None:
            return known[1]
        line = 2 + len(_state.carriers)
        code = _CARRIER_CODE.replace(co_firstlineno=line - 1)
        function = types.FunctionType(code, {"record": _native.record})
        _state.carriers[key] = (line, function)
        _state.rows.append({"file": EVENT_CARRIER_FILE, "line_lo": line, "line_hi": line, "origin": list(origin)})
        return function


# -- Inductor's line maps ---------------------------------------------------------------------------------


def harvest_line_maps() -> None:
    """Rows for the Inductor wrappers loaded since the last call (any thread; cheap when none is new)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return
    linemaps = getattr(getattr(codecache, "PyCodeCache", None), "linemaps", None)
    if not isinstance(linemaps, dict):
        _say_missing(
            "torch.compile: this PyTorch has no Inductor line maps (PyCodeCache.linemaps); events of "
            "compiled code are sited at the compiled function's own frame"
        )
        return
    with _state.lock:
        for path, entry in list(linemaps.items()):
            seen = _state.linemaps_seen.get(path)
            if seen is entry or (seen is not None and seen == entry):
                continue
            _state.linemaps_seen[path] = entry
            compile_key = _state.wrapper_compiles.get(path)
            traced = _state.traced.get(compile_key) if compile_key is not None else None
            _state.rows.extend(rows_of_line_map(path, entry, traced))


def stack_trace_frames(trace: str) -> list[tuple[str, int, str, str]]:
    """(file, line, function, code) of each frame of an FX node's stack trace, outermost first."""
    frames = []
    lines = trace.split("\n")
    for index, text in enumerate(lines):
        match = _STACK_TRACE_LINE.match(text)
        if match is None:
            continue
        # The line after it, as FX reads it for a graph's comments (a frame without source has none).
        code = lines[index + 1].strip() if index + 1 < len(lines) else ""
        frames.append((match.group(1), int(match.group(2)), match.group(3), code))
    return frames


def rows_of_line_map(
    path: str, entry: Any, traced: set[tuple[str, int, str, str]] | None = None
) -> list[dict[str, Any]]:
    """`code_origins` rows of one wrapper from its line map, [(start lines...), (stack traces...)] as
    Inductor keeps it. `traced`: the frames Dynamo traced for the wrapper's compile in this process
    ((file, line, function, code) of each graph node's innermost frame), None when unknown."""
    if not entry or len(entry) != 2:
        return []
    starts, traces = entry
    rows = []
    for index, (start, trace) in enumerate(zip(starts, traces)):
        end = starts[index + 1] - 1 if index + 1 < len(starts) else _NO_LINE_END
        if not trace or not isinstance(trace, str) or end < start:
            continue
        frames = current_frames(stack_trace_frames(trace), traced)
        if not frames:
            continue
        origin = [origin_frame(f, n, name) for f, n, name, _code in reversed(frames)]
        rows.append({"file": path, "line_lo": int(start), "line_hi": int(end), "origin": origin})
    return rows


def current_frames(
    frames: list[tuple[str, int, str, str]], traced: set[tuple[str, int, str, str]] | None
) -> list[tuple[str, int, str, str]] | None:
    """The frames of a line map's stack trace as the code stands now; None when they cannot be trusted.

    A wrapper loaded from Inductor's cache keeps the stack traces of the compile that first made it,
    which may have run other lines, or another file with the same graph. So the innermost frame must
    be one that Dynamo traced in this process (`traced`), else the traced frame of the same function
    and source text stands for it (the nearest such line); outer frames must still hold their source
    text, else the line of the same text in the same function stands for them.
    """
    if not frames:
        return None
    fixed = list(frames)
    file, line, name, code = fixed[-1]
    if traced is not None and (file, line, name, code) not in traced:
        same = [t for t in traced if t[2] == name and t[3] == code]
        if not same:
            return None
        fixed[-1] = min(same, key=lambda t: (t[0] != file, abs(t[1] - line)))
    for index, (file, line, name, code) in enumerate(fixed):
        if index == len(fixed) - 1 and traced is not None:
            break
        if not code or code.startswith("File ") or linecache.getline(file, line).strip() == code:
            continue
        moved = _line_with_text(file, name, code, line)
        if moved is None:
            return None
        fixed[index] = (file, moved, name, code)
    return fixed


def _line_with_text(file: str, name: str, code: str, near: int) -> int | None:
    """The line of the function `name` in `file` whose text is `code` (the nearest to `near`)."""
    lines = linecache.getlines(file)
    spans = [(first, last) for first, last, node_name, _q in _functions_of(file) if node_name == name]
    found = [
        number
        for first, last in spans
        for number in range(first, min(last, len(lines)) + 1)
        if lines[number - 1].strip() == code
    ]
    return min(found, key=lambda number: abs(number - near)) if found else None


def _dynamo_graph(metadata: dict[str, Any], payload: Any) -> None:
    """Remembers the frames of the nodes of a graph Dynamo just traced (its readable code's comments)."""
    if not isinstance(payload, str):
        return
    frames = {
        (m.group(1), int(m.group(2)), m.group(3), m.group(4).strip()) for m in _GRAPH_NODE_COMMENT.finditer(payload)
    }
    with _state.lock:
        _state.traced.setdefault(_compile_key(metadata), set()).update(frames)


def _output_code(metadata: dict[str, Any]) -> None:
    info = metadata.get("inductor_output_code")
    path = info.get("filename") if isinstance(info, dict) else None
    if isinstance(path, str):
        with _state.lock:
            _state.wrapper_compiles[path] = _compile_key(metadata)


def rows_since(count: int) -> tuple[list[dict[str, Any]], int]:
    """The `code_origins` rows found after the first `count`, and the new count."""
    harvest_line_maps()
    with _state.lock:
        rows = _state.rows[count:]
        return rows, count + len(rows)


# -- naming the user's functions as code objects name them ---------------------------------------------------


def origin_frame(filename: str, line: int, name: str) -> dict[str, Any]:
    """A frame of a stack trace with its function's qualified name and first line, as `code` rows have
    them (so that a compiled line is the same call site as the same line run eagerly)."""
    qualname, first_line = _function_at(filename, name, line)
    return {"filename": filename, "qualname": qualname, "first_line": first_line, "line": line}


def _function_at(filename: str, name: str, line: int) -> tuple[str, int]:
    # Code after a graph break runs in a function Dynamo made ("torch_dynamo_resume_in_fn_at_12");
    # its lines are the user function's, which is named instead.
    any_name = name.startswith(_RESUME_PREFIX)
    best = None
    for first, last, node_name, qualname in _functions_of(filename):
        if (any_name or node_name == name) and first <= line <= last and (best is None or first >= best[0]):
            best = (first, qualname, node_name)
    if best is not None and any_name:
        name = best[2]
    if best is None:
        return (name, 1) if name == "<module>" else (name, -1)
    return (best[1] if sys.version_info >= (3, 11) else name), best[0]


_COMPREHENSIONS = {ast.ListComp: "<listcomp>", ast.SetComp: "<setcomp>", ast.DictComp: "<dictcomp>"}


@functools.lru_cache(maxsize=512)
def _functions_of(filename: str) -> tuple[tuple[int, int, str, str], ...]:
    """(first line, last line, name, qualified name) of every function of a source file (empty when it
    cannot be read or parsed): first line as CPython counts it, decorators included."""
    try:
        source = "".join(linecache.getlines(filename)) or (
            open(filename, encoding="utf-8").read() if os.path.isfile(filename) else ""
        )
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return ()
    found: list[tuple[int, int, str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = None
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
            elif isinstance(child, ast.Lambda):
                name, first = "<lambda>", child.lineno
            elif isinstance(child, ast.GeneratorExp):
                name, first = "<genexpr>", child.lineno
            elif type(child) in _COMPREHENSIONS and sys.version_info < (3, 12):
                name, first = _COMPREHENSIONS[type(child)], child.lineno
            if name is not None:
                qualname = prefix + name
                found.append((first, getattr(child, "end_lineno", None) or first, name, qualname))
                visit(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):  # a class body is a code object too
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((first, getattr(child, "end_lineno", None) or first, child.name, prefix + child.name))
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return tuple(found)


# -- the manifest ----------------------------------------------------------------------------------------------


def generated_code_dirs() -> dict[str, str]:
    """Folders of code generated in this process, by what generated it: Inductor's cache as the process
    configured it, and Triton's. Read only from modules the program imported."""
    dirs = {}
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if not inductor and utils is not None:
        try:
            inductor = utils.default_cache_dir()
        except Exception:
            inductor = None
    if inductor:
        dirs["inductor"] = os.path.abspath(inductor)
    triton = os.environ.get("TRITON_CACHE_DIR")
    if not triton and "triton" in sys.modules:
        try:
            triton = sys.modules["triton"].knobs.cache.dir
        except Exception:
            triton = None
    if triton:
        dirs["triton"] = os.path.abspath(triton)
    return dirs
