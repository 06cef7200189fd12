"""`tbpipe addr2line`: a drop-in for binutils' addr2line, backed by the symbol store.

Same options (-e, -a, -f, -i, -C, -p, -s) and output format as binutils 2.40; addresses come as
arguments or one per line on stdin (answered as they arrive, so tools that keep a pipe open
work too). `--build-id HEX` needs no file at all, `--json` prints one JSON object per address.
A stripped binary is fine: its debug file is found by build-ID (from debuginfod servers too:
`--debuginfod URL`, `$DEBUGINFOD_URLS`; `--offline` asks none).

Known differences from binutils: file paths are normalized (`./a/../b.c` -> `b.c`, as
llvm-symbolizer prints them), discriminators are not printed, an address in the padding
between functions has no function name (binutils names the preceding symbol), and of several
symbol-table aliases the last one is used (llvm-symbolizer's choice); binutils' `symbol+offset`
input form is not supported (a line is read as its leading hex digits).
"""

from __future__ import annotations

import gc
import json
import os
import select
import sys
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from tbpipe.pipeline.errors import UsageError

if TYPE_CHECKING:
    import typer
# `typer` is imported by `register`/`_standalone` only (the annotations below are strings that
# typer evaluates then): `run_fast` answers plain binutils-style command lines without it.


def _stdin_batches() -> Iterator[bytes]:
    """Lines from stdin (joined by newlines, without the last one), in batches of whatever has
    arrived (all of a file at once)."""
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
            yield head
        else:
            pending = head + pending
    if pending.strip():
        yield pending


class _Formatter:
    """binutils' text for each address, made by the extension from the result table's columns.

    Keeps, per string id of the table, the name as printed (demangled with -C) and the file as
    printed (basename with -s); the table only grows, so each string is handled once however
    many batches arrive."""

    def __init__(self, functions: bool, inlines: bool, demangle: bool, pretty: bool, basenames: bool):
        self.functions = functions
        self.inlines = inlines
        self.demangle = demangle
        self.pretty = pretty
        self.basenames = basenames
        self.names: dict[str, str] = {}  # mangled -> demangled, of the names needed so far
        self._known = None
        self._name_texts: list[str] = []
        self._file_texts: list[str] = []
        self._demangled: set[int] = set()

    def take_strings(self, known, entries: list[int]) -> None:
        """Take in the table's new strings; demangle, in one batch, the names `entries` need."""
        if known is not self._known:
            self._known = known
            self._name_texts, self._file_texts, self._demangled = [], [], set()
        strings = known.strings
        have = len(self._file_texts)
        if have < len(strings):
            new = strings[have:]
            self._name_texts.extend(new)
            self._file_texts.extend([f.rsplit("/", 1)[-1] for f in new] if self.basenames else new)
        if not self.demangle:
            return
        if len(entries) * 2 >= len(known.counts):
            ids = set(known.functions)  # most of the table: cheaper than walking entries
        else:
            starts, counts, functions = known.starts, known.counts, known.functions
            ids = set()
            for entry in set(entries):
                if entry >= 0:
                    ids.update(functions[starts[entry] : starts[entry] + counts[entry]])
        ids.discard(-1)
        ids.difference_update(self._demangled)
        if not ids:
            return
        from tbpipe.pipeline.symbols.demangle import demangle_many

        demangled = demangle_many(strings[i] for i in ids)
        self.names.update(demangled)
        for i in ids:
            self._name_texts[i] = demangled.get(strings[i], strings[i])
        self._demangled.update(ids)

    def text(self, addresses: list[int], entries: list[int], show_addresses: bool) -> bytes:
        from tbpipe import _native

        known = self._known
        data = _native.format_addr2line(
            array("Q", addresses),
            array("q", entries),
            known.starts,
            known.counts,
            known.functions,
            known.files,
            known.lines,
            self._name_texts,
            self._file_texts,
            show_addresses,
            self.functions,
            self.inlines,
            self.pretty,
        )
        return data


def _json_line(address: int, entry: int, known, names: dict[str, str], demangle: bool) -> str:
    frames = known.frames_of(entry) if entry >= 0 else []
    reason = known.reason_of(entry) if entry >= 0 else "invalid address"
    if not frames and reason is None:
        reason = "not symbolized"
    record = {
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
    return json.dumps(record) + "\n"


def addr2line(
    addresses: Annotated[list[str] | None, typer.Argument(help="Addresses (hex); read from stdin when none.")] = None,
    exe: Annotated[Path | None, typer.Option("-e", "--exe", help="The module (stripped is fine).")] = None,
    build_id: Annotated[
        str | None, typer.Option("--build-id", help="Find the module's debug info by build-ID alone.")
    ] = None,
    show_addresses: Annotated[bool, typer.Option("-a", "--addresses", help="Print each address first.")] = False,
    functions: Annotated[bool, typer.Option("-f", "--functions", help="Print function names.")] = False,
    inlines: Annotated[bool, typer.Option("-i", "--inlines", help="Print the inline chain too.")] = False,
    demangle: Annotated[bool, typer.Option("-C", "--demangle", help="Demangle C++ names.")] = False,
    pretty: Annotated[bool, typer.Option("-p", "--pretty-print", help="One line per address.")] = False,
    basenames: Annotated[bool, typer.Option("-s", "--basenames", help="File names without directories.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per address.")] = False,
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="Symbol store (default: TBPIPE_CACHE_DIR or the user cache dir)."),
    ] = None,
    debug_dir: Annotated[
        list[Path] | None, typer.Option("--debug-dir", help="Extra folder with debug files (recursive).")
    ] = None,
    debug_root: Annotated[
        list[Path] | None, typer.Option("--debug-root", help="Root with a .build-id/ tree (default /usr/lib/debug).")
    ] = None,
    jobs: Annotated[
        int | None, typer.Option("--jobs", help="Worker processes for big batches (default: all CPUs).")
    ] = None,
    debuginfod: Annotated[
        list[str] | None,
        typer.Option(
            "--debuginfod", metavar="URL", help="debuginfod server, before those of $DEBUGINFOD_URLS; repeatable."
        ),
    ] = None,
    offline: Annotated[bool, typer.Option("--offline", help="Ask no debuginfod server.")] = False,
) -> None:
    """Translate addresses into function names, file names and line numbers, like binutils' addr2line."""
    from tbpipe import _native
    from tbpipe.pipeline.symbols.model import ModuleRef, normalize_build_id
    from tbpipe.pipeline.symbols.symbolizer import Symbolizer

    # A short-lived batch process that allocates lists by the 10^5 and creates no cycles: the
    # cyclic GC would only walk the caches over and over.
    gc.disable()
    if build_id is not None and exe is not None:
        raise UsageError("give -e FILE or --build-id, not both")
    servers = None  # $DEBUGINFOD_URLS, read only when some debug info must be looked for (not when warm)
    if debuginfod or offline:
        from tbpipe.pipeline.symbols.debuginfod import DebuginfodSettings

        servers = DebuginfodSettings(urls=tuple(debuginfod or ()), offline=offline)
    symbolizer = Symbolizer(
        cache_dir=cache_dir,
        debug_dirs=[str(d) for d in debug_dir or ()],
        debug_roots=[str(r) for r in debug_root] if debug_root else None,
        jobs=jobs,
        debuginfod=servers,
    )
    if build_id is not None:
        module = ModuleRef(normalize_build_id(build_id), None)
    else:
        path = str(exe) if exe is not None else "a.out"
        found = symbolizer.build_id_of(path)  # ElfFileError (a TbpipeError) for missing/corrupt files
        module = ModuleRef(found or "", os.path.abspath(path))
    # Find the debug info (and build the SymCache, most of a cold run) while stdin is read:
    # symbolic releases the GIL while it builds.
    preloading = threading.Thread(target=_preload_quietly, args=(symbolizer, module), daemon=True)
    preloading.start()
    # Blank arguments are skipped; blank lines on stdin read as 0, as binutils reads them.
    # binutils reads each argument up to its first non-hex character: a newline inside one ends
    # it there too (instead of starting another line).
    listed = [text.replace("\n", " ") for text in addresses or () if text.strip()]
    if addresses:
        batches = iter(["\n".join(listed).encode("utf-8", "surrogateescape")] if listed else [])
    else:
        batches = _stdin_batches()
    formatter = _Formatter(functions or as_json, inlines or as_json, demangle, pretty and not as_json, basenames)
    write = sys.stdout.write
    try:
        for batch in batches:
            values = array("Q")
            values.frombytes(_native.parse_addresses(batch))
            if preloading is not None:
                preloading.join()
                preloading = None
            known, _keys, entries = symbolizer.entries(module, values, None)
            formatter.take_strings(known, entries)
            if as_json:
                write("".join(_json_line(a, e, known, formatter.names, demangle) for a, e in zip(values, entries)))
            else:
                data = formatter.text(values, entries, show_addresses)
                binary = getattr(sys.stdout, "buffer", None)
                if binary is not None:
                    sys.stdout.flush()  # what the text layer holds goes first
                    binary.write(data)
                    binary.flush()
                else:
                    write(data.decode("utf-8", "replace"))
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as binutils does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        if preloading is not None:
            preloading.join()
        symbolizer.close()


def _preload_quietly(symbolizer, module) -> None:
    try:
        symbolizer.preload([module])
    except Exception:
        pass  # the same error comes back, reported properly, from the main thread


def _import_typer() -> None:
    global typer
    import typer


def register(app: typer.Typer) -> None:
    _import_typer()
    app.command(
        "addr2line",
        help="Addresses -> function, file:line (binutils-compatible; debug info found by build-ID).",
        context_settings={"help_option_names": ["-h", "--help"]},
    )(addr2line)


def _standalone() -> None:
    """`python -m tbpipe.pipeline.commands.addr2line`: this command alone, without loading the
    rest of the CLI (for scripts that call it many times)."""
    from tbpipe.pipeline.errors import TbpipeError

    if run_fast(sys.argv[1:], rich_errors=False):
        return
    _import_typer()
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(context_settings={"help_option_names": ["-h", "--help"]})(addr2line)
    try:
        app()
    except TbpipeError as error:
        sys.stderr.write(f"tbpipe: {error}\n")
        sys.exit(2)


# ---- the command line without typer

_FLAGS = {
    "-a": "show_addresses", "--addresses": "show_addresses",
    "-f": "functions", "--functions": "functions",
    "-i": "inlines", "--inlines": "inlines",
    "-C": "demangle", "--demangle": "demangle",
    "-p": "pretty", "--pretty-print": "pretty",
    "-s": "basenames", "--basenames": "basenames",
    "--json": "as_json",
    "--offline": "offline",
}  # fmt: skip
_VALUES = {
    "-e": "exe", "--exe": "exe",
    "--build-id": "build_id",
    "--cache-dir": "cache_dir",
    "--debug-dir": "debug_dir",
    "--debug-root": "debug_root",
    "--jobs": "jobs",
    "--debuginfod": "debuginfod",
}  # fmt: skip
_PATHS = {"exe", "cache_dir"}
_PATH_LISTS = {"debug_dir", "debug_root"}
_LISTS = {"debuginfod"}


def parse_fast(argv: list[str]) -> dict | None:
    """The keyword arguments of `addr2line` for a command line in the plain subset of what
    click accepts (known options, values not starting with "-", digits for --jobs); None for
    anything else (help, errors, odd spellings), which typer then parses and reports."""
    kwargs: dict = {}
    addresses: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            addresses.extend(args)
            break
        if not arg.startswith("-") or arg == "-":
            if arg == "-":
                return None
            addresses.append(arg)
            continue
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            if name in _FLAGS and not equals:
                kwargs[_FLAGS[name]] = True
                continue
            if name not in _VALUES:
                return None
            if not equals:
                value = next(args, None)
            if not _set_value(kwargs, _VALUES[name], value):
                return None
            continue
        # A cluster of short options: flags, then at most one option that takes the rest (or
        # the next argument) as its value.
        for index in range(1, len(arg)):
            option = "-" + arg[index]
            if option in _FLAGS:
                kwargs[_FLAGS[option]] = True
            elif option in _VALUES:
                value = arg[index + 1 :] or next(args, None)
                if not _set_value(kwargs, _VALUES[option], value):
                    return None
                break
            else:
                return None
    if addresses:
        kwargs["addresses"] = addresses
    return kwargs


def _set_value(kwargs: dict, name: str, value: str | None) -> bool:
    if not value or value.startswith("-"):
        return False
    if name == "jobs":
        if not (value.isascii() and value.isdigit()):
            return False
        kwargs[name] = int(value)
    elif name in _PATH_LISTS:
        kwargs.setdefault(name, []).append(Path(value))
    elif name in _LISTS:
        kwargs.setdefault(name, []).append(value)
    else:
        kwargs[name] = Path(value) if name in _PATHS else value
    return True


def run_fast(argv: list[str], rich_errors: bool = True) -> bool:
    """Run `addr2line` for `argv` without typer; False (nothing done) when typer must parse it.
    Errors end the process as under typer: a TbpipeError with status 2, ^C with "Aborted!"."""
    kwargs = parse_fast(argv)
    if kwargs is None:
        return False
    from tbpipe.pipeline.errors import TbpipeError

    try:
        addr2line(**kwargs)
    except TbpipeError as error:
        if rich_errors:
            from tbpipe.pipeline.errors import print_error

            print_error(error)
        else:
            sys.stderr.write(f"tbpipe: {error}\n")
        sys.exit(2)
    except (EOFError, KeyboardInterrupt):
        sys.stderr.write("\nAborted!\n")
        sys.exit(1)
    return True


if __name__ == "__main__":
    _standalone()
