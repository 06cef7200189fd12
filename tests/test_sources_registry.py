"""The built-in sources: registered without importing torch or triton, and clear when they cannot run.

These run on every Python: "not installed" is simulated with sys.modules[name] = None,
which is what importlib reports for a package that is not there.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import run_python
from support.runs import read_runs

from tbpipe import capture
from tbpipe.capture import SessionError
from tbpipe.capture.sources import known_source_names, resolve_sources


def test_builtin_sources_are_registered() -> None:
    assert {"torch-ops", "cuda", "triton"} <= set(known_source_names())
    assert [s.name for s in resolve_sources(["cuda", "torch-ops"])] == ["cuda", "torch-ops"]


def test_importing_tbpipe_does_not_import_torch_or_triton(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        import tbpipe.capture, tbpipe.capture.sources, tbpipe.capture.torch_ops
        import tbpipe.capture.cuda, tbpipe.capture.triton_launches
        assert "torch" not in sys.modules and "triton" not in sys.modules
        """
    )
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("source", "package", "message"),
    [
        ("torch-ops", "torch", "the torch-ops source needs PyTorch, which is not installed for this Python"),
        ("triton", "triton", "the triton source needs Triton, which is not installed for this Python"),
    ],
)
def test_missing_package_is_one_clear_error_and_no_run_is_left(
    tmp_path: Path, source: str, package: str, message: str
) -> None:
    runs = tmp_path / "runs"
    code = f"""
import sys
sys.modules[{package!r}] = None
from pathlib import Path
from tbpipe import capture
from tbpipe.capture import SourceError
try:
    capture.session({str(runs)!r}, sources=[{source!r}]).start()
except SourceError as error:
    print("ERROR:", error)
assert capture.active_session() is None
assert not list(Path({str(runs)!r}).glob("*")), "no run folder is left behind"
with capture.session({str(runs)!r}):  # the process can still record
    capture.record("user", "after")
"""
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [t for t in result.stdout.splitlines() if t.startswith("ERROR:")]
    assert message in line
    (run,) = read_runs(runs)
    assert run.tables["events"]["name"].to_pylist() == ["after"]


def test_missing_torch_under_tbpipe_run_is_one_line_and_the_program_runs_on(tmp_path: Path) -> None:
    # What the child of `tbpipe run --source torch-ops` does at start-up, in a Python without torch.
    code = f"""
import os, sys
sys.modules["torch"] = None
os.environ.update({{"TBPIPE_RUN_OUT": {str(tmp_path / "runs")!r}, "TBPIPE_RUN_SOURCES": "torch-ops"}})
from tbpipe.capture.autostart_session import start_from_environment
start_from_environment()
print("program ran")
"""
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "program ran" in result.stdout
    lines = [t for t in result.stderr.splitlines() if t.strip()]
    assert len(lines) == 1, result.stderr
    assert "torch-ops source needs PyTorch, which is not installed" in lines[0]


def test_a_source_failing_to_start_undoes_the_session(out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tbpipe.capture import sources

    stopped = []

    def boom() -> object:
        raise RuntimeError("cannot start")

    monkeypatch.setitem(sources._SOURCES, "ok", sources.Source("ok", "", lambda: "handle", stopped.append))
    monkeypatch.setitem(sources._SOURCES, "boom", sources.Source("boom", "", boom, lambda handle: None))
    with pytest.raises(RuntimeError, match="cannot start"):
        capture.session(out_dir, sources=["ok", "boom"]).start()
    assert stopped == ["handle"]
    assert capture.active_session() is None
    assert not any(out_dir.iterdir())
    with capture.session(out_dir, sources=["ok"]):
        capture.record("user", "x")
    (run,) = read_runs(out_dir)
    assert run.manifest["source_status"] == {"ok": "recording"}


@pytest.mark.parametrize("options", [{"sample_rate": 0}, {"sample_rate": 1.5}, {"max_events_per_stack_per_s": -1}])
def test_bad_overhead_options_are_refused(out_dir: Path, options: dict) -> None:
    with pytest.raises(SessionError):
        capture.session(out_dir, **options)
