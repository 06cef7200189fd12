"""Which Python files are user code, and the call site of every stack under those rules.

The rules live in the `user_code` table (`--user-code PREFIX` / `!PREFIX`, plus tbpipe's own
source folders); `sql/call_sites.sql` computes a stack's site from them (`stack_sites_from`), and
the ingest stores the answer in `sites` / `stack_sites` for the views to read: for new stacks as
they come in, and for every stack again when the rules change.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tbpipe.pipeline.db.connection import query_value
from tbpipe.pipeline.db.ingest.tables import IngestDb
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
    import tbpipe.capture
    import tbpipe.pipeline
    import tbpipe.schemas

    packages = (tbpipe.capture, tbpipe.pipeline, tbpipe.schemas)
    return sorted({str(Path(m.__file__).resolve().parent) + "/" for m in packages})


def store_user_code(db: IngestDb, rules: list[tuple[str, bool]]) -> None:
    """Stores the rules; when what is user code changed (here or by hand), every stack is sited again."""
    with db.transaction() as con:
        for prefix in tbpipe_source_dirs():
            con.execute("INSERT INTO user_code VALUES (?, false, 'tbpipe', now()) ON CONFLICT DO NOTHING", [prefix])
        for prefix, is_user in rules:
            con.execute("INSERT OR REPLACE INTO user_code VALUES (?, ?, 'user', now())", [prefix, is_user])
        rules_hash = query_value(
            con,
            "SELECT md5(coalesce(string_agg(prefix || '=' || is_user, chr(30) ORDER BY prefix), '')) FROM user_code",
        )
        sited_with = query_value(con, "SELECT value FROM settings WHERE key = 'sited_with_rules'")
        if sited_with != rules_hash:
            site_stacks(db, from_stack=None)
            con.execute("INSERT OR REPLACE INTO settings VALUES ('sited_with_rules', ?)", [rules_hash])


def site_stacks(db: IngestDb, from_stack: int | None) -> None:
    """Fills `stack_sites` (and `sites`) for stacks >= from_stack; None: all stacks, anew."""
    con = db.con
    if from_stack is None:
        con.execute("DELETE FROM stack_sites")
        con.execute("DELETE FROM sites")
    con.execute("CREATE OR REPLACE TEMP TABLE ingest_sites AS SELECT * FROM stack_sites_from(?)", [from_stack or 0])
    try:
        con.execute(
            """
            INSERT INTO sites
            SELECT (SELECT coalesce(max(site_id), 0) FROM sites) + row_number() OVER (ORDER BY site_key),
                   site_key, site_function, site_file, site_line
            FROM (
                SELECT site_key, any_value(site_function) AS site_function, any_value(site_file) AS site_file,
                       any_value(site_line) AS site_line
                FROM ingest_sites
                WHERE site_key IS NOT NULL AND site_key NOT IN (SELECT site_key FROM sites)
                GROUP BY site_key
            )
            """
        )
        con.execute(
            """
            INSERT INTO stack_sites
            SELECT i.stack_id, t.site_id, i.site_depth, i.site_kind, i.site_is_user
            FROM ingest_sites i LEFT JOIN sites t USING (site_key)
            """
        )
    finally:
        con.execute("DROP TABLE IF EXISTS temp.ingest_sites")
