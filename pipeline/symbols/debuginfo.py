"""Finding debug info for a build-ID, and saying where we looked.

Order (the first file with DWARF wins; without any, the first with symbol tables):

1. the user's `--debug-dir` folders (indexed recursively by build-ID, see `dirindex`),
2. `<root>/.build-id/ab/cdef….debug` under each debug root (default /usr/lib/debug),
3. the debuginfod client cache: `$DEBUGINFOD_CACHE_PATH`, else `$XDG_CACHE_HOME` or
   `~/.cache` + `/debuginfod_client/<id>/debuginfo` (an empty file there is a negative entry),
4. the module's own file, when its build-ID matches (else the cache's `<id>/executable`),
5. the module's `.gnu_debuglink` file (CRC32-checked) beside it, in `.debug/` beside it and under
   each debug root,
6. debuginfod servers (`debuginfod`), for every build-ID still without DWARF at once:
   `/debuginfo`, then `/executable` where the module's own file is not on this machine.

A candidate whose build-ID differs from the one asked for is never used (a debuglink file without
a build-ID note is accepted on its CRC alone).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tbpipe.pipeline.symbols.debuginfod import (
    DebuginfodClient,
    Fetched,
    cache_path,
    debuginfod_cache_dir,
    negative_entry_age,
)
from tbpipe.pipeline.symbols.dirindex import DebugDirIndex
from tbpipe.pipeline.symbols.elf import (
    ElfFacts,
    elf_facts_from_json,
    elf_facts_to_json,
    file_crc32,
    file_identity,
    inspect_elf,
)
from tbpipe.pipeline.symbols.model import ElfFileError, Quality, short_build_id
from tbpipe.pipeline.symbols.store import CRC32_MEMO, ELF_FACTS_MEMO

if TYPE_CHECKING:
    from tbpipe.pipeline.symbols.store import SymbolStore

DEFAULT_DEBUG_ROOTS = ("/usr/lib/debug",)


@dataclass
class Candidate:
    path: str
    via: str  # debug-dir, build-id-dir, debuginfod-cache, module, debuglink, "debuginfod URL"
    facts: ElfFacts

    @property
    def quality(self) -> Quality:
        if self.facts.has_dwarf:
            return Quality.DWARF
        if self.facts.has_symbols:
            return Quality.SYMBOLS
        return Quality.NONE


@dataclass
class Located:
    """The outcome of a search: the chosen file (if any) and every place looked at."""

    build_id: str
    chosen: Candidate | None
    looked_in: list[str] = field(default_factory=list)
    module: ElfFacts | None = None  # the module's own file when it exists and matches

    @property
    def quality(self) -> Quality:
        return self.chosen.quality if self.chosen else Quality.NONE

    def reason(self) -> str:
        short = short_build_id(self.build_id)
        places = "; ".join(self.looked_in) or "nowhere"
        if self.chosen is None:
            return f"no debug info for build-ID {short} (looked in: {places})"
        if self.quality is Quality.DWARF:
            return f"DWARF from {self.chosen.path} (via {self.chosen.via})"
        if self.quality is Quality.SYMBOLS:
            return f"symbols only for build-ID {short}: no DWARF found (looked in: {places})"
        return f"no debug info for build-ID {short} (looked in: {places})"


class _Search:
    """One build-ID's search under way: the best candidate so far."""

    def __init__(self, build_id: str, module_path: str | None):
        self.located = Located(build_id=build_id, chosen=None)
        self.module_path = module_path
        self.best_symbols: Candidate | None = None

    @property
    def done(self) -> bool:
        return self.located.chosen is not None

    def offer(self, candidate: Candidate) -> bool:
        """Takes a candidate; True once the search has DWARF (nothing better can come)."""
        if candidate.quality is Quality.DWARF:
            self.located.chosen = candidate
        elif candidate.quality is Quality.SYMBOLS and self.best_symbols is None:
            self.best_symbols = candidate
        return self.done

    def finish(self) -> Located:
        if self.located.chosen is None:
            self.located.chosen = self.best_symbols
        return self.located


class DebugInfoLocator:
    """Searches the places above for build-IDs; `debuginfod`, when given, asks its servers last."""

    def __init__(
        self,
        debug_dirs: Sequence[str | os.PathLike] = (),
        debug_roots: Sequence[str | os.PathLike] | None = None,
        index_path_for: Callable[[str], object] | None = None,
        environ: dict | None = None,
        memo: SymbolStore | None = None,
        debuginfod: DebuginfodClient | None = None,
        debuginfod_cache: str | None = None,
    ):
        self.debug_dirs = [os.path.abspath(os.fspath(d)) for d in debug_dirs]
        self.debug_roots = [os.fspath(r) for r in (DEFAULT_DEBUG_ROOTS if debug_roots is None else debug_roots)]
        self._index_path_for = index_path_for
        self._environ = environ
        self._indexes: list[DebugDirIndex] | None = None
        # What was read of each file, kept in the store while the file is unchanged: the search runs
        # again for every module without DWARF at every ingest (better debug info may have come), and
        # reading an ELF's sections with pyelftools costs tens of milliseconds.
        self._memo = memo
        self.debuginfod = debuginfod
        if debuginfod is not None:
            self.debuginfod_cache = debuginfod.cache_dir
        else:
            self.debuginfod_cache = debuginfod_cache or debuginfod_cache_dir(environ)

    def indexes(self) -> list[DebugDirIndex]:
        """The debug-dir indexes, refreshed once per locator (files may have changed)."""
        if self._indexes is None:
            indexes = []
            for directory in self.debug_dirs:
                index_path = self._index_path_for(directory) if self._index_path_for else None
                index = DebugDirIndex(directory, index_path)
                index.refresh()
                indexes.append(index)
            self._indexes = indexes
        return self._indexes

    def locate(self, build_id: str, module_path: str | None = None) -> Located:
        return self.locate_many([(build_id, module_path)])[0]

    def locate_many(self, wanted: Sequence[tuple[str, str | None]]) -> list[Located]:
        """`locate` for many (build-ID, module path) pairs: the local places of each first, then the
        servers, asked at once for every build-ID that still has no DWARF."""
        searches = [_Search(build_id, module_path) for build_id, module_path in wanted]
        for search in searches:
            for candidate in self._local_candidates(search.located.build_id, search.module_path, search.located):
                if search.offer(candidate):
                    break
        if self.debuginfod is not None:
            self._ask_servers([search for search in searches if not search.done])
        return [search.finish() for search in searches]

    # ---- the search, in order; each step appends what it saw to located.looked_in

    def _local_candidates(self, build_id: str, module_path: str | None, located: Located):
        looked = located.looked_in
        if self.debug_dirs:
            hits = []
            for index in self.indexes():
                hits.extend(index.lookup(build_id))
            if not hits:
                looked.append(f"--debug-dir {', '.join(self.debug_dirs)}: no file with this build-ID")
            for hit in hits:
                candidate = self._check(hit.path, "debug-dir", build_id, looked)
                if candidate and candidate.quality is not Quality.NONE:
                    yield candidate

        for root in self.debug_roots:
            path = os.path.join(root, ".build-id", build_id[:2], build_id[2:] + ".debug")
            candidate = self._check(path, "build-id-dir", build_id, looked)
            if candidate and candidate.quality is not Quality.NONE:
                yield candidate

        candidate = self._check_cached(build_id, "debuginfo", looked)
        if candidate and candidate.quality is not Quality.NONE:
            yield candidate

        module: ElfFacts | None = None
        if module_path:
            candidate = self._check(module_path, "module", build_id, looked, label="module file")
            if candidate:
                # Even a module with no symbols at all still leads to its debuglink.
                module = candidate.facts
                located.module = module
                if candidate.quality is not Quality.NONE:
                    yield candidate
        if module is None:
            # Not on this machine: an executable an earlier download (ours or elfutils') left.
            candidate = self._check_cached(build_id, "executable", looked)
            if candidate:
                located.module = candidate.facts
                if candidate.quality is not Quality.NONE:
                    yield candidate
        if module is not None and module.debuglink:
            name, crc = module.debuglink
            directory = os.path.dirname(os.path.abspath(module_path))
            places = [os.path.join(directory, name), os.path.join(directory, ".debug", name)]
            places += [os.path.join(root, directory.lstrip("/"), name) for root in self.debug_roots]
            for path in places:
                if os.path.abspath(path) == os.path.abspath(module_path):
                    continue
                candidate = self._check(path, "debuglink", build_id, looked, crc=crc)
                if candidate and candidate.quality is not Quality.NONE:
                    yield candidate

    def _check_cached(self, build_id: str, kind: str, looked: list[str]) -> Candidate | None:
        """The debuginfod cache's file of `kind`, unless it is a negative entry."""
        path = cache_path(self.debuginfod_cache, build_id, kind)
        age = negative_entry_age(path)
        if age is not None:
            if self.debuginfod is None:  # else the servers' step says it, and for how long it holds
                looked.append(f"{path}: negative cache entry (the servers had none {age:.0f} s ago)")
            return None
        if kind == "executable" and not os.path.lexists(path):
            return None  # looked for only where the module is missing: no line for the usual case
        return self._check(path, "debuginfod-cache", build_id, looked, label=None if kind == "debuginfo" else kind)

    def _ask_servers(self, searches: list[_Search]) -> None:
        """Servers last: `/debuginfo` for all, then `/executable` where the module is not on this machine."""
        if not searches:
            return
        client = self.debuginfod
        fetched = client.fetch_many([s.located.build_id for s in searches], "debuginfo")
        for search in searches:
            self._take(search, fetched[search.located.build_id])
        missing = [s for s in searches if not s.done and s.located.module is None and s.best_symbols is None]
        if missing:
            fetched = client.fetch_many([s.located.build_id for s in missing], "executable")
            for search in missing:
                self._take(search, fetched[search.located.build_id])

    def _take(self, search: _Search, fetched: Fetched) -> None:
        looked = search.located.looked_in
        looked.extend(fetched.lines())
        if fetched.path is None:
            return
        executable = fetched.kind == "executable"
        via = f"debuginfod {fetched.server}"
        label = "executable" if executable else None
        candidate = self._check(fetched.path, via, search.located.build_id, looked, label=label)
        if candidate is None:
            return
        if executable:
            search.located.module = candidate.facts
        if candidate.quality is not Quality.NONE:
            search.offer(candidate)

    def _check(
        self, path: str, via: str, build_id: str, looked: list[str], *, crc: int | None = None, label: str | None = None
    ) -> Candidate | None:
        shown = f"{label} {path}" if label else path
        if not os.path.lexists(path):
            looked.append(f"{shown}: no such file")
            return None
        try:
            facts = self._facts(path)
        except ElfFileError as error:
            looked.append(str(error) if str(error).startswith(path) else f"{shown}: {error}")
            return None
        if crc is not None:
            try:
                actual = self._crc32(path, facts)
            except OSError as error:
                looked.append(f"{shown}: unreadable ({error.strerror or error})")
                return None
            if actual != crc:
                looked.append(f"{shown}: CRC32 {actual:08x} does not match the debuglink's {crc:08x}")
                return None
            if facts.build_id is not None and facts.build_id != build_id:
                looked.append(f"{shown}: build-ID mismatch (file has {short_build_id(facts.build_id)})")
                return None
        else:
            if facts.build_id is None:
                looked.append(f"{shown}: has no build-ID note")
                return None
            if facts.build_id != build_id:
                looked.append(f"{shown}: build-ID mismatch (file has {short_build_id(facts.build_id)})")
                return None
        candidate = Candidate(path=path, via=via, facts=facts)
        quality = candidate.quality
        looked.append(
            f"{shown}: "
            + {Quality.DWARF: "DWARF", Quality.SYMBOLS: "symbols only", Quality.NONE: "no symbols or DWARF"}[quality]
        )
        return candidate

    def _facts(self, path: str) -> ElfFacts:
        """`inspect_elf(path)`, from the memo while the file is unchanged."""
        identity = file_identity(path) if self._memo is not None else None
        if identity is not None:
            known, value = self._memo.remembered(ELF_FACTS_MEMO, path, identity)
            if known:
                with contextlib.suppress(TypeError, ValueError, KeyError):
                    return elf_facts_from_json(value)
        facts = inspect_elf(path)
        if identity is not None and facts.identity == identity:
            self._memo.remember(ELF_FACTS_MEMO, path, identity, elf_facts_to_json(facts))
        return facts

    def _crc32(self, path: str, facts: ElfFacts) -> int:
        """CRC32 of the whole file (a debuglink's check), from the memo while the file is unchanged."""
        if self._memo is None:
            return file_crc32(path)
        known, value = self._memo.remembered(CRC32_MEMO, path, facts.identity)
        if known and isinstance(value, int):
            return value
        crc = file_crc32(path)
        if file_identity(path) == facts.identity:
            self._memo.remember(CRC32_MEMO, path, facts.identity, crc)
        return crc
