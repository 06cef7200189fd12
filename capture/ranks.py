"""Which rank of which job a process is: the labels `rank`, `local_rank`, `world_size`, `node`, `job`
(and `role=launcher` for a process that launches ranks but runs none).

Read, in this order, from:
1. the launchers' own environment variables (torchrun/elastic, SLURM, Open MPI, PMI), at start;
2. `torch.distributed`, once the program made its process group, when the environment said nothing
   (`torch.multiprocessing.spawn` and hand-rolled launches): `init_process_group` is wrapped after the
   program's own `import torch`, never imported here.

A captured launcher (torchrun, or a process calling `torch.multiprocessing.spawn`) passes its job id
to the processes it starts in `ENV_JOB`, so that it and its ranks share one: torchrun's
`TORCHELASTIC_RUN_ID` is a random id the launcher makes after start, or "none". A process with none
of these variables gets none of the labels.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from tbpipe.capture import after_import

RANK_KEYS = ("rank", "local_rank", "world_size", "node", "job")
ROLE_KEY = "role"
LAUNCHER = "launcher"
# Set by a captured launcher for everything it starts: the job id it and its ranks share.
ENV_JOB = "TBPIPE_RUN_JOB"
# Set by a captured torch.multiprocessing.spawn: how many processes it started on this node.
ENV_NPROCS = "TBPIPE_RUN_NPROCS"


class LauncherVariables(NamedTuple):
    """The variables one launcher sets in each rank's environment (None: it sets none for that label).
    A named tuple: a session's start imports nothing heavier (dataclasses pulls in inspect)."""

    name: str
    rank: str
    local_rank: str | None
    world_size: str | None
    node: str | None
    job: tuple[str, ...]  # SLURM's: job and step joined with '.'; the others': the first one set


# Innermost launcher first: torchrun run under srun sees both, and its ranks are torchrun's.
LAUNCHERS = (
    LauncherVariables("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", ("TORCHELASTIC_RUN_ID",)),
    LauncherVariables(
        "slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", ("SLURM_JOB_ID", "SLURM_STEP_ID")
    ),
    LauncherVariables(
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_NODE_RANK",
        ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"),
    ),
    LauncherVariables("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", None, ("PMIX_NAMESPACE", "PMI_KVSNAME")),
)
# Job ids that name no job: torchrun's default rendezvous id.
_NO_JOB = {"", "none"}


def _job_id(env: Mapping[str, str], names: tuple[str, ...], joined: bool) -> str | None:
    values = [env.get(name, "").strip() for name in names]
    if joined:
        # SLURM: one sbatch job runs many steps (each `srun` a launch of its own).
        return ".".join(v for v in values if v) if values[0] else None
    return next((v for v in values if v and v.lower() not in _NO_JOB), None)


def _given(values: dict[str, str | None]) -> dict[str, str]:
    return {k: v for k, v in values.items() if v}


def labels_from_environment(env: Mapping[str, str], parent_run_id: str | None = None) -> dict[str, str]:
    """The rank labels the first launcher whose rank variable is set gives; {} when none is.
    The job: a captured launcher's (ENV_JOB), else a launcher's own id, else the parent run's."""
    for launcher in LAUNCHERS:
        rank = env.get(launcher.rank, "").strip()
        if not rank:
            continue
        # The launcher's own job id, else an outer launcher's (torchrun's default names none; srun's does).
        ids = (_job_id(env, other.job, other.name == "slurm") for other in (launcher, *LAUNCHERS))
        job = env.get(ENV_JOB) or next((i for i in ids if i), None) or parent_run_id

        def read(name: str | None) -> str | None:
            return env.get(name, "").strip() or None if name else None

        return _given(
            {
                "rank": rank,
                "local_rank": read(launcher.local_rank),
                "world_size": read(launcher.world_size),
                "node": read(launcher.node),
                "job": job,
            }
        )
    return {}


_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_torchrun_launcher(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether this process is torchrun's launcher (the elastic agent), by its command line."""
    if argv and os.path.basename(argv[0]) == "torchrun":
        return True
    return any(a == "-m" and b in _TORCHRUN_MODULES for a, b in zip(orig_argv, orig_argv[1:]))


def _rendezvous_id(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """torchrun's `--rdzv-id` as given (shared by the launchers of every node), unless `--standalone`
    makes a random one after start."""
    if "--standalone" in argv:
        return None
    given = env.get("PET_RDZV_ID")
    for i, arg in enumerate(argv):
        for option in ("--rdzv-id", "--rdzv_id"):
            if arg == option and i + 1 < len(argv):
                given = argv[i + 1]
            elif arg.startswith(option + "="):
                given = arg[len(option) + 1 :]
    return given if given and given.strip().lower() not in _NO_JOB else None


def launcher_labels(env: Mapping[str, str], job: str, node: str | None = None) -> dict[str, str]:
    """A launcher's labels; `job` is what it passes on to its ranks (ENV_JOB) unless it has one itself."""
    return _given({ROLE_KEY: LAUNCHER, "job": env.get(ENV_JOB) or job, "node": node})


def labels_at_start(run_id: str, parent_run_id: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's rank labels at session start. A torchrun launcher also puts its job id into
    the environment its ranks inherit (ENV_JOB)."""
    env = os.environ if env is None else env
    if is_torchrun_launcher(sys.argv, getattr(sys, "orig_argv", sys.argv)):
        labels = launcher_labels(env, _rendezvous_id(sys.argv[1:], env) or run_id, env.get("SLURM_NODEID"))
        if env is os.environ:
            os.environ[ENV_JOB] = labels["job"]
        return labels
    labels = labels_from_environment(env, parent_run_id)
    if not labels and env.get(ENV_JOB):  # started by a captured spawn: a rank once its group exists
        labels = {"job": env[ENV_JOB]}
    return labels


def labels_from_process_group(dist: Any, env: Mapping[str, str], parent_run_id: str | None) -> dict[str, str]:
    """The labels `torch.distributed`'s default process group gives (it exists); local rank and node
    where the environment says (a spawn of the whole world on one node: the rank, node 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    labels = {"rank": str(rank), "world_size": str(world)}
    if env.get("LOCAL_RANK"):
        labels["local_rank"] = env["LOCAL_RANK"]
    elif env.get(ENV_NPROCS) == str(world):
        labels.update(local_rank=str(rank), node="0")
    if env.get("GROUP_RANK"):
        labels["node"] = env["GROUP_RANK"]
    job = env.get(ENV_JOB) or parent_run_id
    if job:
        labels["job"] = job
    return labels


# ------------------------------------------------------------------------------------------ torch hooks

# Called with torch.distributed's c10d module once the program made its default process group.
_on_group: Callable[[Any], None] | None = None
# Called with nprocs when this process launches ranks with torch.multiprocessing; returns the job id
# they share (None: not a launcher, e.g. a rank that starts helpers).
_on_spawn: Callable[[int], str | None] | None = None


def watch_torch(on_group: Callable[[Any], None], on_spawn: Callable[[int], str | None]) -> None:
    """Wraps `torch.distributed.init_process_group` and `torch.multiprocessing.start_processes` to
    call these: now if the program imported them, else right after its own import does. The wraps
    stay for the process's life (the callbacks look for the active session); once per process."""
    global _on_group, _on_spawn
    first = _on_group is None
    _on_group, _on_spawn = on_group, on_spawn
    if not first:
        return
    for name, wrap in (
        ("torch.distributed.distributed_c10d", _wrap_init_process_group),
        ("torch.multiprocessing.spawn", _wrap_start_processes),
    ):
        module = after_import.fully_imported(name)
        if module is not None:
            wrap(module, already_imported=True)
        else:
            after_import.install(name, wrap)


def _wrapped(module: Any, name: str, wrapper: Callable[..., Any], package: str, already_imported: bool) -> None:
    """Puts `wrapper` in place of `module.name`; and in the package that re-exported it, when the
    package was imported before (otherwise it takes the wrapper when its import goes on)."""
    original = getattr(module, name)
    setattr(module, name, wrapper)
    parent = sys.modules.get(package)
    if already_imported and getattr(parent, name, None) is original:
        setattr(parent, name, wrapper)


def _group_made(c10d: Any) -> None:
    try:
        if _on_group is not None and c10d.is_initialized():
            _on_group(c10d)
    except Exception as error:  # the program's group stands; only the labels are missing
        print(f"tbpipe: no rank labels from the process group: {type(error).__name__}: {error}", file=sys.stderr)


def _wrap_init_process_group(c10d: Any, already_imported: bool = False) -> None:
    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _group_made(c10d)
        return result

    _wrapped(c10d, "init_process_group", init_process_group, "torch.distributed", already_imported)
    if already_imported:
        _group_made(c10d)


def _wrap_start_processes(spawn: Any, already_imported: bool = False) -> None:
    original = spawn.start_processes

    @functools.wraps(original)
    def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
        job = _on_spawn(int(nprocs)) if _on_spawn is not None else None
        if job:
            os.environ[ENV_JOB] = job
            os.environ[ENV_NPROCS] = str(int(nprocs))
        return original(fn, args, nprocs, *rest, **kwargs)

    # spawn() calls start_processes by its module-level name.
    _wrapped(spawn, "start_processes", start_processes, "torch.multiprocessing", already_imported)
