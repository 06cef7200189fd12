"""`tbpipe addr2line`: a drop-in for binutils' addr2line, backed by the symbol store.

Same options (-e, -a, -f, -i, -C, -p, -s) and output format as binutils 2.40; addresses come as
arguments or one per line on stdin (answered as they arrive, so tools that keep a pipe open
work too). `--build-id HEX` needs no file at all, `--json` prints one JSON object per address.
A stripped binary is fine: its debug file is found by build-ID.

Known differences from binutils: file paths are normalized (`./a/../b.c` -> `b.c`, as
llvm-symbolizer prints them), discriminators are not printed, an address in the padding
between functions has no function name (binutils names the preceding symbol), and of several
symbol-table aliases the last one is used (llvm-symbolizer's choice).
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
import threading
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from tbpipe.pipeline.errors import UsageError

_HEX = re.compile(r"\s*(?:0[xX])?([0-9a-fA-F]*)")


def parse_address(text: str) -> int:
    """binutils' reading of an address: leading hex digits (0x optional); none -> 0."""
    digits = _HEX.match(text).group(1)
    return int(digits, 16) & 0xFFFFFFFFFFFFFFFF if digits else 0


def _stdin_batches() -> Iterator[list[str]]:
    """Lines from stdin, in batches of whatever has arrived (all of a file at once)."""
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        try:
            data = os.read(fd, 1 << 20)
        except InterruptedError:
            continue
        if not data:
            break
        pending += data
        # Drain what is already there, so a file or a fast pipe is answered in big batches.
        while len(pending) < (1 << 24) and select.select([fd], [], [], 0)[0]:
            more = os.read(fd, 1 << 20)
            if not more:
                break
            pending += more
        head, newline, pending = pending.rpartition(b"\n")
        if newline:
            yield head.decode("utf-8", "replace").split("\n")
        else:
            pending = head + pending
    if pending.strip():
        yield [pending.decode("utf-8", "replace")]


class _Formatter:
    """Formats each distinct result once; an address's output is its prefix + that block."""

    def __init__(self, functions: bool, inlines: bool, demangle: bool, pretty: bool, basenames: bool):
        self.functions = functions
        self.inlines = inlines
        self.demangle = demangle
        self.pretty = pretty
        self.basenames = basenames
        self.known = None
        self._blocks: dict[int, str] = {}
        self.names: dict[str, str] = {}

    def prepare(self, known, entries: list[int]) -> None:
        """Demangle, in one batch, the names the new entries need."""
        self.known = known
        if not self.demangle:
            return
        from tbpipe.pipeline.symbols.demangle import demangle_many

        starts, counts, functions, strings = known.starts, known.counts, known.functions, known.strings
        blocks = self._blocks
        wanted = set()
        for entry in set(entries):
            if entry >= 0 and entry not in blocks:
                start = starts[entry]
                wanted.update(functions[start : start + counts[entry]])
        wanted.discard(-1)
        self.names.update(demangle_many(strings[i] for i in wanted))

    def block(self, entry: int) -> str:
        text = self._blocks.get(entry)
        if text is None:
            text = self._blocks[entry] = self._format(entry)
        return text

    def _format(self, entry: int) -> str:
        known = self.known
        count = known.counts[entry] if entry >= 0 else 0
        if count == 0:
            return (("?? " if self.pretty else "??\n") if self.functions else "") + "??:0\n"
        if not self.inlines:
            count = 1  # binutils prints the innermost frame only
        strings, names = known.strings, self.names
        start = known.starts[entry]
        parts = []
        for index in range(start, start + count):
            if index != start and self.pretty:
                parts.append(" (inlined by) ")
            if self.functions:
                function = known.functions[index]
                name = strings[function] if function >= 0 else "??"
                if self.demangle and function >= 0:
                    name = names.get(name, name)
                parts.append(name)
                parts.append(" at " if self.pretty else "\n")
            file_id, line = known.files[index], known.lines[index]
            file = strings[file_id] if file_id >= 0 else "??"
            if self.basenames and file_id >= 0:
                file = file.rsplit("/", 1)[-1]
            parts.append(f"{file}:{line if line else '?'}\n")
        return "".join(parts)


def _json_line(address: int, entry: int, known, names: dict[str, str], demangle: bool) -> str:
    frames = known.frames_of(entry) if entry >= 0 else []
    reason = known.reason_of(entry) if entry >= 0 else "invalid address"
    if not frames and reason is None:
        reason = "not symbolized"
    return (
        json.dumps(
            {
                "address": f"{address:#x}",
                "frames": [
                    {
                        "function": (names.get(f, f) if demangle else f) if f else None,
                        "file": p,
                        "line": line or None,
                        "inlined": inlined,
                    }
                    for f, p, line, inlined in frames
                ],
                "reason": reason,
            }
        )
        + "\n"
    )


def addr2line(
    addresses: Annotated[Optional[list[str]], typer.Argument(help="Addresses (hex); read from stdin when none.")] = None,
    exe: Annotated[Optional[Path], typer.Option("-e", "--exe", help="The module (stripped is fine).")] = None,
    build_id: Annotated[Optional[str], typer.Option("--build-id", help="Find the module's debug info by build-ID alone.")] = None,
    show_addresses: Annotated[bool, typer.Option("-a", "--addresses", help="Print each address first.")] = False,
    functions: Annotated[bool, typer.Option("-f", "--functions", help="Print function names.")] = False,
    inlines: Annotated[bool, typer.Option("-i", "--inlines", help="Print the inline chain too.")] = False,
    demangle: Annotated[bool, typer.Option("-C", "--demangle", help="Demangle C++ names.")] = False,
    pretty: Annotated[bool, typer.Option("-p", "--pretty-print", help="One line per address.")] = False,
    basenames: Annotated[bool, typer.Option("-s", "--basenames", help="File names without directories.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per address.")] = False,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Symbol store (default: TBPIPE_CACHE_DIR or the user cache dir).")] = None,
    debug_dir: Annotated[Optional[list[Path]], typer.Option("--debug-dir", help="Extra folder with debug files (recursive).")] = None,
    debug_root: Annotated[Optional[list[Path]], typer.Option("--debug-root", help="Root with a .build-id/ tree (default /usr/lib/debug).")] = None,
) -> None:
    """Translate addresses into file names and line numbers, like binutils' addr2line."""
    from tbpipe.pipeline.symbols.elf import read_build_id
    from tbpipe.pipeline.symbols.model import ModuleRef, normalize_build_id
    from tbpipe.pipeline.symbols.symbolizer import Symbolizer

    if build_id is not None and exe is not None:
        raise UsageError("give -e FILE or --build-id, not both")
    if build_id is not None:
        module = ModuleRef(normalize_build_id(build_id), None)
    else:
        path = str(exe) if exe is not None else "a.out"
        found = read_build_id(path)  # ElfFileError (a TbpipeError) for missing/corrupt files
        module = ModuleRef(found or "", os.path.abspath(path))

    symbolizer = Symbolizer(
        cache_dir=cache_dir,
        debug_dirs=[str(d) for d in debug_dir or ()],
        debug_roots=[str(r) for r in debug_root] if debug_root else None,
    )
    # Find the debug info (and build the SymCache, most of a cold run) while stdin is read:
    # symbolic releases the GIL while it builds.
    preparing = threading.Thread(target=_prepare_quietly, args=(symbolizer, module), daemon=True)
    preparing.start()
    batches = iter([addresses]) if addresses else _stdin_batches()
    formatter = _Formatter(functions or as_json, inlines or as_json, demangle, pretty and not as_json, basenames)
    write = sys.stdout.write
    try:
        for batch in batches:
            values = [parse_address(text) for text in batch if text.strip() or not addresses]
            if not values:
                continue
            if preparing is not None:
                preparing.join()
                preparing = None
            known, _keys, entries = symbolizer.entries(module, values, None)
            formatter.prepare(known, entries)
            if as_json:
                write("".join(_json_line(a, e, known, formatter.names, demangle) for a, e in zip(values, entries)))
            elif show_addresses:
                block = formatter.block
                separator = ": " if pretty else "\n"
                write("".join(f"0x{address:016x}{separator}{block(entry)}" for address, entry in zip(values, entries)))
            else:
                write("".join(map(formatter.block, entries)))
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as binutils does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        if preparing is not None:
            preparing.join()
        symbolizer.close()


def _prepare_quietly(symbolizer, module) -> None:
    try:
        symbolizer.prepare([module])
    except Exception:
        pass  # the same error comes back, reported properly, from the main thread


def register(app: typer.Typer) -> None:
    app.command(
        "addr2line",
        help="Addresses -> function, file:line (binutils-compatible; debug info found by build-ID).",
        context_settings={"help_option_names": ["-h", "--help"]},
    )(addr2line)


def _standalone() -> None:
    """`python -m tbpipe.pipeline.commands.addr2line`: this command alone, without loading the
    rest of the CLI (for scripts that call it many times)."""
    from tbpipe.pipeline.errors import TbpipeError

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(context_settings={"help_option_names": ["-h", "--help"]})(addr2line)
    try:
        app()
    except TbpipeError as error:
        sys.stderr.write(f"tbpipe: {error}\n")
        sys.exit(2)


if __name__ == "__main__":
    _standalone()
