"""The bulk symbolization API: (module, addresses) -> inline chains, through the persistent store.

For each build-ID the symbolizer decides once per process what debug info to use (the stored
status, re-checked when it was "symbols only" or "nothing", since better files may have
appeared), builds its SymCache if the store does not have it, and resolves only the
(build-ID, address) pairs the store has never seen. New pairs are fanned out over worker
processes when there are enough of them; everything else is dictionary lookups.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tbpipe.pipeline.symbols.columns import KnownTable, ResultChunk
from tbpipe.pipeline.symbols.model import (
    BadBuildIdError,
    ElfFileError,
    ModuleRef,
    ModuleStatus,
    Quality,
    SymbolizedFrame,
    normalize_build_id,
)
from tbpipe.pipeline.symbols.store import SymbolStore, source_key
from tbpipe.schemas.modulekey import KeyKind, ModuleKey

# A warm `tbpipe addr2line` needs only the store and the result table: the locator (pyelftools),
# the resolver (symbolic), worker processes and the progress bar are imported when first used.
if TYPE_CHECKING:
    import concurrent.futures

    from tbpipe.pipeline.progress import DelayedProgress
    from tbpipe.pipeline.symbols.debuginfo import DebugInfoLocator, Located
    from tbpipe.pipeline.symbols.debuginfod import DebuginfodClient, DebuginfodSettings
    from tbpipe.pipeline.symbols.resolve import ModuleResolver

_MAX_ADDRESS = (1 << 64) - 1
# Below this many new addresses in one call, worker processes cost more than they save
# (~0.15 s to start two, plus shipping results back; in this process the extension resolves
# ~1-2 us per address, its SymCache lookups already spread over `jobs` threads).
_PARALLEL_MIN_ADDRESSES = 400_000
_CHUNK_ADDRESSES = 20_000


def available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _os_thread_count() -> int:
    """Threads of this process as the OS sees them (native threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC around bulk work that allocates ~10^5 lists and creates no cycles.

    With the frame caches alive, every few thousand allocations trigger a collection that
    walks them: 60% of the time of a 100k-address call on known addresses.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _symcache_version() -> int:
    from symbolic.symcache import SYMCACHE_LATEST_VERSION

    return int(SYMCACHE_LATEST_VERSION)


@dataclass
class _PendingBuild:
    build_id: str
    path: str
    key: str


@dataclass
class _ModuleState:
    """What this process knows about one module."""

    status: ModuleStatus
    persistent: bool  # results live in the store (the module has a build-ID)
    symcache: bytes | None = None  # just built here, or (no build-ID) never stored
    known: KnownTable | None = None
    frames: dict[int, list[SymbolizedFrame]] = field(default_factory=dict)  # lookup address -> demangled chain
    raw_frames: dict[int, list[SymbolizedFrame]] = field(default_factory=dict)  # lookup address -> mangled chain
    resolver: ModuleResolver | None = None


def _as_int_list(values: Any) -> list[int]:
    if hasattr(values, "tolist"):  # numpy arrays, array.array
        return values.tolist()
    if isinstance(values, list) and (not values or type(values[0]) is int):
        return values
    return [int(v) for v in values]  # tuples, generators, lists of numpy integers


def _as_bool_list(values: Any, count: int) -> list[bool]:
    if values is None:
        return [True] * count
    if isinstance(values, bool):
        return [values] * count
    if hasattr(values, "tolist"):
        values = values.tolist()
    values = list(values)
    if len(values) != count:
        raise ValueError(f"exact has {len(values)} entries for {count} addresses")
    return values


class Symbolizer:
    """Symbolizes addresses of ELF modules with debug info found by build-ID.

    `cache_dir`: the symbol store (None: TBPIPE_CACHE_DIR or the user cache dir);
    `debug_dirs`: extra folders searched recursively first; `debug_roots`: roots with a
    `.build-id/` tree (None: /usr/lib/debug); `jobs`: worker processes for bulk work (None: the
    CPUs this process may use); `progress`: show a progress bar on long work (None: when stderr
    is a terminal); `min_parallel_addresses`: below this many new addresses in one call the
    work stays in this process (worker processes cost more than they save); `debuginfod`: which
    servers to ask for what no local place has (None: `$DEBUGINFOD_URLS`); `on_download`: gets a
    line of text about downloads under way instead of a progress bar.

    One Symbolizer per thread: it caches per build-ID state and is not locked. Several
    processes may share one store. Call `close()` (or use it as a context manager) to stop
    its worker processes.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike | None = None,
        debug_dirs: Sequence[str | os.PathLike] = (),
        debug_roots: Sequence[str | os.PathLike] | None = None,
        jobs: int | None = None,
        progress: bool | None = None,
        *,
        min_parallel_addresses: int = _PARALLEL_MIN_ADDRESSES,
        debuginfod: DebuginfodSettings | None = None,
        on_download: Callable[[str], None] | None = None,
    ):
        self.store = SymbolStore(cache_dir)
        self._locator_args = (
            [os.path.abspath(os.fspath(d)) for d in debug_dirs],
            list(debug_roots) if debug_roots is not None else None,
        )
        self._locator: DebugInfoLocator | None = None
        self._debuginfod_settings = debuginfod
        self._on_download = on_download
        self._debuginfod: DebuginfodClient | None = None
        self.jobs = max(1, jobs if jobs is not None else available_cpus())
        self.progress = progress
        self.min_parallel_addresses = min_parallel_addresses
        self._states: dict[str, _ModuleState] = {}
        self._upgraded: set[str] = set()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    @property
    def locator(self) -> DebugInfoLocator:
        """The debug-info locator, made on first use (a warm store never needs it)."""
        if self._locator is None:
            from tbpipe.pipeline.symbols.debuginfo import DebugInfoLocator
            from tbpipe.pipeline.symbols.debuginfod import DebuginfodClient, DebuginfodSettings

            settings = self._debuginfod_settings or DebuginfodSettings()
            self._debuginfod = DebuginfodClient.from_settings(
                settings, progress=self.progress, describe=self._on_download
            )
            debug_dirs, debug_roots = self._locator_args
            self._locator = DebugInfoLocator(
                debug_dirs,
                debug_roots,
                index_path_for=self.store.debug_dir_index_path,
                memo=self.store,
                debuginfod=self._debuginfod,
                debuginfod_cache=settings.cache_dir,
            )
        return self._locator

    # ------------------------------------------------------------------ public API

    def build_id_of(self, path: str) -> str | None:
        """Build-ID of the ELF file at `path` (None when it has none), remembered in the store
        while the file is unchanged; ElfFileError for a missing or unreadable file."""
        from tbpipe.pipeline.symbols.elf import file_identity, read_build_id

        path = os.path.abspath(path)
        identity = file_identity(path)
        if identity is not None:
            known, build_id = self.store.remembered_build_id(path, identity)
            if known:
                return build_id
        build_id = read_build_id(path)
        if identity is not None and file_identity(path) == identity:
            self.store.remember_build_id(path, identity, build_id)
        return build_id

    def module_status(self, build_id: str, path: str | None = None) -> ModuleStatus:
        """What was found for `build_id` (DWARF / symbols only / nothing), where and why."""
        return self._state_for(ModuleRef(build_id, path)).status

    def module_statuses(self, modules: Iterable[tuple[str, str | None]]) -> list[ModuleStatus]:
        """`module_status` for many (build-ID, path) pairs, decided together (servers asked in parallel)."""
        refs = [ModuleRef(build_id, path) for build_id, path in modules]
        self._decide_states(refs)
        return [self._states[self._state_key(ref)].status for ref in refs]

    def preload(self, modules: Iterable[ModuleRef]) -> None:
        """Find debug info, build missing SymCaches and load stored results for `modules` now
        (e.g. in a thread while the addresses are still being read)."""
        refs = list(modules)
        self._decide_states(refs)
        for ref in refs:
            # The stored results, not the SymCache: when every address is known (the warm
            # case) the SymCache and symbol table are never opened.
            self._known(self._states[self._state_key(ref)])

    def debuginfod_report(self) -> list[str]:
        """One line per debuginfod server asked by this symbolizer (files, 404s, failures and why)."""
        return self._debuginfod.report() if self._debuginfod is not None else []

    def upgraded_build_ids(self) -> set[str]:
        """Build-IDs whose debug info got better in this process: re-symbolize their old frames."""
        return set(self._upgraded)

    def symbolize_module(
        self,
        module: ModuleRef,
        addresses: Sequence[int] | Any,
        exact: Sequence[bool] | Any | None = None,
        *,
        demangle: bool = True,
    ) -> list[list[SymbolizedFrame]]:
        """Inline chains (innermost first) for ELF virtual addresses of one module.

        `exact[i]` False means addresses[i] is a return address: it is looked up at
        address - 1 (the call instruction) while the result still stands for address.
        `exact` None means all exact (as addr2line treats its input).
        """
        return self.symbolize_many({module: (addresses, exact)}, demangle=demangle)[module]

    def symbolize_many(
        self,
        modules: Mapping[ModuleRef, tuple[Sequence[int] | Any, Sequence[bool] | Any | None]],
        *,
        demangle: bool = True,
    ) -> dict[ModuleRef, list[list[SymbolizedFrame]]]:
        """`symbolize_module` for many modules at once: unique pairs only, fanned out over processes."""
        resolved = self._resolve_keys(modules)
        out: dict[ModuleRef, list[list[SymbolizedFrame]]] = {}
        with gc_paused():
            for ref, (state, keys) in resolved.items():
                out[ref] = self._frames_for(state, keys, demangle)
        return out

    def symbolize_arrow(
        self,
        modules: Mapping[ModuleRef, tuple[Sequence[int] | Any, Sequence[bool] | Any | None]],
        *,
        demangle: bool = True,
        dictionary: bool = True,
    ) -> Any:
        """The same results as a pyarrow Table, one row per frame (`columns.arrow_schema`).

        The columnar path for the ingest: no Python object per frame. String columns are
        dictionary-encoded unless `dictionary=False`.
        """
        from tbpipe.pipeline.symbols.arrow import results_to_arrow

        return results_to_arrow(self._resolve_arrays(modules), demangle, dictionary)

    def entries(
        self, module: ModuleRef, addresses: Sequence[int] | Any, exact: Sequence[bool] | Any | None = None
    ) -> tuple[KnownTable, list[int], list[int]]:
        """Low level, for output formats: (the module's result table, lookup key and entry of
        each address). Entry -1 marks an invalid address. Callers format each distinct entry
        once instead of building SymbolizedFrame objects per address."""
        state, keys = self._resolve_keys({module: (addresses, exact)})[module]
        known = self._known(state)
        get_entry = known.position.get
        return known, keys, [get_entry(k, -1) for k in keys]

    def close(self) -> None:
        if self._debuginfod is not None:
            self._debuginfod.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Symbolizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ statuses

    def _state_key(self, ref: ModuleRef) -> str:
        # One garbage build-ID in a batch must not stop the others: its key is an INVALID one, and
        # its frames come back unsymbolized, with the reason.
        return str(ModuleKey.of(ref.build_id, os.path.abspath(ref.path) if ref.path else None))

    def _state_for(self, ref: ModuleRef) -> _ModuleState:
        key = self._state_key(ref)
        state = self._states.get(key)
        if state is None:
            self._decide_states([ref])
            state = self._states[key]
        return state

    def _decide_states(self, refs: Iterable[ModuleRef]) -> None:
        """Decide the status of every new module; build the SymCaches that are missing."""
        builds: list[tuple[str, ModuleStatus, _PendingBuild, ModuleStatus | None]] = []
        by_build_id: dict[str, tuple[ModuleRef, ModuleStatus | None]] = {}
        for ref in refs:
            key = self._state_key(ref)
            if key in self._states or key in by_build_id:
                continue
            kind = ModuleKey.parse(key).kind
            if kind is KeyKind.INVALID:
                self._states[key] = self._state_for_invalid(ref)
                continue
            if kind is KeyKind.PATH:
                self._states[key] = self._state_without_build_id(ref)
                continue
            by_build_id[key] = (ref, self.store.load_status(key))
        # Every module without usable DWARF searched at once: the servers are asked in parallel.
        searched = [(key, ref.path) for key, (ref, stored) in by_build_id.items() if not self._final(stored)]
        located = dict(zip((key for key, _path in searched), self.locator.locate_many(searched))) if searched else {}
        for key, (ref, stored) in by_build_id.items():
            if key in located:
                status, pending, previous = self._decide(key, ref.path, stored, located[key])
            else:
                status, pending, previous = stored, None, None
            if pending is None:
                self._states[key] = _ModuleState(status=status, persistent=status.quality is not Quality.NONE)
            else:
                builds.append((key, status, pending, previous))
        if builds:
            self._run_builds(builds)

    def _final(self, stored: ModuleStatus | None) -> bool:
        """A stored status nothing can improve on: DWARF, with its SymCache in the store."""
        return stored is not None and stored.quality is Quality.DWARF and self._usable(stored)

    def _decide(
        self, build_id: str, path: str | None, stored: ModuleStatus | None, located: Located
    ) -> tuple[ModuleStatus, _PendingBuild | None, ModuleStatus | None]:
        if stored is not None and self._usable(stored) and stored.quality.rank >= located.quality.rank:
            if stored.quality is Quality.NONE:
                # Nothing was found before and nothing now: keep the newest explanation.
                stored = self._status_from(located, path, stored)
                self._save_status(stored)
            return stored, None, None
        status = self._status_from(located, path, stored)
        if status.quality is Quality.NONE or self.store.has_symcache(build_id, status.source_key):
            self._finish_status(status, stored)
            return status, None, None
        return status, _PendingBuild(build_id, status.debug_file, status.source_key), stored

    def _usable(self, status: ModuleStatus) -> bool:
        if status.quality is Quality.NONE:
            return True
        return bool(status.source_key) and self.store.has_symcache(status.build_id, status.source_key)

    def _status_from(self, located: Located, path: str | None, previous: ModuleStatus | None) -> ModuleStatus:
        chosen = located.chosen
        if located.module is not None:
            segments = located.module.segments
        elif chosen is not None:
            segments = chosen.facts.segments
        else:
            segments = previous.segments if previous else []
        status = ModuleStatus(
            build_id=located.build_id,
            quality=located.quality,
            reason=located.reason(),
            module_path=path or (previous.module_path if previous else None),
            looked_in=list(located.looked_in),
            segments=list(segments),
            checked_at=time.time(),
        )
        if chosen is not None:
            identity = chosen.facts.identity
            status.debug_file = chosen.path
            status.found_via = chosen.via
            status.debug_identity = list(identity)
            status.source_key = source_key(chosen.path, identity, status.quality.value, _symcache_version())
        return status

    def _finish_status(self, status: ModuleStatus, previous: ModuleStatus | None) -> None:
        if previous is not None and status.quality.rank > previous.quality.rank:
            status.upgraded_from = previous.quality
            self._upgraded.add(status.build_id)
        self._save_status(status)
        if status.source_key:
            with self.store.lock(status.build_id):
                self.store.drop_other_sources(status.build_id, status.source_key)

    def _save_status(self, status: ModuleStatus) -> None:
        self.store.save_status(status)

    def _run_builds(self, builds: list[tuple[str, ModuleStatus, _PendingBuild, ModuleStatus | None]]) -> None:
        import concurrent.futures

        from tbpipe.pipeline.progress import DelayedProgress
        from tbpipe.pipeline.symbols import worker

        cache_dir = str(self.store.cache_dir)
        results: dict[str, str | None] = {}
        fresh: dict[str, bytes | None] = {}
        if len(builds) > 1 and self.jobs > 1:
            self._get_pool()  # before the progress bar's thread exists
        with DelayedProgress(self.progress) as progress:
            progress.add("building SymCaches", len(builds))
            if len(builds) > 1 and self.jobs > 1:
                pool = self._get_pool()
                futures = {
                    pool.submit(worker.build, cache_dir, p.build_id, p.path, p.key): key for key, _s, p, _prev in builds
                }
                pending = set(futures)
                while pending:
                    done, pending = concurrent.futures.wait(pending, timeout=0.2)
                    for future in done:
                        results[futures[future]] = self._build_outcome(future)
                        progress.advance("building SymCaches")
                    progress.poll()
            else:
                from tbpipe.pipeline.symbols.resolve import prefetch

                for key, status, p, _previous in builds:
                    # The resolver will want the symbol and line tables right after the build:
                    # read them on the other core meanwhile.
                    reading = prefetch(p.path, status.quality is Quality.DWARF)
                    results[key], fresh[key] = worker.build_keeping(cache_dir, p.build_id, p.path, p.key)
                    reading.join()
                    progress.advance("building SymCaches")
        for key, status, _pending, previous in builds:
            error = results.get(key)
            if error is not None:
                status = ModuleStatus(
                    build_id=status.build_id,
                    quality=Quality.NONE,
                    reason=f"debug info for build-ID {status.build_id} is unusable: {error}",
                    module_path=status.module_path,
                    looked_in=status.looked_in,
                    segments=status.segments,
                    checked_at=time.time(),
                )
                self._save_status(status)
            else:
                self._finish_status(status, previous)
            self._states[key] = _ModuleState(
                status=status, persistent=status.quality is not Quality.NONE, symcache=fresh.get(key)
            )

    @staticmethod
    def _build_outcome(future: concurrent.futures.Future) -> str | None:
        try:
            return future.result()
        except Exception as error:  # a worker that died (e.g. killed for memory)
            return f"the SymCache build failed ({type(error).__name__}: {error})"

    @staticmethod
    def _state_for_invalid(ref: ModuleRef) -> _ModuleState:
        try:
            normalize_build_id(ref.build_id)
            reason = "a module needs a build-ID or a path"
        except BadBuildIdError as error:
            reason = str(error)
        status = ModuleStatus(
            build_id=str(ref.build_id)[:200], quality=Quality.NONE, reason=reason, module_path=ref.path
        )
        return _ModuleState(status=status, persistent=False)

    def _state_without_build_id(self, ref: ModuleRef) -> _ModuleState:
        """A module without build-ID: read straight from its file, nothing kept in the store."""
        from tbpipe.pipeline.symbols.elf import inspect_elf
        from tbpipe.pipeline.symbols.symcache import build_symcache

        path = ref.path or ""
        try:
            facts = inspect_elf(path)
        except ElfFileError as error:
            status = ModuleStatus(
                build_id="", quality=Quality.NONE, reason=f"no build-ID, and {error}", module_path=path
            )
            return _ModuleState(status=status, persistent=False)
        quality = Quality.DWARF if facts.has_dwarf else Quality.SYMBOLS if facts.has_symbols else Quality.NONE
        status = ModuleStatus(
            build_id="",
            quality=quality,
            reason=f"no build-ID: read {path} directly ({quality.value})",
            debug_file=path if quality is not Quality.NONE else None,
            found_via="module" if quality is not Quality.NONE else None,
            module_path=path,
            segments=facts.segments,
            debug_identity=list(facts.identity),
            checked_at=time.time(),
        )
        state = _ModuleState(status=status, persistent=False)
        if quality is not Quality.NONE:
            try:
                state.symcache, _features = build_symcache(path, None)
            except ElfFileError as error:
                state.status.quality = Quality.NONE
                state.status.reason = f"no build-ID, and {error}"
        return state

    # ------------------------------------------------------------------ resolution

    def _resolve_keys(
        self, modules: Mapping[ModuleRef, tuple[Any, Any]]
    ) -> dict[ModuleRef, tuple[_ModuleState, list[int]]]:
        """States for every module and the lookup keys of its addresses; resolves unknown keys."""
        self._decide_states(modules.keys())
        resolved: dict[ModuleRef, tuple[_ModuleState, list[int]]] = {}
        missing: dict[int, tuple[_ModuleState, set[int]]] = {}
        for ref, (addresses, exact) in modules.items():
            state = self._states[self._state_key(ref)]
            values = _as_int_list(addresses)
            if exact is None or exact is True:
                keys = values  # all exact: looked up as they are
            else:
                flags = _as_bool_list(exact, len(values))
                keys = [a if e else a - 1 for a, e in zip(values, flags)]
            resolved[ref] = (state, keys)
            known = self._known(state)
            new = set(keys)
            new.difference_update(known.position.keys())
            if new and (min(new) < 0 or max(new) > _MAX_ADDRESS):
                new = {k for k in new if 0 <= k <= _MAX_ADDRESS}
            if new:
                entry = missing.setdefault(id(state), (state, set()))
                entry[1].update(new)
        if missing:
            self._resolve_missing([(state, sorted(keys)) for state, keys in missing.values()])
        return resolved

    def _resolve_arrays(self, modules: Mapping[ModuleRef, tuple[Any, Any]]) -> list[Any]:
        """`_resolve_keys` with numpy: [(state, known, entries, address, exact)] per module.

        Known addresses never go through a Python loop: lookup keys are computed, searched in
        the table's sorted index and gathered as arrays (the >= 1M addresses/s ingest path).
        """
        import numpy as np

        self._decide_states(modules.keys())
        staged = []
        missing: dict[int, tuple[_ModuleState, set[int]]] = {}
        for ref, (addresses, exact) in modules.items():
            state = self._states[self._state_key(ref)]
            address = np.asarray(addresses, dtype=np.uint64)
            if exact is None or isinstance(exact, bool):
                flags = np.full(len(address), True if exact is None else exact, dtype=bool)
            else:
                flags = np.asarray(exact, dtype=bool)
                if len(flags) != len(address):
                    raise ValueError(f"exact has {len(flags)} entries for {len(address)} addresses")
            valid = flags | (address != 0)  # a return address of 0 has no call before it
            keys = address - (~flags).astype(np.uint64)
            known = self._known(state)
            entries = known.entries_of(keys)
            absent = (entries < 0) & valid
            complete = not absent.any()
            if not complete:
                entry = missing.setdefault(id(state), (state, set()))
                entry[1].update(np.unique(keys[absent]).tolist())
            staged.append((state, keys, valid, address, flags, entries if complete else None))
        if missing:
            self._resolve_missing([(state, sorted(keys)) for state, keys in missing.values()])
        lookups = []
        for state, keys, valid, address, flags, entries in staged:
            known = self._known(state)
            if entries is None:
                entries = known.entries_of(keys)
            lookups.append((state, known, np.where(valid, entries, -1), address, flags))
        return lookups

    def _known(self, state: _ModuleState) -> KnownTable:
        if state.known is None:
            status = state.status
            if state.persistent and status.source_key:
                state.known = self.store.load_known(status.build_id, status.source_key)
            else:
                state.known = KnownTable()
        return state.known

    def _resolver(self, state: _ModuleState) -> ModuleResolver:
        if state.resolver is None:
            from tbpipe.pipeline.symbols import worker
            from tbpipe.pipeline.symbols.resolve import ModuleResolver

            status = state.status
            identity = tuple(status.debug_identity) if status.debug_identity else None
            if state.persistent:
                try:
                    state.resolver = worker.resolver_for(self.store, status, identity, state.symcache)
                    state.symcache = None  # the resolver holds it now
                except ElfFileError:
                    # A damaged SymCache in the store (disk full, killed writer): build it again.
                    self._rebuild(state)
                    fresh = state.status
                    identity = tuple(fresh.debug_identity) if fresh.debug_identity else None
                    state.resolver = worker.resolver_for(self.store, fresh, identity)
            else:
                state.resolver = ModuleResolver(status, state.symcache, identity)
            state.resolver.threads = self.jobs
        return state.resolver

    def _rebuild(self, state: _ModuleState) -> None:
        """Forget a build-ID's damaged store entry and decide (and build) it again."""
        status = state.status
        with self.store.lock(status.build_id):
            self.store.drop_other_sources(status.build_id, None)
            self.store.forget_status(status.build_id)
        self._states.pop(status.build_id, None)
        self._decide_states([ModuleRef(status.build_id, status.module_path)])
        fresh = self._states[status.build_id]
        state.status, state.persistent, state.known = fresh.status, fresh.persistent, fresh.known
        state.frames.clear()
        state.raw_frames.clear()
        if fresh.status.quality is Quality.NONE or not fresh.status.source_key:
            raise ElfFileError(fresh.status.reason)

    def _resolve_missing(self, work: list[tuple[_ModuleState, list[int]]]) -> None:
        with gc_paused():
            self._resolve_missing_unpaused(work)

    def _resolve_missing_unpaused(self, work: list[tuple[_ModuleState, list[int]]]) -> None:
        from tbpipe.pipeline.progress import DelayedProgress

        total = sum(len(keys) for _state, keys in work)
        parallel = self.jobs > 1 and total >= self.min_parallel_addresses
        if parallel:
            if self._pool is None:
                # Forked workers inherit what is loaded now (SymCaches, symbol tables).
                for state, _keys in work:
                    try:
                        self._resolver(state).preload()
                    except ElfFileError:
                        pass
            self._get_pool()  # before the progress bar's thread exists
        with DelayedProgress(self.progress) as progress:
            progress.add("symbolizing addresses", total)
            if parallel:
                self._resolve_in_workers(work, total, progress)
                return
            for state, keys in work:
                for start in range(0, len(keys), _CHUNK_ADDRESSES):
                    batch = keys[start : start + _CHUNK_ADDRESSES]
                    self._resolve_here(state, batch)
                    progress.advance("symbolizing addresses", len(batch))

    def _resolve_here(self, state: _ModuleState, keys: list[int]) -> None:
        try:
            chunk, incomplete = self._resolver(state).resolve(keys)
        except ElfFileError as error:
            chunk, incomplete = ResultChunk.from_resolved([(k, [], str(error)) for k in keys]), keys
        self._accept(state, chunk, incomplete)

    def _resolve_in_workers(
        self, work: list[tuple[_ModuleState, list[int]]], total: int, progress: DelayedProgress
    ) -> None:
        import concurrent.futures

        from tbpipe.pipeline.symbols import worker

        pool = self._get_pool()
        cache_dir = str(self.store.cache_dir)
        chunk_size = max(5_000, min(_CHUNK_ADDRESSES * 2, total // (self.jobs * 4) + 1))
        futures: dict[concurrent.futures.Future, tuple[_ModuleState, list[int]]] = {}
        for state, keys in work:
            if not state.persistent:
                self._resolve_here(state, keys)  # its SymCache lives only in this process
                progress.advance("symbolizing addresses", len(keys))
                continue
            status_json = state.status.to_json()
            identity = state.status.debug_identity
            for start in range(0, len(keys), chunk_size):
                batch = keys[start : start + chunk_size]
                data = array("Q", batch).tobytes()
                futures[pool.submit(worker.resolve, cache_dir, status_json, identity, data)] = (state, batch)
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                state, batch = futures[future]
                try:
                    data, incomplete = future.result()
                    self._accept(state, ResultChunk.from_bytes(data), incomplete)
                except Exception:
                    # A worker that died or failed: do the batch here, where errors are reported per address.
                    self._resolve_here(state, batch)
                progress.advance("symbolizing addresses", len(batch))
            progress.poll()

    def _accept(self, state: _ModuleState, chunk: ResultChunk, incomplete: Sequence[int]) -> None:
        known = self._known(state)
        known.add(chunk)
        if not state.persistent or not state.status.source_key:
            return
        if incomplete:
            skip = set(incomplete)
            kept = [
                (key, known.frames_of(known.position[key]), known.reason_of(known.position[key]))
                for key in chunk.keys
                if key not in skip
            ]
            chunk = ResultChunk.from_resolved(kept)
        try:
            self.store.append_known(state.status.build_id, state.status.source_key, chunk)
        except OSError:
            pass  # results stay correct in memory; they are redone next time

    def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            import concurrent.futures
            import multiprocessing

            if _os_thread_count() == 1:
                # fork: workers start in milliseconds, inherit the imports, and do not re-run
                # the caller's __main__ (which spawn/forkserver do, breaking unguarded scripts).
                context = multiprocessing.get_context("fork")
            else:
                # Another thread (DuckDB's, a UI's) may hold a lock that fork() would copy
                # locked into the child; the forkserver forks from a clean, single-threaded
                # process instead.
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(["tbpipe.pipeline.symbols.worker"])
            self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=self.jobs, mp_context=context)
        return self._pool

    # ------------------------------------------------------------------ results

    def _frames_for(self, state: _ModuleState, keys: list[int], demangle: bool) -> list[list[SymbolizedFrame]]:
        # Chains are cached per lookup address: a known address costs one dict probe and a
        # list copy (callers own their lists; the frames themselves are frozen and shared).
        by_key = state.frames if demangle else state.raw_frames
        found = list(map(by_key.get, keys))
        if None in found:
            known = self._known(state)
            get_entry = known.position.get
            wanted = {k for k, frames in zip(keys, found) if frames is None}
            entries = {get_entry(k, -1) for k in wanted}
            entries.discard(-1)
            chains = self._chains(known, entries, demangle)
            for key in wanted:
                entry = get_entry(key, -1)
                by_key[key] = chains[entry] if entry >= 0 else [SymbolizedFrame(None, reason=self._invalid_reason(key))]
            found = list(map(by_key.get, keys))
        return list(map(list, found))

    @staticmethod
    def _invalid_reason(key: int) -> str:
        if key < 0:
            return "invalid address: a return address of 0"
        return f"invalid address {key:#x}: more than 64 bits"

    @staticmethod
    def _chains(known: KnownTable, entries: set[int], demangle: bool) -> dict[int, list[SymbolizedFrame]]:
        """Frame lists for table entries, names demangled in one batch."""
        names: dict[str, str] = {}
        if demangle:
            strings = known.strings
            ids = set()
            for entry in entries:
                start = known.starts[entry]
                ids.update(known.functions[start : start + known.counts[entry]])
            ids.discard(-1)
            from tbpipe.pipeline.symbols import demangle as demangling

            names = demangling.demangle_many(strings[i] for i in ids)
        chains = {}
        for entry in entries:
            raw = known.frames_of(entry)
            reason = known.reason_of(entry)
            if not raw:
                chains[entry] = [SymbolizedFrame(None, None, None, False, reason or "not symbolized")]
                continue
            chains[entry] = [
                SymbolizedFrame(
                    names.get(function, function) if function is not None else None,
                    file,
                    line or None,
                    inlined,
                    reason if index == 0 else None,
                )
                for index, (function, file, line, inlined) in enumerate(raw)
            ]
        return chains
