"""Which debug-info candidate wins (pipeline/symbols/debuginfo.py) and how the outcome is said: the
first candidate with DWARF, else the first with symbol tables, else none; build-IDs as the store keys
them and as messages abbreviate them; a module's status kept and read back unchanged."""

from __future__ import annotations

import pytest

from tbpipe.pipeline.symbols.debuginfo import Candidate, Located, _Search
from tbpipe.pipeline.symbols.elf import ElfFacts
from tbpipe.pipeline.symbols.model import BadBuildIdError, ModuleStatus, Quality, normalize_build_id, short_build_id

BUILD_ID = "ab" * 20


def candidate(path: str, dwarf: bool = False, symtab: bool = False, dynsym: bool = False) -> Candidate:
    facts = ElfFacts(
        path=path, build_id=BUILD_ID, has_dwarf=dwarf, has_symtab=symtab, has_dynsym=dynsym, debuglink=None
    )
    return Candidate(path=path, via="debug-dir", facts=facts)


def test_a_candidates_quality_is_dwarf_else_either_symbol_table_else_none() -> None:
    assert candidate("a", dwarf=True).quality is Quality.DWARF
    assert candidate("a", symtab=True).quality is Quality.SYMBOLS
    assert candidate("a", dynsym=True).quality is Quality.SYMBOLS
    assert candidate("a").quality is Quality.NONE
    assert [q.rank for q in (Quality.NONE, Quality.SYMBOLS, Quality.DWARF)] == [0, 1, 2]


def test_the_first_dwarf_candidate_wins_and_ends_the_search() -> None:
    search = _Search(BUILD_ID, None)
    assert search.offer(candidate("symbols", symtab=True)) is False
    assert search.offer(candidate("nothing")) is False
    assert search.offer(candidate("dwarf", dwarf=True)) is True
    located = search.finish()
    assert (located.chosen.path, located.quality) == ("dwarf", Quality.DWARF)


def test_without_dwarf_the_first_candidate_with_symbols_wins() -> None:
    search = _Search(BUILD_ID, "/lib/m.so")
    for offered in (candidate("none"), candidate("first", dynsym=True), candidate("second", symtab=True)):
        assert search.offer(offered) is False
    assert search.done is False
    assert search.finish().chosen.path == "first"
    empty = _Search(BUILD_ID, None)
    empty.offer(candidate("none"))
    assert empty.finish().chosen is None and empty.finish().quality is Quality.NONE


def test_the_reason_says_where_dwarf_came_from_or_where_it_was_looked_for() -> None:
    dwarf = Located(BUILD_ID, candidate("/dbg/m.debug", dwarf=True), ["a: no such file"])
    assert dwarf.reason() == "DWARF from /dbg/m.debug (via debug-dir)"
    symbols = Located(BUILD_ID, candidate("/lib/m.so", symtab=True), ["a: no such file", "b: symbols only"])
    assert symbols.reason() == (
        "symbols only for build-ID abababababab…: no DWARF found (looked in: a: no such file; b: symbols only)"
    )
    assert Located(BUILD_ID, None).reason() == "no debug info for build-ID abababababab… (looked in: nowhere)"
    assert Located(BUILD_ID, candidate("x")).reason() == "no debug info for build-ID abababababab… (looked in: nowhere)"


def test_short_build_ids_are_kept_whole_up_to_sixteen_digits() -> None:
    assert short_build_id("0123456789abcdef") == "0123456789abcdef"
    assert short_build_id("0123456789abcdef0") == "0123456789ab…"


@pytest.mark.parametrize(("given", "normal"), [(" 0xABCD ", "abcd"), ("ab" * 64, "ab" * 64), ("0X12cd", "12cd")])
def test_build_ids_are_lower_case_hex_without_0x(given, normal) -> None:
    assert normalize_build_id(given) == normal


@pytest.mark.parametrize("given", ["abc", "ab", "xyzw", "", "0x", "ab cd"])
def test_a_build_id_that_cannot_be_one_is_refused_naming_it(given) -> None:
    with pytest.raises(BadBuildIdError, match=f"invalid build-ID {given!r}: expected 4..128 hex digits"):
        normalize_build_id(given)


def test_long_garbage_build_ids_are_shortened_in_the_message_and_non_text_is_named() -> None:
    with pytest.raises(BadBuildIdError) as raised:
        normalize_build_id("z" * 81)
    assert f"'{'z' * 77}...'" in str(raised.value)
    with pytest.raises(BadBuildIdError, match=f"invalid build-ID '{'z' * 80}': "):  # 80 kept whole
        normalize_build_id("z" * 80)
    with pytest.raises(BadBuildIdError, match="expected 4..128 hex digits"):
        normalize_build_id("ab" * 65)
    with pytest.raises(BadBuildIdError, match="build-ID must be a hex string, not int"):
        normalize_build_id(12)


def test_a_module_status_reads_back_as_it_was_kept() -> None:
    status = ModuleStatus(
        build_id=BUILD_ID,
        quality=Quality.SYMBOLS,
        reason="symbols only",
        debug_file="/lib/m.so",
        found_via="module",
        module_path="/lib/m.so",
        looked_in=["a", "b"],
        source_key="k",
        debug_identity=["/lib/m.so", 1, 2, 3, 4],
        segments=[(0, 4096, 5), (8192, 16, 6)],
        upgraded_from=Quality.NONE,
        checked_at=12.5,
    )
    assert ModuleStatus.from_json(status.to_json()) == status
    assert status.describe() == f"{BUILD_ID}: symbols: symbols only"
    bare = ModuleStatus.from_json({"build_id": BUILD_ID, "quality": "none"})
    assert bare == ModuleStatus(BUILD_ID, Quality.NONE, "")
    assert bare.to_json()["debug_identity"] is None and bare.to_json()["upgraded_from"] is None
