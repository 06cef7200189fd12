"""Overhead of tbpipe's torch.compile hooks on a compiled CPU training step, measured in one process.

    python bench/compile_overhead.py [--quick] [--rounds N] [--steps N]

The step: the MLP of bench/torch_overhead.py (Linear 256->512->256->10 with ReLU, as a module of its
own), batch 64, cross-entropy, SGD, one intra-op thread; the model is wrapped in torch.compile (Inductor's C++
backend), so forward and backward run Inductor's generated code. After compilation, rounds of steps
alternate between the hooks detached and attached (`tbpipe.capture.torch_compile.start/stop`: the
structured-trace handler and Dynamo's compile callbacks), all inside one session whose only source is
`triton` (on the CPU it records nothing, but it makes the session follow torch.compile: every flush
reads Inductor's line maps). Each round ends with a flush, inside the timed region. Time is the CPU
time of the stepping thread per step; the ratio of an "on" round is taken against its neighbouring
"off" rounds and the median printed, with the calls PyTorch made into the hooks during the timed
rounds (0: nothing of ours runs per step).

Compile time with the hooks attached is measured too (they format the structured trace's artifacts,
as TORCH_TRACE does): a fresh compile of the model (`torch._dynamo.reset()`), Inductor's caches warm,
alternately without and with the hooks; medians.

Target (issue 17): no overhead measurable after compilation.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
import warnings

try:
    import torch
    from torch import nn
except ImportError:
    sys.exit("bench/compile_overhead.py needs PyTorch (pip install torch); it is not installed for this Python")

from tbpipe import capture
from tbpipe.capture import torch_compile


class Mlp(nn.Module):
    """The MLP, with a forward of user code (so its graph nodes carry stack traces to map)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 512), nn.Linear(512, 256), nn.Linear(256, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.fc3(h)


def make_step():
    torch.manual_seed(0)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(64, 256)
    y = torch.randint(0, 10, (64,))
    compiled = torch.compile(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(compiled(x), y)
        loss.backward()
        optimizer.step()

    return step


def timed_round(step, steps: int, session: capture.Session, hooks: bool) -> float:
    """CPU seconds per step for one round, the flush that ends it included."""
    if hooks:
        torch_compile.start()
    cpu = time.thread_time()
    for _ in range(steps):
        step()
    session.flush()
    spent = (time.thread_time() - cpu) / steps
    if hooks:
        torch_compile.stop()
    return spent


def compile_seconds(hooks: bool, cold: bool = False) -> float:
    """Wall seconds of a fresh compile and first step of the model, with or without the hooks; `cold`:
    with Inductor's and AOTAutograd's caches off (every graph compiled from scratch)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    if hooks:
        torch_compile.start()
    step = make_step()
    with inductor_config.patch(force_disable_caches=cold):
        began = time.perf_counter()
        step()
        spent = time.perf_counter() - began
    if hooks:
        torch_compile.stop()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not a measurement)")
    parser.add_argument("--rounds", type=int, default=None, help="round pairs (default 30, quick 4)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 100, quick 20)")
    parser.add_argument("--compiles", type=int, default=None, help="compiles per side (default 5, quick 1)")
    parser.add_argument("--cold-compiles", type=int, default=None, help="cold compiles per side (default 3, quick 0)")
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 30)
    steps = args.steps or (20 if args.quick else 100)
    compiles = args.compiles or (1 if args.quick else 5)
    cold_compiles = args.cold_compiles if args.cold_compiles is not None else (0 if args.quick else 3)

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # said once per cold compile
    with tempfile.TemporaryDirectory() as out:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out, "inductor"))
        with capture.session(os.path.join(out, "runs"), sources=["triton"], flush_interval_s=1e9) as session:
            importlib.import_module("torch._dynamo")  # the session attaches once Dynamo is imported

            torch_compile.stop()  # the hooks are switched per round below
            compile_seconds(False)  # fill Inductor's caches: both sides below compile from them
            timings = {False: [], True: []}
            for index in range(compiles):  # each side goes first every other time
                for hooks in (False, True) if index % 2 == 0 else (True, False):
                    timings[hooks].append(compile_seconds(hooks))
            cold = {False: [], True: []}
            for index in range(cold_compiles):
                for hooks in (False, True) if index % 2 == 0 else (True, False):
                    cold[hooks].append(compile_seconds(hooks, cold=True))

            step = make_step()
            torch_compile.start()
            for _ in range(20):  # compile with the hooks, as a captured program would, and warm up
                step()
            torch_compile.stop()
            before = torch_compile.counters()
            ratios, off_times, on_times = [], [], []
            for _ in range(rounds):
                off = timed_round(step, steps, session, hooks=False)
                on = timed_round(step, steps, session, hooks=True)
                off_after = timed_round(step, steps, session, hooks=False)
                ratios.append(on / ((off + off_after) / 2))
                off_times += [off, off_after]
                on_times.append(on)
            after = torch_compile.counters()
            origins = session._origins_written

    calls = {key: after[key] - before[key] for key in after}
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread, {rounds} round pairs x {steps} steps")
    print(f"compiled step, hooks off     {statistics.median(off_times) * 1e3:8.3f} ms CPU")
    print(
        f"compiled step, hooks on      {statistics.median(on_times) * 1e3:8.3f} ms CPU   ratio {statistics.median(ratios):.3f}x "
        f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}; medians of per-round ratios)"
    )
    print(f"calls into the hooks while stepping: {calls}")
    print(f"code_origins rows written: {origins}")
    off_compile, on_compile = statistics.median(timings[False]), statistics.median(timings[True])
    print(
        f"fresh compile + first step   {off_compile:8.3f} s without hooks, {on_compile:.3f} s with "
        f"({on_compile / off_compile:.2f}x, {compiles} each, Inductor's caches warm)"
    )
    if cold_compiles:
        off_cold, on_cold = statistics.median(cold[False]), statistics.median(cold[True])
        print(
            f"cold compile + first step    {off_cold:8.3f} s without hooks, {on_cold:.3f} s with "
            f"({on_cold / off_cold:.2f}x, {cold_compiles} each, caches off)"
        )
    verdict = (
        "none measurable" if abs(statistics.median(ratios) - 1) < 0.02 and not any(calls.values()) else "MEASURABLE"
    )
    print(f"target: no overhead after compilation: {verdict}")


if __name__ == "__main__":
    main()
