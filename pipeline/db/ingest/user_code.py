"""The user-code rules (`--user-code`): parsed, tbpipe's own folders among them, and whether the
stored rules are the ones every stack was sited with. Storing them and siting the stacks again is
`siting.store_user_code`'s."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tbpipe.pipeline.db.connection import query_rows, query_value
from tbpipe.pipeline.errors import UsageError


def parse_user_code(values: Sequence[str]) -> list[tuple[str, bool]]:
    """`--user-code` values -> (prefix, is_user); '!PREFIX' marks a prefix as not user code."""
    rules = []
    for value in values:
        is_user = not value.startswith("!")
        prefix = value[1:] if not is_user else value
        if not prefix.strip():
            raise UsageError(f"--user-code {value!r}: give a path prefix, e.g. /srv/app/ or mylib/")
        rules.append((prefix, is_user))
    return rules


def tbpipe_source_dirs() -> list[str]:
    """tbpipe's own package folders here: in an editable install they are not under site-packages."""
    specs = (importlib.util.find_spec(f"tbpipe.{name}") for name in ("capture", "pipeline", "schemas"))
    return sorted({str(Path(folder).resolve()) + "/" for spec in specs for folder in spec.submodule_search_locations})


def rules_hash(con: Any) -> str:
    """A hash of the stored rules, kept as 'sited_with_rules' once the stacks are sited with them."""
    return query_value(
        con, "SELECT md5(coalesce(string_agg(prefix || '=' || is_user, chr(30) ORDER BY prefix), '')) FROM user_code"
    )


def sited_with(con: Any) -> str | None:
    """The hash of the rules the stacks were last sited with (None: not sited since a migration)."""
    return query_value(con, "SELECT value FROM settings WHERE key = 'sited_with_rules'")


def rules_in_force(con: Any, rules: list[tuple[str, bool]]) -> bool:
    """Whether storing `rules` would change nothing: none given (given rules are stored again, with
    their time), tbpipe's folders stored already, and the stacks sited with the stored rules."""
    if rules:
        return False
    stored = {prefix for (prefix,) in query_rows(con, "SELECT prefix FROM user_code")}
    return stored.issuperset(tbpipe_source_dirs()) and sited_with(con) == rules_hash(con)
