"""Columnar symbolization results: (lookup address) -> inline chain, dictionary-encoded.

`ResultChunk` is what a resolver produces for a batch of addresses of one build-ID, what worker
processes send back, and what the store keeps on disk (one zstd-compressed segment per chunk).
`KnownTable` merges a build-ID's segments for lookups. Both are plain stdlib arrays, so the CLI
path never imports numpy/pyarrow (0.3 s of imports against a 0.3 s budget for 20k libc
addresses); `chunk_to_arrow` gives the Arrow table the DuckDB ingest loads.

Frames are stored raw (mangled names): demangling happens on the way out, so results improve
when a better demangler appears without re-symbolizing anything.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

# A resolved address as resolvers emit it: (lookup address, frames, reason); frames are
# (function, file, line, inlined) innermost first; line 0 means "no line".
Resolved = tuple

_SEGMENT_MAGIC = b"TBSYMSEG\x01\n"
_LITTLE = sys.byteorder == "little"


def _array(code: str, values: Iterable[int] = ()) -> array:
    return array(code, values)


@dataclass
class ResultChunk:
    """Resolved addresses of one build-ID, column by column."""

    keys: array = field(default_factory=lambda: _array("Q"))  # lookup address per entry
    counts: array = field(default_factory=lambda: _array("I"))  # frames per entry
    reasons: array = field(default_factory=lambda: _array("i"))  # string id per entry, -1 none
    functions: array = field(default_factory=lambda: _array("i"))  # string id per frame, -1 none
    files: array = field(default_factory=lambda: _array("i"))  # string id per frame, -1 none
    lines: array = field(default_factory=lambda: _array("I"))  # per frame, 0 none
    inlined: array = field(default_factory=lambda: _array("B"))  # per frame, 1 when inlined
    strings: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def from_columns(
        cls,
        strings: list[str],
        keys: Iterable[int],
        counts: Iterable[int],
        reasons: Iterable[int],
        functions: Iterable[int],
        files: Iterable[int],
        lines: Iterable[int],
        inlined: Iterable[int],
    ) -> ResultChunk:
        """A chunk from plain per-entry and per-frame columns (typed as the fields above)."""
        return cls(
            keys=_array("Q", keys),
            counts=_array("I", counts),
            reasons=_array("i", reasons),
            functions=_array("i", functions),
            files=_array("i", files),
            lines=_array("I", lines),
            inlined=_array("B", inlined),
            strings=strings,
        )

    @classmethod
    def from_resolved(cls, resolved: Sequence[Resolved]) -> ResultChunk:
        ids: dict[str, int] = {}
        strings: list[str] = []

        def intern(text: str | None) -> int:
            if text is None:
                return -1
            found = ids.get(text)
            if found is None:
                found = ids[text] = len(strings)
                strings.append(text)
            return found

        keys, counts, reasons = [], [], []
        functions, files, lines, inlined = [], [], [], []
        for key, frames, reason in resolved:
            keys.append(key)
            counts.append(len(frames))
            reasons.append(intern(reason))
            for function, file, line, is_inlined in frames:
                functions.append(intern(function))
                files.append(intern(file))
                lines.append(line or 0)
                inlined.append(1 if is_inlined else 0)
        return ResultChunk.from_columns(strings, keys, counts, reasons, functions, files, lines, inlined)

    # ---- on-disk segment: magic, one JSON header line, then the arrays little-endian

    def to_bytes(self) -> bytes:
        encoded = "\0".join(self.strings).encode("utf-8", "surrogatepass")
        columns = [self.keys, self.counts, self.reasons, self.functions, self.files, self.lines, self.inlined]
        header = {
            "entries": len(self.keys),
            "frames": len(self.functions),
            "strings": len(self.strings),
            "string_bytes": len(encoded),
        }
        parts = [_SEGMENT_MAGIC, json.dumps(header).encode() + b"\n"]
        for column in columns:
            if not _LITTLE:
                column = array(column.typecode, column)
                column.byteswap()
            parts.append(column.tobytes())
        parts.append(encoded)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> ResultChunk:
        if not data.startswith(_SEGMENT_MAGIC):
            raise ValueError("not a symbol segment")
        newline = data.index(b"\n", len(_SEGMENT_MAGIC))
        header = json.loads(data[len(_SEGMENT_MAGIC) : newline])
        entries, frames = int(header["entries"]), int(header["frames"])
        pos = newline + 1
        chunk = cls()
        for name, code, count in (
            ("keys", "Q", entries),
            ("counts", "I", entries),
            ("reasons", "i", entries),
            ("functions", "i", frames),
            ("files", "i", frames),
            ("lines", "I", frames),
            ("inlined", "B", frames),
        ):
            column = array(code)
            size = column.itemsize * count
            column.frombytes(data[pos : pos + size])
            if len(column) != count:
                raise ValueError("truncated symbol segment")
            if not _LITTLE:
                column.byteswap()
            setattr(chunk, name, column)
            pos += size
        if len(data) != pos + int(header["string_bytes"]):
            raise ValueError("truncated symbol segment")
        text = data[pos:].decode("utf-8", "surrogatepass")
        chunk.strings = text.split("\0") if header["strings"] else []
        if len(chunk.strings) != int(header["strings"]) or sum(chunk.counts) != frames:
            raise ValueError("inconsistent symbol segment")
        return chunk


class KnownTable:
    """Every stored result of one build-ID (one debug-file identity), merged for lookups."""

    def __init__(self) -> None:
        self.position: dict[int, int] = {}  # lookup address -> entry index
        self.starts = _array("Q")  # first frame of each entry
        self.counts = _array("I")
        self.reasons = _array("i")
        self.functions = _array("i")
        self.files = _array("i")
        self.lines = _array("I")
        self.inlined = _array("B")
        self.strings: list[str] = []
        self._string_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def sorted_index(self) -> tuple[Any, Any]:
        """(sorted lookup addresses, entry of each) as numpy arrays, for vectorized lookups."""
        import numpy as np

        cached = getattr(self, "_sorted", None)
        if cached is not None and cached[0] == len(self.counts):
            return cached[1], cached[2]
        keys = np.fromiter(self.position.keys(), dtype=np.uint64, count=len(self.position))
        entries = np.fromiter(self.position.values(), dtype=np.int64, count=len(self.position))
        order = np.argsort(keys, kind="stable")
        self._sorted = (len(self.counts), keys[order], entries[order])
        return self._sorted[1], self._sorted[2]

    def entries_of(self, keys: Any) -> Any:
        """Entry of each lookup address (numpy uint64 array); -1 where unknown."""
        import numpy as np

        sorted_keys, entries = self.sorted_index()
        if not len(sorted_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        at = np.searchsorted(sorted_keys, keys)
        at = np.minimum(at, len(sorted_keys) - 1)
        return np.where(sorted_keys[at] == keys, entries[at], -1)

    def add(self, chunk: ResultChunk) -> None:
        """Merge a chunk; an address already known keeps its first result."""
        if not len(chunk):
            return
        remap = self._remap(chunk.strings)
        position = self.position
        if position.keys().isdisjoint(chunk.keys):
            # The common case (a new segment): columns go over in bulk, ids remapped natively.
            from tbpipe import _native

            table = array("i", remap)
            next_entry = len(self.counts)
            self.starts.extend(accumulate(chunk.counts[:-1], initial=len(self.functions)))
            self.functions.frombytes(_native.remap_string_ids(chunk.functions, table))
            self.files.frombytes(_native.remap_string_ids(chunk.files, table))
            self.lines.extend(chunk.lines)
            self.inlined.extend(chunk.inlined)
            self.counts.extend(chunk.counts)
            self.reasons.frombytes(_native.remap_string_ids(chunk.reasons, table))
            # Reversed: of a key repeated within the chunk, the first entry wins, as below.
            position.update(zip(reversed(chunk.keys), range(next_entry + len(chunk.keys) - 1, next_entry - 1, -1)))
            return
        start = 0
        for i, count in enumerate(chunk.counts):
            key = chunk.keys[i]
            if key in position:
                start += count
                continue
            position[key] = len(self.counts)
            self.starts.append(len(self.functions))
            self.counts.append(count)
            reason = chunk.reasons[i]
            self.reasons.append(remap[reason] if reason >= 0 else -1)
            for j in range(start, start + count):
                f, p = chunk.functions[j], chunk.files[j]
                self.functions.append(remap[f] if f >= 0 else -1)
                self.files.append(remap[p] if p >= 0 else -1)
                self.lines.append(chunk.lines[j])
                self.inlined.append(chunk.inlined[j])
            start += count

    def _remap(self, strings: list[str]) -> list[int]:
        ids = self._string_ids
        table = self.strings
        out = []
        for text in strings:
            found = ids.get(text)
            if found is None:
                found = ids[text] = len(table)
                table.append(text)
            out.append(found)
        return out

    def frames_of(self, entry: int) -> list[tuple[str | None, str | None, int, bool]]:
        """Raw frames (function, file, line, inlined) of one entry."""
        strings = self.strings
        start = self.starts[entry]
        out = []
        for j in range(start, start + self.counts[entry]):
            f, p = self.functions[j], self.files[j]
            out.append(
                (strings[f] if f >= 0 else None, strings[p] if p >= 0 else None, self.lines[j], bool(self.inlined[j]))
            )
        return out

    def reason_of(self, entry: int) -> str | None:
        reason = self.reasons[entry]
        return self.strings[reason] if reason >= 0 else None

    def to_chunk(self) -> ResultChunk:
        """Everything as one chunk (for compaction)."""
        order = sorted(self.position.items())
        strings = list(self.strings)
        keys, counts, reasons = [], [], []
        functions, files, lines, inlined = [], [], [], []
        for key, entry in order:
            keys.append(key)
            counts.append(self.counts[entry])
            reasons.append(self.reasons[entry])
            start = self.starts[entry]
            end = start + self.counts[entry]
            functions.extend(self.functions[start:end])
            files.extend(self.files[start:end])
            lines.extend(self.lines[start:end])
            inlined.extend(self.inlined[start:end])
        return ResultChunk.from_columns(strings, keys, counts, reasons, functions, files, lines, inlined)


def arrow_schema() -> Any:
    """One row per frame: the `symbols` table shape (build_id, address) -> inline frames."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("build_id", pa.string(), nullable=False),
            pa.field("address", pa.uint64(), nullable=False),  # the captured (reported) address
            pa.field("exact", pa.bool_(), nullable=False),  # False: looked up at address - 1
            pa.field("depth", pa.int32(), nullable=False),  # 0 = innermost frame of the chain
            pa.field("function", pa.string()),
            pa.field("file", pa.string()),
            pa.field("line", pa.int32()),
            pa.field("inlined", pa.bool_(), nullable=False),
            pa.field("reason", pa.string()),  # why the address is (partly) unsymbolized
        ]
    )
