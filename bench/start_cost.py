"""What `tbpipe run` adds to the start (and end) of each Python process it captures.

    python bench/start_cost.py [--rounds N] [--torch]

Starts the same short programs with the plain interpreter and as `tbpipe run` starts them (its
autostart folder first on PYTHONPATH, the run's settings in the environment), alternating, and
prints the median wall time of each, the time added, and the ratio. The plain interpreter's start
is the anchor. Programs: `pass`; one `record()` event (its first part written at exit, so the
writer's libraries load); with --torch, `import torch` (torch-ops recording from the import on).
Then `tbpipe run -- python -c pass` whole, the CLI's own start included (paid once per command,
not per process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tbpipe.capture.autostart_session import environment_for_run
from tbpipe.capture.launch import autostart_dir
from tbpipe.capture.manifest import git_state

PROGRAMS = {
    "pass": ("pass", []),
    "one record() event": ("from tbpipe import capture; capture.record('user', 'x')", []),
    "import torch (torch-ops)": ("import torch", ["torch-ops"]),
}


def captured_env(out_dir: str, sources: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    here = os.getcwd()  # `tbpipe run` reads its folder's git state once for all its processes
    env.update(environment_for_run(out_dir, {"bench": "start"}, sources, {}, (here, git_state(here))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(autostart_dir()), env.get("PYTHONPATH", "")) if p)
    return env


def wall(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def compare(code: str, sources: list[str], rounds: int, out_dir: str) -> tuple[float, float]:
    """Median seconds of the plain and the captured start, measured alternately."""
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("TBPIPE_RUN_")}
    run_env = captured_env(out_dir, sources)
    command = [sys.executable, "-c", code]
    wall(command, plain_env), wall(command, run_env)  # warm the page cache
    plain, captured = [], []
    for _ in range(rounds):
        plain.append(wall(command, plain_env))
        captured.append(wall(command, run_env))
    return statistics.median(plain), statistics.median(captured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--torch", action="store_true", help="also `import torch` with torch-ops on")
    args = parser.parse_args()
    names = [name for name in PROGRAMS if args.torch or "torch" not in name]
    with tempfile.TemporaryDirectory(prefix="tbpipe-start-") as out_dir:
        print(f"{'program':28} {'plain s':>8} {'tbpipe run s':>13} {'added s':>8} {'ratio':>6}")
        for name in names:
            code, sources = PROGRAMS[name]
            plain, captured = compare(code, sources, args.rounds, out_dir)
            print(f"{name:28} {plain:8.3f} {captured:13.3f} {captured - plain:8.3f} {captured / plain:6.1f}x")
        runs = Path(out_dir) / "cli"
        cli = [sys.executable, "-m", "tbpipe.pipeline", "run", "--out", str(runs), "--", sys.executable, "-c", "pass"]
        whole = statistics.median(wall(cli, dict(os.environ)) for _ in range(max(3, args.rounds // 3)))
        print(
            f"{'tbpipe run -- python -c pass':28} {'':8} {whole:13.3f}   (the CLI's start included, once per command)"
        )


if __name__ == "__main__":
    main()
