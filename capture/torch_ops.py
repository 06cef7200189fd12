"""The `torch-ops` source: an `op` event for every aten op PyTorch executes.

How. A TorchDispatchMode whose `__torch_dispatch__` is native code
(`tbpipe._native._torch_op_dispatch`): torch calls it for every op that reaches
the Python dispatch key, forward and backward; it records the event with the
calling thread's combined stack, then runs the op. The mode has no Python frame
and builds no Python object per op (shapes, dtype and device become JSON text
in C++). PyTorch offers Python no RecordFunction observer (only the profiler,
the execution-trace observer and an empty test observer), and a C++ observer
would need an extension compiled against torch's headers, so a dispatch mode
is the cheapest hook that sees every op without one.

Event: kind `op`, name in the profiler's convention (`aten::addmm`), attributes
  shapes   one entry per positional argument: sizes of a tensor, a list of sizes
           for a tensor list, null otherwise
  dtype, device   of the first tensor argument
  seq      on the forward op that created autograd node number `seq` on its
           thread (the first op to see the thread's sequence counter move)
  bwd_seq, bwd_node   on ops run by the backward of that node
A backward op is sited at its forward op by joining its `bwd_seq` to the `seq`
of the forward op. On the CPU, backward runs on the thread that called
`backward()`, whose stack already ends at that line; CUDA backward runs on an
autograd worker thread with no Python frames, and the join is the only link.
PyTorch does not expose a node's forward thread to Python: the forward op is
the one with that `seq` on whichever thread ran the forward (usually one).

What it misses, compared with the profiler:
  - CompositeImplicitAutograd ops are seen decomposed: `aten::linear` shows as
    `aten::t` + `aten::addmm` (decomposition happens above the mode).
  - ops called by another op's kernel (the profiler's nested `aten::copy_`,
    `aten::as_strided`, ...): the mode is off while an op runs, so only the
    outermost op is seen; likewise ops inside an eager higher-order operator
    (torch.cond, flex_attention) are one event named `higher_order::<name>`.
  - threads that were already running when the source started; threads started
    later get the mode through threading's trace hook, autograd workers inherit it.
  - regions compiled by torch.compile (Inductor's fused kernels are not aten
    ops; the mode ignores compile internals): use the `cuda`/`triton` sources.
  - ops dispatched with Python dispatch disabled (`torch._C._DisableTorchDispatch`).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

from tbpipe import _native
from tbpipe.capture import after_import


@dataclass
class TorchOpsHandle:
    status: str


class _State:
    def __init__(self) -> None:
        self.mode: Any = None  # the one dispatch mode, made once torch is imported
        self.thread_trace: Any = None  # our threading.settrace hook while installed
        self.previous_thread_trace: Any = None
        self.lock = threading.RLock()


_state = _State()
_torch = after_import.AttachWhenImported("torch", "torch-ops", "PyTorch", lambda torch: _attach(torch), _state.lock)


def _after_fork_in_child() -> None:
    # A parent thread that held the lock at fork time does not exist in the
    # child; waiting for it would hang the child's session start.
    _state.lock = _torch.lock = threading.RLock()


def start() -> TorchOpsHandle:
    with _state.lock:
        status = _torch.start()
        _native._torch_ops_enable(True)
        return TorchOpsHandle(status)


def stop(handle: TorchOpsHandle | None = None) -> None:
    with _state.lock:
        _native._torch_ops_enable(False)
        _torch.cancel()
        _remove_thread_trace()
        _pop_if_on_top()


def counters() -> dict[str, int]:
    """Ops seen and recorded by the fast path since the process started."""
    return dict(_native._torch_ops_counters())


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


def _attach(torch: Any) -> None:
    if _state.mode is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        autograd = getattr(torch._C, "_autograd", None)
        sequence_nr = getattr(autograd, "_get_sequence_nr", None) or (lambda: -1)
        current_node = getattr(torch._C, "_current_autograd_node", None) or (lambda: None)
        _native._torch_ops_setup(torch.Tensor, sequence_nr, current_node, _resolve)
        _state.mode = _make_mode_class(TorchDispatchMode)()
    _push_on_this_thread()
    _install_thread_trace()


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


def _install_thread_trace() -> None:
    if _state.thread_trace is not None:
        return
    previous = _current_thread_trace()

    def push_mode_then_hand_over(frame: Any, event: str, arg: Any) -> Any:
        # Runs once, on the new thread's first call: push the mode, then give
        # the thread back to whichever tracer was installed before (usually none).
        sys.settrace(previous)
        try:
            _push_on_this_thread()
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
