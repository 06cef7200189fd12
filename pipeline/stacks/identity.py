"""A stack's portable identity: a 64-bit hash over what its frames mean, defined here with numpy.

Raw stack ids are content hashes too, but over per-process things (module indices, interned code
ids), so the same stack gets different raw ids in different runs. Here native frames count by
(module build-ID, ELF address, flags) and Python frames by (file, qualified name, first line,
line, entry flag), so equal stacks of any run, process or host hash equally and are stored once.
(The address of CPython eval-loop frames is left out: they are replaced by the Python frames they
ran.)

The hash must stay the same across tbpipe and DuckDB versions (it keys `stacks` rows of old
databases), so it is spelled out here: splitmix64 mixing per frame, then a polynomial over the
frame keys of each list (position-dependent, so order matters), all in wrapping uint64 arithmetic
over whole columns at once. The ingest hashes every raw stack of every run, so `flatten` computes
the same function in the extension, in one pass over the Arrow columns
(native/stack_identity.cpp); the tests hold the two equal.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from tbpipe import _native

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


def md5_low64(texts: pa.Array | pa.ChunkedArray | Iterable[str]) -> np.ndarray:
    """Low 64 bits of each text's MD5 (of its UTF-8 bytes), as uint64: what DuckDB's
    `md5_number_lower` gives, so stack hashes stored by older versions stay valid. An Arrow string
    column is hashed from its buffers in the extension; other texts are encoded first (a lone
    surrogate as Python's `surrogatepass` writes it)."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
    if not isinstance(texts, pa.Array):
        texts = pa.array([text.encode("utf-8", "surrogatepass") for text in texts], pa.binary())
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
