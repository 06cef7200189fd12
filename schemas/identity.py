"""The identities of the raw format's things, defined once for the capture and the pipeline.

Three rules live here, each with its reference definition beside its fast path:

- **module hash**: the MD5 (low 64 bits) of a module's key (`modulekey.ModuleKey`, its build-ID
  else its path); `module_hashes` over Python values, `md5_low64` of `module_key_column` over Arrow.
- **code hash**: a code object by (file, qualified name, first line): the MD5 (low 64 bits) of
  `code_key_text`; `code_hashes` over Python values, `code_hash_column` over Arrow columns.
- **stack hash**: a stack's portable 64-bit identity over what its frames mean. Raw stack ids are
  content hashes too, but over per-process things (module indices, interned code ids); here native
  frames count by (module hash, ELF address, flags) and Python frames by (code hash, line, entry
  flag), so equal stacks of any run, process or host hash equally and are stored once. The
  reference is `stack_hashes` in numpy (splitmix64 per frame, then a polynomial over each frame list,
  all in wrapping uint64 arithmetic); the fast path is the extension's `hash_raw_stacks`, which the
  capture (`capture/writer.py`) and the ingest (`pipeline/stacks/flatten.py`) both call.

Every hash must stay the same across tbpipe and DuckDB versions: it keys rows of old databases and
lakes. `md5_low64` is what DuckDB's `md5_number_lower` gives.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tbpipe import _native
from tbpipe.schemas.modulekey import ModuleKey

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
