"""The `triton` source: Triton's launch-enter hook, old and new API.

With the real Triton package (when it imports here) the tests check that the hook
is registered on, and removed from, Triton's own hook attributes. Without a GPU
Triton cannot launch a kernel, so where a launch is needed the test calls
Triton's own hook chain with Triton's own LazyDict, from a stand-in for the
launcher that has the launcher's grid locals (gridX, gridY, gridZ); a real
Triton launch is checked by tests/gpu/check_launch_sites.py on a GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_python
from support.runs import read_runs

from tbpipe import capture
from tbpipe.capture import triton_launches


def test_old_api_arguments_give_grid_and_name() -> None:
    compiled = SimpleNamespace(asm={}, metadata={"name": "add_kernel_0d1d"}, name="add_kernel_0d1d")
    args = (4, 2, 1, 4, 1, 1, 1, 1, 0, 123, 456, None, None, compiled, "tensor-a", "tensor-b")
    assert triton_launches.describe_launch(args, None) == ("add_kernel_0d1d", {"grid": [4, 2, 1]})


def test_metadata_is_read_without_evaluating_lazy_values() -> None:
    class LaterLazyDict:  # the shape of Triton >= 3.4's LazyDict: a plain dict in .data
        def __init__(self, data):
            self.data = data

        def get(self):
            raise AssertionError("the hook must not evaluate the kernel's launch_metadata")

    def launcher(gridX, gridY, gridZ, metadata):  # noqa: N803 - the launcher's own names
        return triton_launches.describe_launch((metadata,), __import__("sys")._getframe(0))

    metadata = LaterLazyDict({"name": "mul_kernel", "function": 77, "stream": 5})
    assert launcher(8, 1, 1, metadata) == ("mul_kernel", {"grid": [8, 1, 1], "stream": 5, "function": 77})
    older = {"name": "mul_kernel", "function": 77, "stream": 5, "flops": lambda: 1 / 0}  # 3.0-3.2: a dict subclass
    assert triton_launches.describe_launch((older,), None) == ("mul_kernel", {"stream": 5, "function": 77})


def test_single_callable_hook_keeps_and_restores_the_previous_one() -> None:
    seen = []
    owner = SimpleNamespace(launch_enter_hook=lambda *args: seen.append(args))
    previous = owner.launch_enter_hook
    undo = triton_launches._replace_single_hook(owner, "launch_enter_hook")
    assert owner.launch_enter_hook is not previous
    owner.launch_enter_hook({"name": "k"})
    assert seen == [({"name": "k"},)]  # the tool that was there still gets every launch
    undo()
    assert owner.launch_enter_hook is previous


@pytest.fixture(scope="module")
def triton():
    return pytest.importorskip("triton", reason="Triton does not import in this Python; the real-hook tests need it")


def _registered_hooks(triton) -> list:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    chain = getattr(runtime, "launch_enter_hook", None)
    if chain is not None and hasattr(chain, "calls"):
        return list(chain.calls)
    if runtime is not None and hasattr(runtime, "launch_enter_hook"):
        return [runtime.launch_enter_hook]
    from triton.compiler import CompiledKernel

    return [CompiledKernel.launch_enter_hook]


def test_hook_is_registered_on_triton_and_removed_after(triton, out_dir: Path) -> None:
    before = _registered_hooks(triton)
    with capture.session(out_dir, sources=["triton"]) as session:
        (_, handle) = session._source_handles[0]
        assert handle.status == "recording"
        assert handle.api in {"hook_chain", "knob", "compiled_kernel"}
        hooks = _registered_hooks(triton)
        assert triton_launches.launch_enter_hook in hooks or any(getattr(h, "__name__", "") == "hook" for h in hooks)
    assert _registered_hooks(triton) == before


def launch_through_triton(triton, gridX: int, gridY: int, gridZ: int, name: str) -> None:  # noqa: N803
    """Stand-in for Triton's launcher (no GPU here): same grid locals, Triton's own hook object and LazyDict."""
    from triton.compiler import LazyDict

    metadata = LazyDict({"name": name, "function": 0x7F00, "stream": 0})
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hook = runtime.launch_enter_hook if runtime is not None else triton.compiler.CompiledKernel.launch_enter_hook
    hook(metadata)


def test_launch_is_recorded_at_the_user_line(triton, out_dir: Path) -> None:
    with capture.session(out_dir, sources=["triton"]):
        launch_through_triton(triton, 16, 2, 1, "add_kernel")
    (run,) = read_runs(out_dir)
    (row,) = run.tables["events"].drop_columns(["ts"]).to_pylist()
    assert (row["kind"], row["name"]) == ("triton_launch", "add_kernel")
    assert json.loads(row["attrs"]) == {"grid": [16, 2, 1], "stream": 0, "function": 0x7F00}
    code = {c["code_id"]: c["qualname"] for c in run.tables["code"].to_pylist()}
    (stack,) = [s for s in run.tables["stacks"].to_pylist() if s["stack_id"] == row["stack_id"]]
    qualnames = [code[f["code_id"]] for f in stack["python"]]
    assert "launch_through_triton" in qualnames and "test_launch_is_recorded_at_the_user_line" in qualnames


def test_hook_waits_for_the_programs_own_import(triton, tmp_path: Path) -> None:
    code = f"""
import sys
from tbpipe import capture
from tbpipe.capture import triton_launches
with capture.session({str(tmp_path / "runs")!r}, sources=["triton"]) as session:
    assert "triton" not in sys.modules, "starting the source must not import triton"
    import triton
    print("INSTALLED", triton_launches._state.installed is not None)
print("STATUS", session._source_handles[0][1].status)
"""
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "INSTALLED True" in result.stdout
    assert "STATUS recording (from `import triton` on)" in result.stdout
