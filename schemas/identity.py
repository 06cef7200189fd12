"""The identities of the raw format's things, defined once for the capture and the pipeline.

Each rule has its reference definition (plain Python or numpy, written to be read) beside its fast
paths, and tests/test_rules.py holds every fast path to the reference on random runs:

- **MD5 (low 64 bits)**, what DuckDB's `md5_number_lower` gives: reference `md5_low64_of` (hashlib);
  fast path `md5_low64` (the extension, over an Arrow string column's buffers or encoded texts).
- **module hash**: the MD5 of a module's key (`modulekey.ModuleKey`, its build-ID else its path).
  Reference `md5_low64_of(str(ModuleKey.of(build_id, path)))`; fast paths `module_hashes` (Python
  values: the capture) and `md5_low64` of `module_key_column` (Arrow columns: the ingest).
- **code hash**: a code object by (file, qualified name, first line): the MD5 of `code_key_text`.
  Fast paths `code_hashes` (Python values: the capture) and `code_hash_column` (Arrow: the ingest).
- **stack hash**: a stack's portable 64-bit identity over what its frames mean. Raw stack ids are
  content hashes too, but over per-process things (module indices, interned code ids); here native
  frames count by (module hash, ELF address, flags) and Python frames by (code hash, line, entry
  flag), so equal stacks of any run, process or host hash equally and are stored once. Reference
  `raw_stack_hashes` (a run's tables, frame by frame, through `stack_hashes`: splitmix64 per frame,
  then a polynomial over each frame list, all in wrapping uint64 arithmetic); fast path
  `hash_stack_lists` (native/stack_identity.cpp, one pass over a chunk's Arrow buffers), which the
  capture (`capture/writer.py`) and the ingest (`pipeline/stacks/flatten.py`) both call.

Every hash must stay the same across tbpipe and DuckDB versions: it keys rows of old databases and
lakes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe import _native
from tbpipe.schemas.modulekey import ModuleKey
from tbpipe.schemas.raw import NATIVE_FRAME_BY_FRAME_POINTER, NATIVE_FRAME_EVAL_LOOP, PYTHON_FRAME_LINE_RESOLVED

# ------------------------------------------------------------------------------- md5 and stack hash

_U64 = np.uint64
_MUL1 = _U64(0xBF58476D1CE4E5B9)
_MUL2 = _U64(0x94D049BB133111EB)
_NATIVE_BASE = _U64(0x9E3779B97F4A7C15)
_PYTHON_BASE = _U64(0xC2B2AE3D27D4EB4F)
_NATIVE_TAG = _U64(0x165667B19E3779F9)
_PYTHON_TAG = _U64(0x27D4EB2F165667C5)
_STATUS_MUL = _U64(0xD6E8FEB86659FD93)
_LENGTH_MUL = _U64(0xFF51AFD7ED558CCD)
MISSING = _U64(0x5BD1E9955BD1E995)  # stands for a module or code object the run does not describe


def md5_low64_of(text: str) -> int:
    """The reference: the low 64 bits of the text's MD5 (of its UTF-8 bytes, a lone surrogate as
    Python's `surrogatepass` writes it), read little-endian."""
    return int.from_bytes(hashlib.md5(text.encode("utf-8", "surrogatepass")).digest()[8:], "little")


def md5_low64(texts: pa.Array | pa.ChunkedArray | Iterable[str]) -> np.ndarray:
    """Low 64 bits of each text's MD5 (of its UTF-8 bytes), as uint64: what DuckDB's
    `md5_number_lower` gives, so stack hashes stored by older versions stay valid. An Arrow string
    column is hashed from its buffers in the extension; other texts are encoded first (a lone
    surrogate as Python's `surrogatepass` writes it)."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
    if not isinstance(texts, pa.Array):
        # Not through `pa.array`: it would import pandas in a captured program (capture/columns.py).
        encoded = [text.encode("utf-8", "surrogatepass") for text in texts]
        starts = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=starts[1:])
        return np.frombuffer(_native.md5_low64(starts, b"".join(encoded)), dtype=_U64)
    if texts.null_count:
        raise ValueError("md5_low64: a null among the texts")
    if pa.types.is_large_string(texts.type) or pa.types.is_large_binary(texts.type):
        offset_type = np.int64
    elif pa.types.is_string(texts.type) or pa.types.is_binary(texts.type):
        offset_type = np.int32
    else:
        raise TypeError(f"md5_low64: texts of type {texts.type}")
    if not len(texts):
        return np.zeros(0, dtype=_U64)
    _validity, offsets, data = texts.buffers()
    starts = np.frombuffer(offsets, dtype=offset_type)[texts.offset : texts.offset + len(texts) + 1]
    return np.frombuffer(_native.md5_low64(starts, data if data is not None else b""), dtype=_U64)


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (a new array)."""
    x = np.asarray(values, dtype=_U64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> _U64(30)
        x *= _MUL1
        x ^= x >> _U64(27)
        x *= _MUL2
        x ^= x >> _U64(31)
    return x


def native_frame_keys(module_hashes: np.ndarray, offsets: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Key of each native frame: its module's hash, ELF address and flags."""
    with np.errstate(over="ignore"):
        inner = mix64(offsets.astype(_U64) ^ _NATIVE_TAG) + flags.astype(_U64) * _STATUS_MUL
        return mix64(module_hashes.astype(_U64) ^ mix64(inner))


def python_frame_keys(code_hashes: np.ndarray, lines: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Key of each Python frame: its code object's hash, line and flags."""
    with np.errstate(over="ignore"):
        inner = mix64(lines.astype(np.int64).astype(_U64) ^ _PYTHON_TAG) + flags.astype(_U64) * _STATUS_MUL
        return mix64(code_hashes.astype(_U64) ^ mix64(inner))


def _powers(base: np.uint64, count: int) -> np.ndarray:
    out = np.empty(max(count, 1), dtype=_U64)
    out[0] = 1
    if count > 1:
        with np.errstate(over="ignore"):
            out[1:] = np.cumprod(np.full(count - 1, base, dtype=_U64), dtype=_U64)
    return out


def list_hashes(keys: np.ndarray, lengths: np.ndarray, base: np.uint64) -> np.ndarray:
    """Per list (given by its length; lists are consecutive in `keys`): sum of key_i * base**i mod 2**64."""
    lengths = lengths.astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if len(keys) == 0:
        return np.zeros(len(lengths), dtype=_U64)
    positions = np.arange(len(keys), dtype=np.int64) - np.repeat(starts, lengths)
    with np.errstate(over="ignore"):
        terms = keys.astype(_U64) * _powers(base, int(lengths.max()) + 1)[positions]
        running = np.concatenate([np.zeros(1, dtype=_U64), np.cumsum(terms, dtype=_U64)])
        # Wrapping subtraction of prefix sums gives each list's sum mod 2**64.
        return running[ends] - running[starts]


def stack_hashes(
    native_keys: np.ndarray,
    native_lengths: np.ndarray,
    python_keys: np.ndarray,
    python_lengths: np.ndarray,
    status: np.ndarray,
) -> np.ndarray:
    """One uint64 per stack from its frame keys (innermost first), list lengths and status bits."""
    native = list_hashes(native_keys, native_lengths, _NATIVE_BASE)
    python = list_hashes(python_keys, python_lengths, _PYTHON_BASE)
    with np.errstate(over="ignore"):
        shape = (
            native_lengths.astype(_U64) * _LENGTH_MUL
            + python_lengths.astype(_U64) * _MUL1
            + status.astype(_U64) * _STATUS_MUL
        )
        return mix64(mix64(native ^ _NATIVE_TAG) + mix64(python ^ _PYTHON_TAG) + mix64(shape))


def raw_stack_hashes(stacks: pa.Table, modules: pa.Table, code: pa.Table) -> np.ndarray:
    """The reference: the portable hash of each row of a raw run's `stacks` (schemas.raw), from the
    run's `modules` and `code` tables, frame by frame.

    - A native frame counts by its module's hash (of the first `modules` row of its index; MISSING
      for an index the run does not describe, a marker's -1 too), its address (0 for an eval-loop
      frame: where in the loop it was is noise) and its flags but how it was found (frame pointer).
    - A Python frame counts by its code object's hash (of the first `code` row of its id; for an id
      the run does not describe, mix64(id ^ MISSING)), its line and its flags but whether the line
      was resolved at capture.
    - A stack is `stack_hashes` of those keys, its two lists' lengths and its status bits.
    """
    module_hash: dict[int, int] = {}
    for index, build_id, path in zip(*(modules[name].to_pylist() for name in ("module_index", "build_id", "path"))):
        module_hash.setdefault(index, md5_low64_of(str(ModuleKey.of(build_id, path))))
    code_hash: dict[int, int] = {}
    for code_id, *key in zip(*(code[name].to_pylist() for name in ("code_id", "filename", "qualname", "first_line"))):
        code_hash.setdefault(code_id, md5_low64_of(code_key_text(*key)))

    def unknown_code(code_id: int) -> int:
        return int(mix64(np.array([code_id], _U64) ^ MISSING)[0])

    native_lists, python_lists = stacks["native"].to_pylist(), stacks["python"].to_pylist()
    native = [frame for frames in native_lists for frame in frames]
    python = [frame for frames in python_lists for frame in frames]
    native_keys = native_frame_keys(
        np.array([module_hash.get(f["module"], int(MISSING)) for f in native], _U64),
        np.array([0 if f["flags"] & NATIVE_FRAME_EVAL_LOOP else f["offset"] for f in native], _U64),
        np.array([f["flags"] & ~NATIVE_FRAME_BY_FRAME_POINTER for f in native], _U64),
    )
    python_keys = python_frame_keys(
        np.array([code_hash[c] if c in code_hash else unknown_code(c) for c in (f["code_id"] for f in python)], _U64),
        np.array([f["line"] for f in python], np.int64),
        np.array([f["flags"] & ~PYTHON_FRAME_LINE_RESOLVED for f in python], _U64),
    )
    return stack_hashes(
        native_keys,
        np.array([len(frames) for frames in native_lists], np.int64),
        python_keys,
        np.array([len(frames) for frames in python_lists], np.int64),
        np.array(stacks["status"].to_pylist(), np.uint32),
    )


def hash_stack_lists(
    status: pa.Array,
    native: pa.ListArray,
    python: pa.ListArray,
    module_index: np.ndarray,
    module_hash: np.ndarray,
    code_ids: np.ndarray,
    code_hash: np.ndarray,
) -> np.ndarray:
    """The fast path of `raw_stack_hashes`, in the extension: one pass over one chunk of a raw
    `stacks` table (its `status`, `native` and `python` columns), read in place from Arrow's buffers
    (no pyarrow.compute: the capture's writer calls it, where that would import pandas). The frames
    refer to modules by index (`module_index[i]` hashes to `module_hash[i]`) and to code objects by
    id (`code_ids[i]` to `code_hash[i]`); the first of a repeated index or id counts."""
    native_frames, python_frames = native.values, python.values
    hashed = _native.hash_raw_stacks(
        _values(status, pa.uint32(), np.uint32),
        _values(native.offsets, pa.int32(), np.int32),
        _values(native_frames.field("module"), pa.int32(), np.int32),
        _values(native_frames.field("offset"), pa.uint64(), np.uint64),
        _values(native_frames.field("flags"), pa.uint32(), np.uint32),
        _values(python.offsets, pa.int32(), np.int32),
        _values(python_frames.field("code_id"), pa.uint64(), np.uint64),
        _values(python_frames.field("line"), pa.int32(), np.int32),
        _values(python_frames.field("flags"), pa.uint32(), np.uint32),
        np.ascontiguousarray(module_index, dtype=np.int64),
        np.ascontiguousarray(module_hash, dtype=_U64),
        np.ascontiguousarray(code_ids, dtype=_U64),
        np.ascontiguousarray(code_hash, dtype=_U64),
    )
    return np.frombuffer(hashed, dtype=_U64)


def _values(array: pa.Array, arrow_type: pa.DataType, dtype: type) -> np.ndarray:
    """A fixed-width column without nulls as a numpy view of its buffer (cast first if its type differs)."""
    if array.type != arrow_type:
        array = array.cast(arrow_type)
    data = array.buffers()[1]
    if data is None or not len(array):
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * np.dtype(dtype).itemsize)


# ------------------------------------------------------------------------------ module and code hash

CODE_KEY_SEPARATOR = "\x1f"


def module_hashes(rows: Iterable[tuple[str | None, str | None]]) -> np.ndarray:
    """The hash of each module described by (build-ID note, path): MD5 of its key's text."""
    return md5_low64([str(ModuleKey.of(build_id, path)) for build_id, path in rows])


def code_key_text(filename: str, qualname: str, first_line: int) -> str:
    """The text a code object's hash is taken of (the reference definition)."""
    return f"{filename}{CODE_KEY_SEPARATOR}{qualname}{CODE_KEY_SEPARATOR}{first_line}"


def code_hashes(rows: Iterable[tuple[str, str, int]]) -> np.ndarray:
    """The hash of each (filename, qualname, first_line), from Python values."""
    return md5_low64([code_key_text(*row) for row in rows])


def code_hash_column(filename: pa.Array, qualname: pa.Array, first_line: pa.Array) -> np.ndarray:
    """`code_hashes` over Arrow columns (the ingest's path)."""
    texts = pc.binary_join_element_wise(filename, qualname, pc.cast(first_line, pa.string()), CODE_KEY_SEPARATOR)
    return md5_low64(texts)
