"""What runs in the worker processes of a bulk symbolization: SymCache builds and address batches.

Functions here take and return plain picklable values (paths, JSON dicts, bytes). A worker keeps
the resolvers it opened, so the chunks of one build-ID that land on the same worker decompress
its SymCache once.
"""

from __future__ import annotations

import gc
from array import array

from tbpipe.pipeline.symbols.model import ElfFileError, ModuleStatus, SymbolsError
from tbpipe.pipeline.symbols.resolve import ModuleResolver
from tbpipe.pipeline.symbols.store import SymbolStore
from tbpipe.pipeline.symbols.symcache import build_symcache

_resolvers: dict[tuple[str, str, str], ModuleResolver] = {}
_MAX_RESOLVERS = 64


def build(cache_dir: str, build_id: str, path: str, key: str) -> str | None:
    """Build and store the SymCache of `path` under (build_id, key); the error text on failure."""
    return build_keeping(cache_dir, build_id, path, key)[0]


def build_keeping(cache_dir: str, build_id: str, path: str, key: str) -> tuple[str | None, bytes | None]:
    """`build`, also returning the SymCache bytes when this call built them (so the caller can
    resolve with them right away instead of reading back and decompressing the stored copy)."""
    store = SymbolStore(cache_dir)
    try:
        with store.lock(build_id):
            if store.has_symcache(build_id, key):
                return None, None  # another process built it meanwhile
            data, _features = build_symcache(path, build_id)
            store.save_symcache(build_id, key, data)
    except (ElfFileError, SymbolsError) as error:
        return str(error), None
    except OSError as error:
        return f"{path}: {error.strerror or error}", None
    return None, data


def resolver_for(
    store: SymbolStore, status: ModuleStatus, identity: tuple | None, data: bytes | None = None
) -> ModuleResolver:
    """The (cached) resolver of one build-ID; raises ElfFileError when its SymCache is unusable.
    `data`: the SymCache bytes when the caller has them already."""
    cache_key = (str(store.cache_dir), status.build_id, status.source_key or "")
    resolver = _resolvers.get(cache_key)
    if resolver is None:
        if data is None and status.source_key:
            data = store.load_symcache(status.build_id, status.source_key)
        if data is None and status.source_key:
            raise ElfFileError(f"the stored SymCache of build-ID {status.build_id} is missing or damaged")
        resolver = ModuleResolver(status, data, identity)
        if len(_resolvers) >= _MAX_RESOLVERS:
            _resolvers.clear()
        _resolvers[cache_key] = resolver
    return resolver


def resolve(cache_dir: str, status_json: dict, identity: list | None, keys: bytes) -> tuple[bytes, list[int]]:
    """Resolve a batch of lookup addresses (array('Q') bytes); returns (chunk bytes, incomplete keys)."""
    store = SymbolStore(cache_dir)
    status = ModuleStatus.from_json(status_json)
    resolver = resolver_for(store, status, tuple(identity) if identity else None)
    batch = array("Q")
    batch.frombytes(keys)
    gc.disable()  # a worker allocates lists by the 10^5 and creates no cycles
    chunk, incomplete = resolver.resolve(batch.tolist())
    return chunk.to_bytes(), incomplete
