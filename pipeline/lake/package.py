"""`tbpipe lake package`: a virtual environment holding tbpipe packed for Spark's executors.

tbpipe's executors run its native extension, so a wheel on `--py-files` does not reach them (Python
cannot import an extension module out of a zip). What PySpark documents for compiled dependencies is
shipping a whole environment: a venv packed by `venv-pack`, given to the job with `spark.archives`
(unpacked in each executor's working folder) and `spark.pyspark.python` pointing into it. The venv
must hold tbpipe as installed from a wheel or an index: an editable install (`pip install -e`) only
points at a checkout on this machine, which executors elsewhere do not have.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tbpipe.pipeline.errors import UsageError

ARCHIVE_NAME = "tbpipe-env"  # the folder executors unpack the archive into (`#` fragment of spark.archives)

# Run by the venv's own interpreter: which tbpipe it imports, from where, and how it was installed.
_PROBE = """
import importlib.metadata as m, json, sys
import tbpipe.capture, tbpipe._native
dist = m.distribution("tbpipe")
direct = json.loads(dist.read_text("direct_url.json") or "{}")
print(json.dumps({
    "version": tbpipe.capture.__version__,
    "location": tbpipe.capture.__file__,
    "editable": bool(direct.get("dir_info", {}).get("editable")),
    "source": direct.get("url"),
    "python": "%d.%d" % sys.version_info[:2],
}))
"""


@dataclass
class Packed:
    archive: Path
    venv: Path
    version: str  # the tbpipe version the archive holds
    python: str  # its interpreter's major.minor

    def spark_conf(self) -> dict[str, str]:
        """The settings that make executors unpack the archive and run its interpreter."""
        return {
            "spark.archives": f"{self.archive}#{ARCHIVE_NAME}",
            "spark.pyspark.python": f"./{ARCHIVE_NAME}/bin/python",
        }


def running_venv() -> Path:
    """The virtual environment this tbpipe runs in."""
    if sys.prefix == sys.base_prefix:
        raise UsageError("tbpipe does not run in a virtual environment here: give --venv DIR (a venv holding tbpipe)")
    return Path(sys.prefix)


def probe_venv(venv: Path) -> dict:
    """What the venv's interpreter imports as tbpipe (see _PROBE); a clear error when it cannot."""
    python = venv / "bin" / "python"
    if not (venv / "pyvenv.cfg").is_file() or not python.exists():
        raise UsageError(f"{venv}: not a virtual environment (no pyvenv.cfg or bin/python)")
    result = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=venv)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"{venv}: its Python cannot import tbpipe and its extension ({last})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def package_venv(venv: Path, archive: Path, *, force: bool = False) -> Packed:
    """Packs `venv` into `archive` (.tar.gz, .tgz, .tar.bz2, .tar or .zip) with venv-pack."""
    venv = Path(venv).resolve()
    archive = Path(archive).resolve()
    if archive.exists() and not force:
        raise UsageError(f"{archive} exists (--force replaces it)")
    found = probe_venv(venv)
    if found["editable"]:
        raise UsageError(
            f"{venv}: tbpipe is installed there in editable mode (pip install -e), which points at "
            f"{found['source']} on this machine only; make a venv for the executors with "
            "`python -m venv V && V/bin/pip install 'tbpipe[spark]'` (or a wheel built by `pip wheel .`) and pass --venv V"
        )
    try:
        import venv_pack
    except ImportError as error:
        raise UsageError(f"packing needs venv-pack: pip install 'tbpipe[spark]' ({error})") from None
    archive.parent.mkdir(parents=True, exist_ok=True)
    try:
        venv_pack.pack(prefix=str(venv), output=str(archive), force=True)
    except venv_pack.VenvPackException as error:
        raise UsageError(f"{venv}: venv-pack refused it: {error}") from None
    return Packed(archive, venv, found["version"], found["python"])
