"""The ingest's one Symbolizer, made on first use, and the re-check of the modules stored without
DWARF that every ingest makes first: debug info may have turned up since (a `--debug-dir`, a debug
package installed, a debuginfod server). Standard library and the symbolizer only: an ingest with
nothing else to do checks them without the stages (`flow`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tbpipe.pipeline.db.connection import query_rows
from tbpipe.pipeline.db.ingest.outcomes import IngestOptions, IngestSummary
from tbpipe.pipeline.symbols import Symbolizer
from tbpipe.schemas.modulekey import ModuleKey


class IngestSymbolizer:
    """The Symbolizer of one ingest (`get`), its downloads of debug info told to `describe` (the
    ingest's progress bar once there is one); `close` adds its debuginfod report to the summary."""

    def __init__(self, options: IngestOptions):
        self._options = options
        self._symbolizer: Symbolizer | None = None
        self.describe: Callable[[str], None] | None = None

    @property
    def made(self) -> Symbolizer | None:
        """The Symbolizer when one was needed so far, else None."""
        return self._symbolizer

    def get(self) -> Symbolizer:
        if self._symbolizer is None:
            self._symbolizer = Symbolizer(
                cache_dir=self._options.cache_dir,
                debug_dirs=list(self._options.debug_dirs),
                jobs=self._options.jobs,
                progress=False,
                debuginfod=self._options.debuginfod,
                on_download=self._downloading,
            )
        return self._symbolizer

    def _downloading(self, text: str) -> None:
        if self.describe is not None:
            self.describe(text)

    def check_modules_without_dwarf(self, con: Any) -> set[str]:
        """Asks again for the debug info of every module stored without DWARF (the debuginfod servers
        for all of them at once); returns the build-IDs whose debug info got better in this ingest."""
        rows = modules_without_dwarf(con)
        if not rows:
            return set()
        symbolizer = self.get()
        symbolizer.module_statuses([(ModuleKey.parse(key).symbolizer_build_id, path) for key, path in rows])
        return symbolizer.upgraded_build_ids()

    def close(self, summary: IngestSummary) -> None:
        if self._symbolizer is not None:
            summary.debuginfod = self._symbolizer.debuginfod_report()
            self._symbolizer.close()
            self._symbolizer = None


def modules_without_dwarf(con: Any) -> list[tuple[str, str]]:
    """(module key, path) of the stored modules symbolized without DWARF."""
    return query_rows(
        con,
        "SELECT module_key, path FROM modules WHERE quality IS NOT NULL AND quality <> 'dwarf' "
        "AND NOT starts_with(module_key, 'invalid:')",
    )
