"""Accepted changes: a small checked-in TOML file that stops a known change from failing CI.

    [[accept]]
    site = "models/bert.py:forward"   # a site key (16 hex digits) or FILE:FUNCTION
    name = "aten::addmm"              # optional: the event name (shell-style wildcards); all names when left out
    kind = "op"                       # optional: the event kind
    until = 2027-01-31                # optional: the last day it applies
    reason = "fused attention, PR 1234"

FILE matches the site's file relative to its import root, or the end of its path. An entry past
its date no longer applies; the report lists it, so that it gets removed or renewed.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbpipe.pipeline.errors import UsageError
from tbpipe.pipeline.reports.regression.model import SiteChange

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CPython 3.10
    import tomli as tomllib

_SITE_KEY = re.compile(r"^[0-9a-f]{16}$")
_FIELDS = {"site", "name", "kind", "until", "reason"}


class AcceptFileError(UsageError):
    """An --accept file that cannot be read or has a malformed entry: names the file and the entry."""


@dataclass(frozen=True)
class Accepted:
    site: str
    name: str | None
    kind: str | None
    until: dt.date | None
    reason: str

    def matches(self, change: SiteChange) -> bool:
        if self.kind is not None and change.kind != self.kind:
            return False
        if self.name is not None and not fnmatch.fnmatchcase(change.name, self.name):
            return False
        if _SITE_KEY.match(self.site):
            return change.site_key == self.site
        file, _, function = self.site.rpartition(":")
        if change.site_function != function:
            return False
        return file in (change.site_portable_file, change.site_file) or (change.site_file or "").endswith("/" + file)

    def describe(self) -> str:
        scope = " ".join(p for p in (self.kind, self.name) if p)
        until = f" until {self.until.isoformat()}" if self.until else ""
        return f"{self.site}{' ' + scope if scope else ''}{until}: {self.reason}"


@dataclass
class AcceptList:
    path: Path
    entries: list[Accepted]

    def split(self, today: dt.date) -> tuple[list[Accepted], list[Accepted]]:
        """(entries in force, entries past their date)."""
        live = [e for e in self.entries if e.until is None or e.until >= today]
        return live, [e for e in self.entries if e not in live]


def load_accept_file(path: Path) -> AcceptList:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise AcceptFileError(f"{path}: cannot read the accept file: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise AcceptFileError(f"{path}: not a TOML file: {error}") from None
    extra = set(data) - {"accept"}
    if extra:
        raise AcceptFileError(f"{path}: unknown top-level keys {sorted(extra)}; entries go in [[accept]] tables")
    entries = data.get("accept", [])
    if not isinstance(entries, list):
        raise AcceptFileError(f"{path}: 'accept' must be a list of [[accept]] tables")
    return AcceptList(Path(path), [_entry(path, i + 1, entry) for i, entry in enumerate(entries)])


def _entry(path: Path, number: int, entry: Any) -> Accepted:
    where = f"{path}: [[accept]] entry {number}"
    if not isinstance(entry, dict):
        raise AcceptFileError(f"{where} is not a table")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise AcceptFileError(f"{where} has unknown keys {sorted(unknown)} (known: {', '.join(sorted(_FIELDS))})")
    site = entry.get("site")
    if not isinstance(site, str) or not (_SITE_KEY.match(site) or re.match(r"^.+:[^:]+$", site)):
        raise AcceptFileError(f"{where}: 'site' must be a site key (16 hex digits) or FILE:FUNCTION, not {site!r}")
    reason = entry.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise AcceptFileError(f"{where}: say why in 'reason'")
    until = entry.get("until")
    if isinstance(until, str):
        try:
            until = dt.date.fromisoformat(until)
        except ValueError:
            raise AcceptFileError(f"{where}: 'until' must be a date (YYYY-MM-DD), not {until!r}") from None
    if until is not None and not isinstance(until, dt.date):
        raise AcceptFileError(f"{where}: 'until' must be a date (YYYY-MM-DD), not {until!r}")
    if isinstance(until, dt.datetime):
        until = until.date()
    for key in ("name", "kind"):
        if key in entry and not isinstance(entry[key], str):
            raise AcceptFileError(f"{where}: {key!r} must be a string")
    return Accepted(site, entry.get("name"), entry.get("kind"), until, reason.strip())
