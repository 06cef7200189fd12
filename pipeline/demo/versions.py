"""Two nightly versions of the demo workload, each checked out into a folder of its own.

Version 1 is `workload.py` as shipped. Version 2 is "tonight's commit": twice the values (the
softmax launches double, the sort's gemm launches grow), a docstring added above `attention` (the
sites below it move down, their keys stay), and `layer` launches a new `layernorm_kernel`. The
report between the two shows each kind of change.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# (text in version 1, text in version 2)
TONIGHTS_COMMIT = [
    # Twice the values: the attention key (one softmax per value) launches twice as often.
    ("VALUES = [7, 3, 9, 1, 4, 8]\n", "VALUES = [7, 3, 9, 1, 4, 8] * 2\n"),
    # A docstring: every site below moves down, and keeps its key.
    (
        "def attention(scores: list[int]) -> list[int]:\n",
        'def attention(scores: list[int]) -> list[int]:\n    """Scores sorted by a key that launches\n'
        '    a softmax per value."""\n\n',
    ),
    # A new launch site.
    (
        "    return feed_forward(attention(values))\n",
        '    record("kernel_launch", "layernorm_kernel", grid=1, block=256)  # site: layer (new tonight)\n'
        "    return feed_forward(attention(values))\n",
    ),
]


def workload_text(version: int) -> str:
    text = resources.files("tbpipe.pipeline.demo").joinpath("workload.py").read_text(encoding="utf-8")
    if version == 1:
        return text
    for before, after in TONIGHTS_COMMIT:
        if before not in text:
            raise RuntimeError(f"the demo workload changed: cannot apply tonight's commit at {before.strip()!r}")
        text = text.replace(before, after)
    return text


def check_out(out_dir: Path, version: int) -> Path:
    """Writes version `version` of the workload into `out_dir/checkout-<version>/`; returns the script."""
    folder = out_dir / f"checkout-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "workload.py"
    script.write_text(workload_text(version), encoding="utf-8")
    return script
