"""A Spark standalone cluster on loopback for the lake's tests and the scale bench: one master and one
worker started with the installed pyspark's own `bin/spark-class`, as a user starts them on machines.

The worker is made unlike the driver the way a worker on another machine is: another working folder,
its own application folders (`--work-dir`), an environment without the driver's variables (no
TBPIPE_*, DEBUGINFOD_*, PYTHONPATH, another HOME), and a folder it sees empty: where unshare(1) can
give it a mount namespace of its own, `hidden` is a tmpfs there, so whatever the driver puts under
`hidden` is a path the executors cannot read, as a driver's local disk is to a cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The daemons' and executors' JVMs compile with the quick compiler only and collect on one thread:
# the tests' jobs are seconds long (see QUICK_JVM in tests/conftest.py).
QUICK_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_home() -> Path:
    """SPARK_HOME of the pip-installed pyspark: its package folder holds bin/spark-class and jars/."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _hidden_mount_works() -> str:
    """Why a worker cannot get a folder of its own (unshare + tmpfs), or ''."""
    if not shutil.which("unshare"):
        return "unshare(1) is not installed (util-linux)"
    probe = subprocess.run(
        [*_unshare(), "sh", "-c", 'mount -t tmpfs tbpipe-hidden "$0"', "/mnt"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return "" if probe.returncode == 0 else f"unshare --mount failed: {probe.stderr.strip()}"


def _unshare() -> list[str]:
    # Root makes a mount namespace outright; another user needs a user namespace in which it is root.
    return ["unshare", "--mount", "--propagation", "private", *(["--map-root-user"] if os.geteuid() else [])]


@dataclass
class StandaloneCluster:
    """A running master and worker; `url` is the master's spark:// URL."""

    root: Path
    url: str = ""
    hidden: Path | None = None  # a folder the worker's processes see empty (None: unshare unavailable)
    hidden_missing: str = ""  # why `hidden` is None
    worker_cwd: Path | None = None
    work_dir: Path | None = None  # the worker's application folders (executors run in subfolders)
    cores: int = 2
    processes: list[subprocess.Popen] = field(default_factory=list)

    def driver_conf(self, *, quick: bool = True, executor_memory: str = "1g") -> dict[str, str]:
        """Settings a driver on this machine needs to use the cluster: loopback, no UI, one executor
        with every core (`quick`: the quick JVM of the tests' short jobs)."""
        conf = {
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.executor.memory": executor_memory,
            "spark.cores.max": str(self.cores),
        }
        if quick:
            conf["spark.executor.extraJavaOptions"] = QUICK_JAVA_OPTIONS
        return conf

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def stop(self, timeout: float = 30) -> None:
        """Stops the worker (which stops its executors), then the master; kills what outlives `timeout`."""
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in reversed(self.processes):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.processes.clear()


def _daemon_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",  # every server of the daemons on loopback, their web UIs too
        "SPARK_DAEMON_JAVA_OPTS": QUICK_JAVA_OPTIONS,
        "SPARK_DAEMON_MEMORY": "256m",
    }
    if os.environ.get("JAVA_HOME"):
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    env.update(extra)
    return env


def _wait_for(cluster: StandaloneCluster, name: str, process: subprocess.Popen, pattern: str, deadline: float) -> str:
    """The first match of `pattern` in the daemon's log, waiting until `deadline` (monotonic)."""
    while time.monotonic() < deadline:
        found = re.search(pattern, cluster.log(name))
        if found:
            return found.group(1) if found.groups() else found.group(0)
        if process.poll() is not None:
            break
        time.sleep(0.2)
    cluster.stop()
    raise RuntimeError(f"the Spark {name} did not start ({pattern!r} not logged):\n{cluster.log(name)[-3000:]}")


def start_cluster(root: Path, *, cores: int = 2, memory: str = "2g", timeout: float = 120) -> StandaloneCluster:
    """A master and a worker on 127.0.0.1 (ports chosen by the system), waiting at most `timeout`
    seconds for the worker to register. Logs are `root`/master.log and worker.log."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = StandaloneCluster(root=root, cores=cores)
    spark_class = str(spark_home() / "bin" / "spark-class")
    deadline = time.monotonic() + timeout
    master_home = root / "master"
    master_home.mkdir(exist_ok=True)
    # No REST submission server (it takes a fixed port, 6066); the web UI on a free port.
    env = _daemon_env(master_home, SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")
    command = [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0"]
    with open(root / "master.log", "wb") as log:
        master = subprocess.Popen(
            [*command, "--webui-port", "0"], cwd=master_home, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    cluster.processes.append(master)
    cluster.url = _wait_for(cluster, "master", master, r"Starting Spark master at (spark://[0-9.]+:\d+)", deadline)
    _wait_for(cluster, "master", master, r"elected leader", deadline)

    cluster.worker_cwd = root / "worker"
    cluster.work_dir = root / "worker-apps"
    cluster.worker_cwd.mkdir(exist_ok=True)
    cluster.work_dir.mkdir(exist_ok=True)
    worker = [
        spark_class, "org.apache.spark.deploy.worker.Worker", cluster.url, "--host", "127.0.0.1", "--port", "0",
        "--webui-port", "0", "--cores", str(cores), "--memory", memory, "--work-dir", str(cluster.work_dir),
    ]  # fmt: skip
    cluster.hidden_missing = _hidden_mount_works()
    if not cluster.hidden_missing:
        cluster.hidden = root / "driver-only"
        cluster.hidden.mkdir(exist_ok=True)
        worker = [
            *_unshare(),
            "sh",
            "-c",
            'mount -t tmpfs tbpipe-hidden "$0" && exec "$@"',
            str(cluster.hidden),
            *worker,
        ]
    with open(root / "worker.log", "wb") as log:
        process = subprocess.Popen(
            worker, cwd=cluster.worker_cwd, env=_daemon_env(cluster.worker_cwd), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    cluster.processes.append(process)
    _wait_for(cluster, "worker", process, r"Successfully registered with master", deadline)
    return cluster


# ------------------------------------------------------------------------------------------ an environment to ship

_OWN = ("tbpipe", "_editable_skbc_tbpipe", "__pycache__")


def venv_with_installed_tbpipe(target: Path) -> Path:
    """A venv (this interpreter's base Python) holding tbpipe as a wheel installs it: the package
    folders copied as pyproject.toml maps them into the `tbpipe` namespace, the compiled extension
    beside them, and a dist-info without an editable marker. Its other packages are links to this
    environment's, so the archive `tbpipe lake package` makes of it stays small: it runs on this
    machine only, where the links resolve, which is what the tests need of it."""
    import sysconfig

    import tomllib

    import tbpipe

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=120)
    ours = Path(sysconfig.get_paths()["purelib"])
    (theirs,) = target.glob("lib/python*/site-packages")
    for entry in ours.iterdir():
        if not entry.name.startswith(_OWN):
            (theirs / entry.name).symlink_to(entry)
    checkout = Path(__file__).resolve().parents[2]
    wheel = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["scikit-build"]["wheel"]
    ignore = shutil.ignore_patterns("__pycache__")
    for inside, folder in wheel["packages"].items():
        shutil.copytree(checkout / folder, theirs / inside, ignore=ignore)
    built = next(Path(p) for p in tbpipe.__path__ if any(Path(p).glob("_native*.so")))
    for extension in built.glob("_native*.so"):
        shutil.copy2(extension, theirs / "tbpipe" / extension.name)
    (info,) = ours.glob("tbpipe-*.dist-info")
    shutil.copytree(info, theirs / info.name, ignore=shutil.ignore_patterns("direct_url.json", "RECORD"))
    (theirs / info.name / "RECORD").write_text("")
    return target
