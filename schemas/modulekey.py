"""The name of a native module everywhere in tbpipe: its build-ID, else its path, else the garbage it had.

A raw run describes each loaded ELF object by path and build-ID note. Most have a valid build-ID,
which names the object on any machine; some have none (then the path is all there is), and a
damaged capture may carry text that cannot be a build-ID. `ModuleKey` is that choice as one type
with one text encoding, used by the capture (its stack hashes: `identity`), the symbolizer's
per-module state, the ingest's symbol requests and the database's `module_key` columns:

    <hex>           a valid build-ID, lower case, without 0x
    path:<path>     an object without a build-ID note, by the path it was loaded from
    invalid:<text>  a build-ID note that is not 2..64 bytes of hex (its text, cut at 200 characters)

`ModuleKey.of` is the definition; `module_key_column` computes the same over Arrow columns (the
ingest's path). Pure Python at import: the symbolizer's start-up path (addr2line) imports it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

# Build-IDs are 1..64 bytes in practice: 20 (SHA-1, the GNU default), 16 (md5/uuid), 8 (xxhash
# from lld). Anything outside this is garbage from a broken capture, not a real note.
BUILD_ID_PATTERN = r"^(?:[0-9a-f]{2}){2,64}$"
_BUILD_ID_RE = re.compile(BUILD_ID_PATTERN)


def normalized_build_id(text: str) -> str | None:
    """The build-ID as lower-case hex without 0x, or None when `text` cannot be one."""
    if not isinstance(text, str):
        return None
    lowered = text.strip().lower()
    if lowered.startswith("0x"):
        lowered = lowered[2:]
    return lowered if _BUILD_ID_RE.match(lowered) else None


PATH_PREFIX = "path:"
INVALID_PREFIX = "invalid:"
INVALID_TEXT_LIMIT = 200  # characters of a garbage build-ID kept in its key


class KeyKind(enum.Enum):
    BUILD_ID = "build_id"
    PATH = "path"
    INVALID = "invalid"


@dataclass(frozen=True)
class ModuleKey:
    kind: KeyKind
    value: str  # the build-ID (hex), the path, or the garbage text

    @classmethod
    def of(cls, build_id: str | None, path: str | None) -> ModuleKey:
        """The key of a module described by its build-ID note (None or '' when it has none) and path."""
        if build_id:
            normalized = normalized_build_id(build_id)
            if normalized is not None:
                return cls(KeyKind.BUILD_ID, normalized)
            return cls(KeyKind.INVALID, str(build_id)[:INVALID_TEXT_LIMIT])
        if path:
            return cls(KeyKind.PATH, path)
        return cls(KeyKind.INVALID, "")

    @classmethod
    def parse(cls, text: str) -> ModuleKey:
        """The key whose encoding is `text` (the inverse of `str(key)`)."""
        if text.startswith(PATH_PREFIX):
            return cls(KeyKind.PATH, text[len(PATH_PREFIX) :])
        if text.startswith(INVALID_PREFIX):
            return cls(KeyKind.INVALID, text[len(INVALID_PREFIX) :])
        return cls(KeyKind.BUILD_ID, text)

    def __str__(self) -> str:
        if self.kind is KeyKind.BUILD_ID:
            return self.value
        prefix = PATH_PREFIX if self.kind is KeyKind.PATH else INVALID_PREFIX
        return prefix + self.value

    @property
    def build_id(self) -> str | None:
        """The valid build-ID, or None."""
        return self.value if self.kind is KeyKind.BUILD_ID else None

    @property
    def symbolizer_build_id(self) -> str:
        """What `ModuleRef.build_id` takes for this module: '' when it is known by path alone."""
        return "" if self.kind is KeyKind.PATH else self.value


# Keys already computed, by (build-ID, path): a night's runs load the same modules, and looking a
# run's few pairs up costs far less than the column operations.
_KEY_MEMO: dict[tuple[str | None, str | None], str] = {}
_KEY_MEMO_LIMIT = 1 << 16
_MEMO_ROWS = 4096  # longer columns go straight to the column operations


def module_key_column(build_id: pa.Array, path: pa.Array) -> pa.Array:
    """`str(ModuleKey.of(b, p))` for every row of two string columns."""
    import pyarrow as pa  # here: the symbolizer's start-up path imports this module, not pyarrow

    if len(build_id) > _MEMO_ROWS:
        return _key_column(build_id, path)
    pairs = list(zip(build_id.to_pylist(), path.to_pylist()))
    memo = _KEY_MEMO
    try:
        return pa.array([memo[pair] for pair in pairs], pa.string())
    except KeyError:
        pass
    keys = _key_column(build_id, path)
    if len(memo) < _KEY_MEMO_LIMIT:
        memo.update(zip(pairs, keys.to_pylist()))
    return keys


def _key_column(build_id: pa.Array, path: pa.Array) -> pa.Array:
    import pyarrow.compute as pc

    lowered = pc.utf8_lower(pc.utf8_trim_whitespace(build_id))
    lowered = pc.if_else(pc.starts_with(lowered, "0x"), pc.utf8_slice_codeunits(lowered, 2), lowered)
    valid = pc.fill_null(pc.match_substring_regex(lowered, BUILD_ID_PATTERN), False)
    absent = pc.or_kleene(pc.is_null(build_id), pc.equal(pc.fill_null(build_id, ""), ""))
    with_path = pc.and_(absent, pc.fill_null(pc.not_equal(pc.fill_null(path, ""), ""), False))
    by_path = pc.binary_join_element_wise(PATH_PREFIX, pc.fill_null(path, ""), "")
    garbage = pc.utf8_slice_codeunits(pc.fill_null(build_id, ""), 0, INVALID_TEXT_LIMIT)
    invalid = pc.binary_join_element_wise(INVALID_PREFIX, garbage, "")
    return pc.if_else(valid, lowered, pc.if_else(with_path, by_path, invalid))
