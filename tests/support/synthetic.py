"""Synthetic but realistic run directories, for the ingest benchmark and for tests.

`write_run` writes a run directory in the raw format (schemas/) from Arrow tables, the way the
capture's writer does (zstd parts with the schema metadata, a manifest). `generate` makes many
runs whose stacks look like PyTorch programs': native frames at addresses inside the executable
ranges of ELF objects really loaded in this process (real build-IDs, so the symbolizer has real
debug info to work with), CPython eval-loop frames in libpython's eval ranges standing for
groups of Python frames from user code, site-packages and the standard library, and the
interpreter's outer frames. Events pick stacks Zipf-distributed; every run numbers its modules,
code objects and stacks its own way, as separate processes do, so the ingest has to recognize
equal stacks by content. All of it is built with numpy, column by column.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tbpipe.capture import __version__
from tbpipe.capture.writer import parquet_options
from tbpipe.schemas import raw


def _timestamp(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds")


def manifest_for(run_id: str, *, complete: bool = True, labels: dict[str, str] | None = None, **fields: Any) -> dict:
    """A valid manifest (as the capture writes it) with `fields` overriding its entries."""
    started = datetime(2026, 1, 1, tzinfo=timezone.utc)
    manifest = {
        "format": raw.FORMAT_NAME,
        "schema_version": raw.RAW_SCHEMA_VERSION,
        "run_id": run_id,
        "parent_run_id": None,
        "started_at": _timestamp(started),
        "ended_at": _timestamp(started + timedelta(minutes=5)) if complete else None,
        "updated_at": _timestamp(started + timedelta(minutes=5)),
        "complete": complete,
        "host": "synthetic",
        "pid": 4242,
        "argv": ["python", "train.py"],
        "cwd": "/srv/app",
        "python_version": "3.11.7",
        "python_implementation": "CPython",
        "torch_version": None,
        "tbpipe_version": __version__,
        "labels": dict(labels or {}),
        "sources": [],
        "capture": {"python": True, "native": True, "flush_interval_s": 1.0, "on_fork": "new_run"},
        "counters": {"events_recorded": 0, "events_dropped": 0, "events_written": 0, "stacks_written": 0},
        "files": {},
        "threads": {},
        "errors": [],
    }
    manifest.update(fields)
    return manifest


# Bumped whenever the parts are written differently, so that benches regenerate what they keep.
# 2: the capture's write options (page checksums, encodings); 3: events at zstd level 1; 4: raw schema 3
# (a launch's correlation id in a column of its own); 5: raw schema 4 (stack hashes written, as the
# capture writes them); 6: stack hashes without a dictionary; 7: raw schema 5 (an op's attributes in
# columns of their own)
PARTS_FORMAT = 7


def write_part(run_dir: Path, table_name: str, sequence: int, table: pa.Table) -> str:
    """One Parquet part of `table_name`, with the schema's metadata; returns its file name. Columns
    a later raw schema version added, which `table` lacks, are written as nulls."""
    schema = raw.RUN_TABLES[table_name]()
    for field_ in schema:
        if field_.name not in table.column_names and (table_name, field_.name) in raw.COLUMN_SINCE:
            table = table.append_column(field_, pa.nulls(table.num_rows, field_.type))
    name = raw.table_file_name(table_name, sequence)
    pq.write_table(table.cast(schema), run_dir / name, **parquet_options(schema.names))  # as the capture writes
    return name


def write_run(
    run_dir: Path,
    manifest: dict,
    tables: dict[str, pa.Table],
    event_parts: int = 1,
) -> Path:
    """A run directory: each table in one part (events split into `event_parts`), then the manifest."""
    run_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    for name in ("events", "stacks", "modules", "code"):
        table = tables.get(name)
        if table is None or table.num_rows == 0:
            continue
        pieces = event_parts if name == "events" else 1
        rows = table.num_rows
        for sequence in range(1, pieces + 1):
            lo, hi = rows * (sequence - 1) // pieces, rows * sequence // pieces
            if hi > lo:
                files.setdefault(name, []).append(write_part(run_dir, name, sequence, table.slice(lo, hi - lo)))
    manifest = dict(manifest)
    manifest["files"] = files
    counters = dict(manifest.get("counters") or {})
    events = tables.get("events")
    counters.setdefault("events_recorded", 0)
    counters["events_recorded"] = max(counters["events_recorded"], events.num_rows if events is not None else 0)
    counters["events_written"] = events.num_rows if events is not None else 0
    counters["stacks_written"] = tables["stacks"].num_rows if tables.get("stacks") is not None else 0
    manifest["counters"] = counters
    (run_dir / raw.MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return run_dir


# ------------------------------------------------------------------------------------ the corpus


@dataclass
class SyntheticConfig:
    runs: int = 40
    events: int = 10_000_000
    unique_stacks: int = 100_000
    zipf_s: float = 1.1  # stack popularity: P(rank r) ~ 1 / r**s
    native_addresses: int = 30_000  # distinct native (module, address) pairs the stacks draw from
    code_objects: int = 3_000
    threads_per_run: int = 4
    event_parts: int = 4  # events files per run (the capture rotates about once a second)
    max_modules: int | None = None  # use only this many of the loaded modules (libpython always)
    seed: int = 20260101
    written_hashes: bool = True  # stacks carry their hash, as the capture writes it (raw schema 4)


@dataclass
class LoadedModule:
    path: str
    build_id: str
    exec_ranges: list[tuple[int, int]]  # ELF virtual addresses
    eval_ranges: list[tuple[int, int]] = field(default_factory=list)


def loaded_modules() -> list[LoadedModule]:
    """ELF objects loaded in this process that have a build-ID and code (libpython, libc, extensions...)."""
    import importlib

    # Extension modules whose shared libraries make the module list look like a real program's.
    for name in ("ctypes", "decimal", "sqlite3", "ssl", "zlib"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    from tbpipe import _native

    out = []
    for module in _native._modules():
        path, build_id, bias = module["path"], module["build_id"], module["load_bias"]
        ranges = [(lo - bias, hi - bias) for lo, hi in module["exec_ranges"] if hi - lo > 4096]
        if not build_id or not ranges or not os.path.isabs(path):
            continue
        evals = [(lo - bias, hi - bias) for lo, hi in module["eval_ranges"] if hi - lo > 256]
        out.append(LoadedModule(path, build_id, ranges, evals))
    if not any(m.eval_ranges for m in out):
        raise RuntimeError("no CPython eval-loop range found among the loaded modules")
    return out


def _sample_addresses(rng: np.random.Generator, ranges: list[tuple[int, int]], count: int) -> np.ndarray:
    sizes = np.array([hi - lo for lo, hi in ranges], dtype=np.float64)
    which = rng.choice(len(ranges), size=count, p=sizes / sizes.sum())
    lows = np.array([lo for lo, _ in ranges], dtype=np.uint64)[which]
    spans = np.array([hi - lo for lo, hi in ranges], dtype=np.uint64)[which]
    return lows + (rng.random(count) * spans).astype(np.uint64)


@dataclass
class _Corpus:
    """Global stacks in a process-independent form: module = index into `modules`, code = index into `code`."""

    modules: list[LoadedModule]
    code: pa.Table  # filename, qualname, first_line (row = global code index)
    native_module: np.ndarray  # per frame (all stacks concatenated)
    native_offset: np.ndarray
    native_flags: np.ndarray
    native_lengths: np.ndarray  # per stack
    python_code: np.ndarray
    python_line: np.ndarray
    python_flags: np.ndarray
    python_lengths: np.ndarray
    kernel: np.ndarray  # per stack: index into KERNELS


KERNELS = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>",
    "ampere_sgemm_128x64_tn",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
    "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>",
    "triton_poi_fused_add_mul_0",
    "triton_red_fused_native_layer_norm_1",
    "void at::native::softmax_warp_forward<float, float, float, 10, false>",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
]

_USER_FILES = ["/srv/app/model/{}.py", "/srv/app/train/{}.py", "/srv/app/data/{}.py"]
_LIBRARY_FILES = [
    "/venv/lib/python3.11/site-packages/torch/nn/modules/{}.py",
    "/venv/lib/python3.11/site-packages/torch/_tensor{}.py",
    "/usr/lib/python3.11/{}.py",
]
_WORDS = ["attention", "mlp", "layer", "block", "embed", "norm", "loss", "optim", "loader", "module", "linear", "conv"]


def _code_objects(rng: np.random.Generator, count: int) -> pa.Table:
    user = rng.random(count) < 0.45
    file_pattern = np.where(user, rng.integers(0, len(_USER_FILES), count), rng.integers(0, len(_LIBRARY_FILES), count))
    file_word = rng.integers(0, len(_WORDS), count)
    files = pa.array(
        [
            (_USER_FILES if u else _LIBRARY_FILES)[p].format(_WORDS[w] + str(w % 3))
            for u, p, w in zip(user.tolist(), file_pattern.tolist(), file_word.tolist())
        ]
    )
    names = pc.binary_join_element_wise(
        pa.array([_WORDS[i] for i in rng.integers(0, len(_WORDS), count).tolist()]),
        pa.array([f"fn{i}" for i in range(count)]),
        ".",
    )
    first = rng.integers(1, 2000, count).astype(np.int32)
    return pa.table({"filename": files, "qualname": names, "first_line": first})


def _corpus(config: SyntheticConfig, modules: list[LoadedModule], rng: np.random.Generator) -> _Corpus:
    evals = [i for i, m in enumerate(modules) if m.eval_ranges]
    python_module = evals[0]
    others = [i for i in range(len(modules)) if i != python_module]

    # A pool of native addresses per role; stacks draw from them (real programs reuse return addresses).
    pool = config.native_addresses
    leaf_module = rng.choice(others, size=pool)
    leaf_offset = np.concatenate(
        [_sample_addresses(rng, modules[m].exec_ranges, int((leaf_module == m).sum())) for m in others]
    )
    leaf_module = np.concatenate([np.full(int((leaf_module == m).sum()), m) for m in others])
    capi_offset = _sample_addresses(rng, modules[python_module].exec_ranges, pool // 4)
    eval_offset = _sample_addresses(rng, modules[python_module].eval_ranges, 64)
    outer_offset = _sample_addresses(rng, modules[python_module].exec_ranges, 6)

    n = config.unique_stacks
    code = _code_objects(rng, config.code_objects)
    leaf_count = rng.integers(2, 9, n)  # native frames before the first eval-loop frame
    groups = rng.integers(2, 7, n)  # eval-loop frames (each with its Python group)
    group_sizes = rng.integers(1, 6, int(groups.sum()))  # Python frames per group
    capi_after = rng.integers(0, 4, int(groups.sum()))  # C-API frames between groups

    # Per stack, native frames: leaves, then per group (eval frame + C-API frames), then 3 outer frames.
    group_native = 1 + capi_after
    group_stack = np.repeat(np.arange(n), groups)
    native_lengths = leaf_count + np.bincount(group_stack, weights=group_native, minlength=n).astype(np.int64) + 3
    total_native = int(native_lengths.sum())
    native_module = np.empty(total_native, dtype=np.int64)
    native_offset = np.empty(total_native, dtype=np.uint64)
    native_flags = np.zeros(total_native, dtype=np.uint32)

    # Role of each native frame, laid out stack by stack (innermost first).
    stack_start = np.cumsum(native_lengths) - native_lengths
    position = np.arange(total_native) - np.repeat(stack_start, native_lengths)
    owner = np.repeat(np.arange(n), native_lengths)
    is_leaf = position < leaf_count[owner]
    is_outer = position >= native_lengths[owner] - 3
    middle = ~is_leaf & ~is_outer
    # Within the middle part, frames come in runs of (eval, capi...) per group.
    mid_owner_group = np.repeat(np.arange(len(group_native)), group_native)
    mid_in_group = np.arange(len(mid_owner_group)) - np.repeat(np.cumsum(group_native) - group_native, group_native)
    is_eval = np.zeros(total_native, dtype=bool)
    is_eval[np.flatnonzero(middle)] = mid_in_group == 0

    leaf_pick = rng.integers(0, len(leaf_offset), int(is_leaf.sum()))
    native_module[is_leaf] = leaf_module[leaf_pick]
    native_offset[is_leaf] = leaf_offset[leaf_pick]
    capi = middle & ~is_eval
    native_module[capi] = python_module
    native_offset[capi] = capi_offset[rng.integers(0, len(capi_offset), int(capi.sum()))]
    native_module[is_eval] = python_module
    native_offset[is_eval] = eval_offset[rng.integers(0, len(eval_offset), int(is_eval.sum()))]
    native_flags[is_eval] = raw.NATIVE_FRAME_EVAL_LOOP
    native_module[is_outer] = python_module
    native_offset[is_outer] = outer_offset[
        (position[is_outer] - (native_lengths[owner[is_outer]] - 3)).astype(np.int64)
    ]
    innermost = position == 0
    native_flags[innermost] |= raw.NATIVE_FRAME_EXACT_PC

    # Python frames: one group per eval frame, its last frame the entry frame.
    python_lengths = np.bincount(group_stack, weights=group_sizes, minlength=n).astype(np.int64)
    total_python = int(python_lengths.sum())
    group_of_frame = np.repeat(np.arange(len(group_sizes)), group_sizes)
    in_group = np.arange(total_python) - np.repeat(np.cumsum(group_sizes) - group_sizes, group_sizes)
    python_flags = np.where(in_group == group_sizes[group_of_frame] - 1, raw.PYTHON_FRAME_ENTRY, 0).astype(np.uint32)
    python_code = rng.integers(0, config.code_objects, total_python)
    first_lines = code["first_line"].to_numpy()
    python_line = (first_lines[python_code] + rng.integers(0, 60, total_python)).astype(np.int32)

    return _Corpus(
        modules=modules,
        code=code,
        native_module=native_module,
        native_offset=native_offset,
        native_flags=native_flags,
        native_lengths=native_lengths,
        python_code=python_code,
        python_line=python_line,
        python_flags=python_flags,
        python_lengths=python_lengths,
        kernel=rng.integers(0, len(KERNELS), n),
    )


def _take_lists(lengths: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For lists laid end to end: the frame indices of lists `chosen` (in order) and their lengths."""
    starts = np.cumsum(lengths) - lengths
    out_lengths = lengths[chosen]
    total = int(out_lengths.sum())
    first = np.repeat(starts[chosen], out_lengths)
    within = np.arange(total) - np.repeat(np.cumsum(out_lengths) - out_lengths, out_lengths)
    return first + within, out_lengths


def _list_array(lengths: np.ndarray, child: pa.StructArray) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), child)


def _run_tables(
    corpus: _Corpus, stacks_used: np.ndarray, events: np.ndarray, rng: np.random.Generator, run_index: int
) -> dict[str, pa.Table]:
    """One run's raw tables: its own module indices, code ids and raw stack ids."""
    n_modules = len(corpus.modules)
    module_index = rng.permutation(n_modules).astype(np.int32)  # global module -> this run's index
    code_ids = rng.integers(1, 2**63, len(corpus.code), dtype=np.int64).astype(np.uint64)
    raw_ids = rng.integers(1, 2**63, len(stacks_used), dtype=np.int64).astype(np.uint64)

    frames, native_lengths = _take_lists(corpus.native_lengths, stacks_used)
    native = pa.StructArray.from_arrays(
        [
            pa.array(module_index[corpus.native_module[frames]], pa.int32()),
            pa.array(corpus.native_offset[frames], pa.uint64()),
            pa.array(corpus.native_flags[frames], pa.uint32()),
        ],
        fields=list(raw.NATIVE_FRAME),
    )
    frames, python_lengths = _take_lists(corpus.python_lengths, stacks_used)
    python = pa.StructArray.from_arrays(
        [
            pa.array(code_ids[corpus.python_code[frames]], pa.uint64()),
            pa.array(np.zeros(len(frames), dtype=np.int32) + 10, pa.int32()),
            pa.array(corpus.python_line[frames], pa.int32()),
            pa.array(corpus.python_flags[frames], pa.uint32()),
        ],
        fields=list(raw.PYTHON_FRAME),
    )
    threads = (100_000 + run_index * 16 + np.arange(4)).astype(np.int64)
    stacks = pa.table(
        {
            "stack_id": pa.array(raw_ids, pa.uint64()),
            "thread_id": pa.array(np.full(len(stacks_used), threads[0]), pa.int64()),
            "status": pa.array(np.zeros(len(stacks_used), dtype=np.uint32), pa.uint32()),
            "native": _list_array(native_lengths, native),
            "python": _list_array(python_lengths, python),
        }
    )

    used_modules = np.unique(corpus.native_module[_take_lists(corpus.native_lengths, stacks_used)[0]])
    modules = pa.table(
        {
            "module_index": pa.array(module_index[used_modules], pa.int32()),
            "path": pa.array([corpus.modules[i].path for i in used_modules.tolist()], pa.string()),
            "build_id": pa.array([corpus.modules[i].build_id for i in used_modules.tolist()], pa.string()),
            "load_bias": pa.array(
                rng.integers(1, 2**40, len(used_modules)).astype(np.uint64) << np.uint64(12), pa.uint64()
            ),
            "exec_ranges": pa.array(
                [[{"lo": lo, "hi": hi} for lo, hi in corpus.modules[i].exec_ranges] for i in used_modules.tolist()],
                raw.modules_schema().field("exec_ranges").type,
            ),
            "eval_ranges": pa.array(
                [[{"lo": lo, "hi": hi} for lo, hi in corpus.modules[i].eval_ranges] for i in used_modules.tolist()],
                raw.modules_schema().field("eval_ranges").type,
            ),
        }
    )
    used_code = np.unique(corpus.python_code[_take_lists(corpus.python_lengths, stacks_used)[0]])
    code = corpus.code.take(pa.array(used_code)).append_column("code_id", pa.array(code_ids[used_code], pa.uint64()))
    code = code.select(["code_id", "filename", "qualname", "first_line"])

    count = len(events)
    local = np.searchsorted(stacks_used, events)
    start_ns = 1_767_225_600_000_000_000 + run_index * 3_600_000_000_000
    ts = start_ns + np.cumsum(rng.integers(2_000, 40_000, count))
    is_op = rng.random(count) < 0.15
    kernel = corpus.kernel[events]
    names = pc.if_else(
        pa.array(is_op),
        pa.array(np.array(["aten::mm", "aten::add", "aten::layer_norm", "aten::softmax"])[kernel % 4]),
        pa.array(np.array(KERNELS)[kernel]),
    )
    grid = rng.integers(1, 4096, count)
    attrs = pc.if_else(
        pa.array(is_op),
        pa.nulls(count, pa.string()),
        pc.binary_join_element_wise(
            '{"block": [128, 1, 1], "grid": [', pc.cast(pa.array(grid), pa.string()), ', 1, 1], "stream": 7}', ""
        ),
    )
    event_table = pa.table(
        {
            "ts": pa.array(ts, pa.int64()).view(pa.timestamp("ns", tz="UTC")),
            "thread_id": pa.array(threads[rng.integers(0, 4, count)], pa.int64()),
            "kind": pc.if_else(pa.array(is_op), "op", "kernel_launch"),
            "name": names,
            "stack_id": pa.array(raw_ids[local], pa.uint64()),
            "attrs": attrs,
            "correlation_id": pc.if_else(
                pa.array(is_op), pa.nulls(count, pa.uint32()), pa.array(np.arange(count) + 1, pa.uint32())
            ),
        }
    )
    return {"events": event_table, "stacks": stacks, "modules": modules, "code": code}


def with_written_hashes(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """The run's tables with each stack's hash in `stack_hash`, as the capture writes it."""
    from tbpipe.pipeline.stacks.flatten import flatten_run

    stacks = tables["stacks"]
    flat = flatten_run(tables)
    rows = np.searchsorted(flat.raw_ids, stacks["stack_id"].to_numpy())
    return {**tables, "stacks": stacks.append_column("stack_hash", pa.array(flat.hashes[rows], pa.uint64()))}


def zipf_choices(rng: np.random.Generator, ranks: int, s: float, count: int) -> np.ndarray:
    """`count` draws of ranks 0..ranks-1 with P(r) ~ 1 / (r + 1)**s."""
    weights = 1.0 / np.power(np.arange(1, ranks + 1, dtype=np.float64), s)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(count)), ranks - 1)


@dataclass
class Generated:
    root: Path
    runs: int
    events: int
    stacks_used: int  # distinct stacks the events use (of config.unique_stacks)
    modules: list[LoadedModule]


def generate(out_dir: Path, config: SyntheticConfig) -> Generated:
    """Writes `config.runs` run directories under `out_dir`."""
    rng = np.random.default_rng(config.seed)
    modules = loaded_modules()
    if config.max_modules is not None:
        # libpython (eval ranges) and libc first: every realistic stack has both.
        modules.sort(key=lambda m: (not m.eval_ranges, "libc.so" not in m.path, m.path))
        modules = modules[: max(2, config.max_modules)]
    corpus = _corpus(config, modules, rng)
    # Shuffle which stack is popular, so popularity is not tied to generation order.
    popularity = rng.permutation(config.unique_stacks)
    per_run = np.full(config.runs, config.events // config.runs)
    per_run[: config.events % config.runs] += 1
    used = np.zeros(config.unique_stacks, dtype=bool)
    out_dir.mkdir(parents=True, exist_ok=True)
    for index in range(config.runs):
        events = popularity[zipf_choices(rng, config.unique_stacks, config.zipf_s, int(per_run[index]))]
        stacks_used = np.unique(events)
        used[stacks_used] = True
        tables = _run_tables(corpus, stacks_used, events, rng, index)
        if config.written_hashes:
            tables = with_written_hashes(tables)
        run_id = f"20260101T{index // 3600:02d}{index // 60 % 60:02d}{index % 60:02d}-{4242 + index}-{int(rng.integers(0, 2**32)):08x}"
        manifest = manifest_for(
            run_id,
            labels={"suite": "synthetic", "commit": f"c{index % 5}"},
            pid=4242 + index,
            threads={
                str(t): f"worker-{i}"
                for i, t in enumerate(sorted(set(tables["events"]["thread_id"].to_pylist()[:1000])))
            },
        )
        write_run(out_dir / run_id, manifest, tables, event_parts=config.event_parts)
    # Stacks no event drew still count toward "unique stacks" only if used; report the truth.
    return Generated(out_dir, config.runs, int(per_run.sum()), int(used.sum()), modules)
