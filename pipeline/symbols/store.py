"""The persistent symbol store: per build-ID, what debug info was found, its SymCache, and every
address ever symbolized against it.

Layout under the cache dir (TBPIPE_CACHE_DIR, else the user cache dir, else `--cache-dir`)::

    symbols-v1/<ab>/<abcdef...>/status.json           ModuleStatus: quality, file, why, where looked
    symbols-v1/<ab>/<abcdef...>/lock                  serializes builds of this build-ID
    symbols-v1/<ab>/<abcdef...>/<source>/symcache.zst SymCache (zstd), built once ever
    symbols-v1/<ab>/<abcdef...>/<source>/known-*.seg  resolved addresses (ResultChunk segments)
    debug-dirs/<hash>.json                            build-ID index of one --debug-dir
    modules/<hash>.json                               build-ID of a module file, by path + identity
    elf-facts/<hash>.json                             what the debug-info search read of an ELF file
                                                      (build-ID, sections, debuglink), likewise
    crc32/<hash>.json                                 CRC32 of a debuglink target, likewise

`<source>` is a key over the debug file's identity, so results from a worse file are never mixed
with results from a better one: when better debug info turns up, a new source directory is
filled and the old one removed. Every write is atomic (temporary file + rename), so concurrent
ingests and worker processes never see half a file; segments are only ever added, and merged
under the build-ID lock when there are many.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tbpipe.capture.cache import default_cache_dir
from tbpipe.pipeline.symbols.columns import KnownTable, ResultChunk
from tbpipe.pipeline.symbols.model import ModuleStatus, SymbolsError

STORE_VERSION = "symbols-v1"
_COMPACT_AFTER_SEGMENTS = 16


def source_key(debug_file: str | None, identity: tuple | list | None, quality: str, symcache_version: int) -> str:
    """Key of one debug-file identity (path, size, mtime, inode, device) + how it was read."""
    text = json.dumps([debug_file, list(identity) if identity else None, quality, symcache_version, STORE_VERSION])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _zstd():
    import zstandard

    return zstandard


# Kinds of per-file memos (folders under the cache dir).
MODULES_MEMO = "modules"
ELF_FACTS_MEMO = "elf-facts"
CRC32_MEMO = "crc32"


class SymbolStore:
    """Files of the symbol store; all methods are safe to call from several processes."""

    def __init__(self, cache_dir: str | os.PathLike | None = None):
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.root = self.cache_dir / STORE_VERSION
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.cache_dir / "debug-dirs").mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SymbolsError(
                f"cannot use {self.cache_dir} as the symbol store ({error.strerror or error}); "
                "set TBPIPE_CACHE_DIR or pass --cache-dir"
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise SymbolsError(f"symbol store {self.root} is not writable; set TBPIPE_CACHE_DIR or pass --cache-dir")

    # ---- paths

    def build_id_dir(self, build_id: str) -> Path:
        return self.root / build_id[:2] / build_id

    def source_dir(self, build_id: str, key: str) -> Path:
        return self.build_id_dir(build_id) / key

    def _memo_path(self, kind: str, path: str) -> Path:
        digest = hashlib.sha1(os.fsencode(path)).hexdigest()[:20]
        return self.cache_dir / kind / f"{digest}.json"

    def remembered(self, kind: str, path: str, identity: tuple) -> tuple[bool, Any]:
        """(known, value) of what was last learnt of the file at `path` under `kind`, while the file is
        unchanged (`identity` as `elf.file_identity` gives it): warm runs read no ELF."""
        try:
            memo = json.loads(self._memo_path(kind, path).read_text())
            if memo["identity"] == list(identity):
                return True, memo["value"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return False, None

    def remember(self, kind: str, path: str, identity: tuple, value: Any) -> None:
        """Keeps `value` (JSON) about the file at `path` while it stays `identity`."""
        data = json.dumps({"identity": list(identity), "value": value}).encode()
        with contextlib.suppress(OSError):
            self._write_atomic(self._memo_path(kind, path), data)

    def remembered_build_id(self, path: str, identity: tuple) -> tuple[bool, str | None]:
        """(known, build-ID) of the module file at `path` as last read, while it is unchanged."""
        return self.remembered(MODULES_MEMO, path, identity)

    def remember_build_id(self, path: str, identity: tuple, build_id: str | None) -> None:
        self.remember(MODULES_MEMO, path, identity, build_id)

    def debug_dir_index_path(self, directory: str) -> Path:
        digest = hashlib.sha1(os.fsencode(directory)).hexdigest()[:20]
        return self.cache_dir / "debug-dirs" / f"{digest}.json"

    # ---- atomic writes

    def _write_atomic(self, path: Path, data: bytes) -> None:
        import tempfile  # this and shutil below: imported when first needed, off the start-up path

        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(data)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    @contextlib.contextmanager
    def lock(self, build_id: str) -> Iterator[None]:
        """Exclusive lock on one build-ID (builds, upgrades and compaction)."""
        directory = self.build_id_dir(build_id)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "lock", "a+") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    # ---- status

    def load_status(self, build_id: str) -> ModuleStatus | None:
        path = self.build_id_dir(build_id) / "status.json"
        try:
            return ModuleStatus.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a damaged status is as good as none: the build-ID is looked up again

    def save_status(self, status: ModuleStatus) -> None:
        data = json.dumps(status.to_json(), indent=1, sort_keys=True).encode()
        self._write_atomic(self.build_id_dir(status.build_id) / "status.json", data)

    def forget_status(self, build_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.build_id_dir(build_id) / "status.json").unlink()

    def known_build_ids(self) -> list[str]:
        found = []
        for shard in sorted(self.root.glob("??")):
            found.extend(p.name for p in sorted(shard.iterdir()) if (p / "status.json").exists())
        return found

    # ---- SymCache

    def load_symcache(self, build_id: str, key: str) -> bytes | None:
        path = self.source_dir(build_id, key) / "symcache.zst"
        try:
            compressed = path.read_bytes()
        except OSError:
            return None
        try:
            return _zstd().ZstdDecompressor().decompress(compressed)
        except Exception:
            return None

    def has_symcache(self, build_id: str, key: str) -> bool:
        return (self.source_dir(build_id, key) / "symcache.zst").is_file()

    def save_symcache(self, build_id: str, key: str, data: bytes) -> None:
        compressed = _zstd().ZstdCompressor(level=3).compress(data)
        self._write_atomic(self.source_dir(build_id, key) / "symcache.zst", compressed)

    def drop_other_sources(self, build_id: str, keep: str | None) -> None:
        """Remove results of debug files other than `keep` (call under `lock`)."""
        import shutil

        directory = self.build_id_dir(build_id)
        if not directory.is_dir():
            return
        for child in directory.iterdir():
            if child.is_dir() and child.name != keep:
                shutil.rmtree(child, ignore_errors=True)

    # ---- known addresses

    def _segments(self, build_id: str, key: str) -> list[Path]:
        directory = self.source_dir(build_id, key)
        try:
            return sorted(directory.glob("known-*.seg"))
        except OSError:
            return []

    def load_known(self, build_id: str, key: str) -> KnownTable:
        """All stored results for (build-ID, source), merged; damaged segments are skipped."""
        table = KnownTable()
        segments = self._segments(build_id, key)
        decompressor = _zstd().ZstdDecompressor() if segments else None
        for path in segments:
            try:
                table.add(ResultChunk.from_bytes(decompressor.decompress(path.read_bytes())))
            except FileNotFoundError:
                continue  # compacted away by another process meanwhile
            except Exception:
                with contextlib.suppress(OSError):
                    path.unlink()  # damaged (e.g. disk full): drop it, the addresses get redone
        if len(segments) > _COMPACT_AFTER_SEGMENTS:
            self._compact(build_id, key, table, segments)
        return table

    def append_known(self, build_id: str, key: str, chunk: ResultChunk) -> None:
        if not len(chunk):
            return
        name = f"known-{time.time_ns():020d}-{os.urandom(4).hex()}.seg"
        data = _zstd().ZstdCompressor(level=1).compress(chunk.to_bytes())
        self._write_atomic(self.source_dir(build_id, key) / name, data)

    def _compact(self, build_id: str, key: str, table: KnownTable, segments: list[Path]) -> None:
        with self.lock(build_id):
            current = set(self._segments(build_id, key))
            if not set(segments) <= current:
                return  # someone else compacted meanwhile
            self.append_known(build_id, key, table.to_chunk())
            for path in segments:
                with contextlib.suppress(OSError):
                    path.unlink()
