"""`tbpipe debuginfo`: build the index of debug folders, and explain where a build-ID's debug
info comes from (or why there is none).

    tbpipe debuginfo scan DIR...        index DIRs recursively by build-ID (kept in the cache dir)
    tbpipe debuginfo find BUILD_ID      every place looked at (debuginfod servers last: status, size,
                                        time), what was found, what the store holds
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

debuginfo_app = typer.Typer(
    name="debuginfo",
    help="Find debug info by build-ID; index debug folders.",
    no_args_is_help=True,
    add_completion=False,
)

CacheDir = Annotated[
    Path | None, typer.Option("--cache-dir", help="Symbol store (default: TBPIPE_CACHE_DIR or the user cache dir).")
]
Debuginfod = Annotated[
    list[str] | None,
    typer.Option(
        "--debuginfod",
        metavar="URL",
        help="debuginfod server asked for what no local place has, before those in $DEBUGINFOD_URLS; repeatable.",
    ),
]
Offline = Annotated[bool, typer.Option("--offline", help="Ask no debuginfod server (their cache is still read).")]


@debuginfo_app.command("scan")
def scan(
    directories: Annotated[list[Path], typer.Argument(help="Folders to index (recursively).")],
    cache_dir: CacheDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
) -> None:
    """Index DIRs by build-ID; unchanged files are not read again."""
    from rich.console import Console
    from rich.table import Table

    from tbpipe.pipeline.errors import UsageError
    from tbpipe.pipeline.symbols.dirindex import DebugDirIndex
    from tbpipe.pipeline.symbols.store import SymbolStore

    store = SymbolStore(cache_dir)
    reports = []
    for directory in directories:
        if not directory.is_dir():
            raise UsageError(f"{directory}: not a directory")
        index = DebugDirIndex(str(directory), store.debug_dir_index_path(str(directory.absolute())))
        reports.append(index.refresh())
    if as_json:
        typer.echo(json.dumps([report.__dict__ for report in reports], indent=1))
        return
    console = Console(soft_wrap=True)
    table = Table("directory", "files", "ELF with build-ID", "read now", "problems")
    for report in reports:
        table.add_row(
            report.directory, str(report.files), str(report.elf_files), str(report.opened), str(len(report.problems))
        )
    console.print(table)
    for report in reports:
        for problem in report.problems[:20]:
            console.print(f"[yellow]{problem}[/]", highlight=False)
        if len(report.problems) > 20:
            console.print(f"[yellow]… and {len(report.problems) - 20} more in {report.directory}[/]")


@debuginfo_app.command("find")
def find(
    build_id: Annotated[str, typer.Argument(help="The build-ID (hex).")],
    module: Annotated[Path | None, typer.Option("--module", help="Where the module was loaded from.")] = None,
    cache_dir: CacheDir = None,
    debug_dir: Annotated[list[Path] | None, typer.Option("--debug-dir", help="Extra folder with debug files.")] = None,
    debug_root: Annotated[list[Path] | None, typer.Option("--debug-root", help="Root with a .build-id/ tree.")] = None,
    debuginfod: Debuginfod = None,
    offline: Offline = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Say where the debug info of BUILD_ID was looked for (debuginfod servers last) and what was found."""
    from rich.console import Console

    from tbpipe.pipeline.symbols.debuginfo import DebugInfoLocator
    from tbpipe.pipeline.symbols.debuginfod import DebuginfodClient, DebuginfodSettings
    from tbpipe.pipeline.symbols.model import normalize_build_id
    from tbpipe.pipeline.symbols.store import SymbolStore

    build_id = normalize_build_id(build_id)
    store = SymbolStore(cache_dir)
    settings = DebuginfodSettings(urls=tuple(debuginfod or ()), offline=offline)
    client = DebuginfodClient.from_settings(settings)
    locator = DebugInfoLocator(
        [str(d) for d in debug_dir or ()],
        [str(r) for r in debug_root] if debug_root else None,
        index_path_for=store.debug_dir_index_path,
        memo=store,
        debuginfod=client,
    )
    try:
        located = locator.locate(build_id, str(module) if module else None)
    finally:
        if client is not None:
            client.close()
    if client is None:
        located.looked_in.append(
            "debuginfod: --offline, no server asked" if offline else "debuginfod: no server (DEBUGINFOD_URLS is empty)"
        )
    stored = store.load_status(build_id)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "build_id": build_id,
                    "quality": located.quality.value,
                    "file": located.chosen.path if located.chosen else None,
                    "via": located.chosen.via if located.chosen else None,
                    "reason": located.reason(),
                    "looked_in": located.looked_in,
                    "store": stored.to_json() if stored else None,
                },
                indent=1,
            )
        )
        return
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]build-ID[/] {build_id}")
    for place in located.looked_in:
        console.print(f"  looked in {place}")
    colour = {"dwarf": "green", "symbols": "yellow", "none": "red"}[located.quality.value]
    console.print(f"[bold {colour}]{located.quality.value}[/]: {located.reason()}")
    if stored is not None:
        console.print(f"[bold]symbol store[/]: {stored.quality.value}: {stored.reason}")
    else:
        console.print("[bold]symbol store[/]: nothing yet for this build-ID")


def register(app: typer.Typer) -> None:
    app.add_typer(debuginfo_app, name="debuginfo")
