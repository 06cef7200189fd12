"""The `torch-ops` source: an `op` event for every aten op PyTorch executes.

Two hooks; the first that works here is used, and the source's status line says which:

1. The RecordFunction observer (status "recording (RecordFunction observer)"): a global
   RecordFunction callback, the mechanism PyTorch's own profiler uses, compiled against the
   installed torch's headers and cached per torch build (tbpipe.capture.torch_observer; built at
   `make install`, else on first use). Its C++ callback records through tbpipe._native's C API:
   no Python runs per op. It sees every thread (those started before the session too), every op as
   called with the ops it calls nested inside (`aten::linear` containing `aten::t` and
   `aten::addmm`), autograd's backward nodes (`AddmmBackward0`, scope "backward") and user scopes
   (`record_function`, scope "user"), exactly the entries of the profiler's CPU activity. Attributes
   (see native/torch_observer/observer.cpp; in raw runs the events' op_* columns, in the database
   JSON in `attrs` as for other events): id, depth, parent; seq and seq_thread on forward ops;
   bwd_seq, fwd_thread and bwd_node on a backward node and every op inside it. At a session sample
   rate below 1, torch's own RecordFunction sampler draws the ops (an op not drawn costs almost
   nothing and is not counted in the manifest's events_sampled_out), and depth and parent are left
   out (the enclosing ops were mostly not drawn); backward nodes are still followed, so a drawn op
   inside one keeps its bwd_seq. With the session's op_stacks="outermost", an op called inside
   another op takes the enclosing op's stack (nothing walked) while no Python code ran in between
   (native/capi.h, TBPIPE_RECORD_NESTED): the same sites, without the frames between the two ops.
   Either way most ops gather no stack: an op whose place on its thread was seen before takes the
   stack gathered there (Recorder::set_stack_reuse in native/recorder.h says what a place is and how
   reuses are checked; the manifest counts them). A backward op
   belongs to the forward op with seq = bwd_seq and seq_thread = fwd_thread (the view
   `backward_op_sites` sites it at that op's line). No shapes: they would need every op's
   arguments boxed. Left out, as the dispatch mode never sees them: ops run while a fake, proxy
   or functionalization mode is set (tracing), and ops run while torch.compile compiles (on any
   thread; Dynamo's compile callbacks, through tbpipe.capture.torch_compile, say when).
2. The dispatch mode (status "recording (dispatch mode: <why the observer is not used>)"), when
   the observer cannot be built or loaded (no compiler, no torch headers) or
   TBPIPE_TORCH_OPS_HOOK=dispatch: a TorchDispatchMode whose `__torch_dispatch__` is native code
   (`tbpipe._native._torch_op_dispatch`) that records the event, then runs the op. Attributes:
     shapes   one entry per positional argument: sizes of a tensor, a list of sizes for a tensor
              list, null otherwise
     dtype, device   of the first tensor argument
     seq      on the forward op that created autograd node number `seq` on its thread (the first op
              to see the thread's sequence counter move)
     bwd_seq, bwd_node   on ops run by the backward of that node
   It misses what the observer sees: CompositeImplicitAutograd ops are seen decomposed (no
   `aten::linear`, only `aten::t` + `aten::addmm`); ops called by another op's kernel (the mode
   is off while an op runs); ops inside an eager higher-order operator (one event named
   `higher_order::<name>`); threads already running when the source started (later threads get
   the mode through threading's trace hook); ops dispatched with Python dispatch disabled. It
   costs a Python dispatch per op (about 1.5x to 2x on small CPU training steps).

Neither sees inside regions compiled by torch.compile (Inductor's fused kernels are not aten ops):
use the `cuda`/`triton` sources there. On the CPU, backward runs on the thread that called
`backward()`, whose stack ends at that line; CUDA backward runs on an autograd worker thread with
no Python frames: the sequence-number link to the forward op is what sites it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from tbpipe import _native
from tbpipe.capture import after_import

HOOK_ENV = "TBPIPE_TORCH_OPS_HOOK"
HOOKS = ("observer", "dispatch")


class TorchOpsHandle:
    """What start() returns. `status` may change once: when the program's `import torch` finishes."""

    @property
    def status(self) -> str:
        return _state.status


class _State:
    def __init__(self) -> None:
        self.mode: Any = None  # the one dispatch mode, made once torch is imported
        self.thread_trace: Any = None  # our threading.settrace hook while installed
        self.previous_thread_trace: Any = None
        self.lock = threading.RLock()
        self.requested = "observer"  # the hook start() asked for
        self.hook: str | None = None  # the hook in use while attached
        self.observer: Any = None  # the observer module once loaded
        self.observer_pid = 0  # the process that added the observer's callback
        self.from_import = False  # attached by the program's `import torch`, not at start()
        self.status = "not started"


_state = _State()
_torch = after_import.AttachWhenImported("torch", "torch-ops", "PyTorch", lambda torch: _attach(torch), _state.lock)


def _after_fork_in_child() -> None:
    # A parent thread that held the lock at fork time does not exist in the
    # child; waiting for it would hang the child's session start.
    _state.lock = _torch.lock = threading.RLock()
    # The observer's callback came along, registered: it stays so, but does nothing until the
    # child's own session (if any) starts the source again (removing it would take torch's lock).
    if _state.observer is not None:
        _state.observer.stop(False)


def start(hook: str | None = None) -> TorchOpsHandle:
    """Starts recording ops with `hook` ("observer" or "dispatch"; default: $TBPIPE_TORCH_OPS_HOOK,
    else the observer), falling back to the dispatch mode when the observer is unavailable."""
    requested = hook or os.environ.get(HOOK_ENV, "").strip() or "observer"
    if requested not in HOOKS:
        from tbpipe.capture.errors import SourceError

        origin = "hook" if hook else HOOK_ENV
        raise SourceError(f"{origin} must be one of {', '.join(HOOKS)}, not {requested!r}")
    with _state.lock:
        _state.requested = requested
        _state.from_import = after_import.fully_imported("torch") is None
        status = _torch.start()  # attaches now, or once the program's `import torch` finishes
        if _state.hook is None:
            _state.status = status
        return TorchOpsHandle()


def stop(handle: TorchOpsHandle | None = None) -> None:
    with _state.lock:
        _torch.cancel()
        if _state.observer is not None:
            # In a forked child the callback stays registered, disabled (see the observer's stop()).
            _state.observer.stop(os.getpid() == _state.observer_pid)
        _native._torch_ops_enable(False)
        _remove_thread_trace()
        _pop_if_on_top()
        _state.hook = None


def counters() -> dict[str, int]:
    """Ops seen and recorded by the dispatch mode's fast path since the process started."""
    return dict(_native._torch_ops_counters())


def _attach(torch: Any) -> None:
    if _state.requested == "observer":
        try:
            rate = _start_observer(torch)
            drawn = f", ops drawn by torch at rate {rate:g} (those left out are not counted)" if rate < 1 else ""
            _set_status(f"RecordFunction observer{drawn}")
            return
        except Exception as error:  # ObserverUnavailable, or the callback could not be added
            reason = str(error)
            print(f"tbpipe: torch-ops: using the dispatch mode (slower): {reason}", file=sys.stderr)
    else:
        from_env = os.environ.get(HOOK_ENV, "").strip() == "dispatch"
        reason = f"{HOOK_ENV}=dispatch" if from_env else "requested by the caller"
    _attach_dispatch_mode(torch)
    _set_status(f"dispatch mode: {reason}")


def _set_status(how: str) -> None:
    suffix = ", from `import torch` on" if _state.from_import else ""
    _state.status = f"recording ({how}{suffix})"


def _start_observer(torch: Any) -> float:
    """Starts the observer; returns the sample rate torch draws ops at (1.0: every op)."""
    from tbpipe.capture import torch_observer

    observer = torch_observer.load(torch)
    may_replace = not observer.registered() or _state.observer_pid == os.getpid()
    # Below 1, the session's sample rate is drawn by torch's own sampler: ops not drawn cost nothing.
    rate = observer.start(_native._C_API, _native._sample_rate(), may_replace)
    if may_replace:
        _state.observer_pid = os.getpid()
    _state.observer = observer
    _state.hook = "observer"
    return rate


# -- the dispatch mode --------------------------------------------------------


def _resolve(op: Any) -> tuple[str, Any]:
    """(event name, callable that runs the op) for an operator, computed once per operator."""
    from torch._ops import OpOverload

    schema = getattr(op, "_schema", None)
    if schema is not None:
        name = str(schema.name)  # "aten::addmm", as the profiler names it
    elif hasattr(op, "name"):
        name = f"higher_order::{op.name()}"
    else:
        name = repr(op)
    # OpOverload.__call__ only forwards to `_op`: calling `_op` saves a Python frame per op.
    raw = getattr(op, "_op", None)
    runner = raw if raw is not None and getattr(type(op), "__call__", None) is OpOverload.__call__ else op  # noqa: B004
    return sys.intern(name), runner


def _make_mode_class(base: type) -> type:
    class TbpipeOpEvents(base):  # type: ignore[misc, valid-type]
        """tbpipe's torch-ops source (see tbpipe.capture.torch_ops)."""

        # Higher-order operators pass through as one event instead of raising.
        supports_higher_order_operators = True

        def __init__(self) -> None:
            super().__init__()
            # What torch calls per op: native code bound to this instance (torch
            # requires `__torch_dispatch__.__self__ is mode`), no Python frame.
            self.__torch_dispatch__ = _native._torch_op_dispatch_bound_to(self)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return _native._torch_op_dispatch(func, types, args, kwargs)  # reached only through the class

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # the default wraps __torch_dispatch__ in a Python-level dynamo guard per op

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True  # never make torch.compile fall back to eager because of us

    return TbpipeOpEvents


def _attach_dispatch_mode(torch: Any) -> None:
    if _state.mode is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        autograd = getattr(torch._C, "_autograd", None)
        sequence_nr = getattr(autograd, "_get_sequence_nr", None) or (lambda: -1)
        current_node = getattr(torch._C, "_current_autograd_node", None) or (lambda: None)
        _native._torch_ops_setup(torch.Tensor, sequence_nr, current_node, _resolve)
        _state.mode = _make_mode_class(TorchDispatchMode)()
    _push_on_this_thread()
    _install_thread_trace()
    _native._torch_ops_enable(True)
    _state.hook = "dispatch"


def _mode_stack() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _push_on_this_thread() -> None:
    mode = _state.mode
    if mode is None or any(m is mode for m in _mode_stack()):
        return
    from torch.utils._python_dispatch import _push_mode

    # Pushed directly, not with `with mode:`: the mode stays for the session
    # and must not flip torch's process-wide "inside a dispatch mode" flags.
    _push_mode(mode)


def _pop_if_on_top() -> None:
    mode = _state.mode
    if mode is None or "torch" not in sys.modules:
        return
    stack = _mode_stack()
    if stack and stack[-1] is mode:
        from torch.utils._python_dispatch import _pop_mode

        _pop_mode()
    # Otherwise a mode of the program sits above ours (or another thread holds
    # it): it stays, disabled, and passes ops straight through.


# -- threads started later --------------------------------------------------


def _current_thread_trace() -> Any:
    return threading.gettrace() if hasattr(threading, "gettrace") else getattr(threading, "_trace_hook", None)


class _PopModeAtThreadEnd:
    """Kept in a thread-local slot of a thread the mode was pushed on: when the thread ends, Python
    drops it on that thread, with the GIL, and the mode leaves the thread's dispatch-mode stack.

    Otherwise the stack's reference to the mode is dropped later, by a C++ thread-exit destructor
    that needs the GIL; if the interpreter is finalizing by then (the program's main thread
    returned), taking the GIL ends the thread by unwinding through that destructor, and the
    process aborts ("terminate called without an active exception")."""

    def __del__(self) -> None:
        try:
            _pop_if_on_top()
        except Exception:
            pass


_thread_end = threading.local()


def _install_thread_trace() -> None:
    if _state.thread_trace is not None:
        return
    previous = _current_thread_trace()

    def push_mode_then_hand_over(frame: Any, event: str, arg: Any) -> Any:
        # Runs once, on the new thread's first call: push the mode, then give
        # the thread back to whichever tracer was installed before (usually none).
        sys.settrace(previous)
        try:
            if not threading.current_thread().name.startswith("tbpipe-"):  # our flusher runs no ops
                _push_on_this_thread()
                _thread_end.pop_mode = _PopModeAtThreadEnd()
        except Exception:
            pass
        return previous(frame, event, arg) if previous is not None else None

    _state.previous_thread_trace = previous
    _state.thread_trace = push_mode_then_hand_over
    threading.settrace(push_mode_then_hand_over)


def _remove_thread_trace() -> None:
    hook = _state.thread_trace
    if hook is None:
        return
    if _current_thread_trace() is hook:
        threading.settrace(_state.previous_thread_trace)
    _state.thread_trace = None
    _state.previous_thread_trace = None
