"""`tbpipe doctor [--db PATH] [--source NAME]... [--module PATH]... [--import NAME]... [--run RUN] [--format text|json]
[--timeout S] [-- CMD ARGS...]`"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

import typer

_MARK = {"ok": "ok", "degraded": "~~", "missing": "!!"}  # status at a glance, in a terminal or a log


class DoctorFormat(str, Enum):
    text = "text"
    json = "json"


def render_text(diagnosis) -> str:
    """A line per check (`ok`, `~~` degraded, `!!` missing), the advice indented below it."""
    lines = [f"modules of {diagnosis.modules_from}:"]
    for check in diagnosis.checks:
        named = check.subject in ("module", "symbol store", "database", "program")
        name = (f"{check.subject} " if check.subject != "module" else "") + check.name if named else check.subject
        lines.append(f"  {_MARK[check.status]} {name}: {check.found}" + ("  [asked for]" if check.fails else ""))
        if check.advice:
            lines.append(f"       -> {check.advice}")
    lines.append(
        "something asked for cannot work (exit status 1)" if diagnosis.failed else "everything asked for can work"
    )
    return "\n".join(lines) + "\n"


def register(app: typer.Typer) -> None:
    @app.command("doctor", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def doctor(
        ctx: typer.Context,
        source: list[str] | None = typer.Option(
            None,
            "--source",
            "-s",
            help="A source the next capture will switch on (torch-ops, cuda, triton): exit 1 "
            "if it cannot work.",  # fmt: skip
        ),
        module: list[str] | None = typer.Option(
            None, "--module", "-m", help="A native module (ELF file) whose debug info to check; exit 1 if it has none."
        ),
        imports: list[str] | None = typer.Option(
            None, "--import", help="Check the modules a Python program importing this loads (e.g. torch); repeatable."
        ),
        run: str | None = typer.Option(None, "--run", help="Check the modules of this run (default: the newest run)."),
        debug_dir: list[Path] | None = typer.Option(None, "--debug-dir", help="Folders of debug files, as for ingest."),
        fmt: DoctorFormat = typer.Option(DoctorFormat.text, "--format", "-f", help="text or json."),
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        timeout: float = typer.Option(
            30.0, "--timeout", help="With a program (-- CMD ARGS): stop it after this many seconds."
        ),
    ) -> None:
        """What the next capture and ingest can do here: debug info per module, the torch-ops observer's build,
        CUPTI, Triton, torch.compile, the symbol store and the database (exit 1: something asked for cannot work).

        After --, a program to run under capture for at most --timeout seconds: the modules on its stacks."""
        from tbpipe.pipeline.db.connection import resolve_db_path
        from tbpipe.pipeline.doctor import diagnose
        from tbpipe.pipeline.errors import UsageError

        program = list(ctx.args)
        if program and program[0].startswith("-"):
            raise UsageError(f"no such option: {program[0]} (a program to run goes after --)")
        if program and (module or imports or run):
            raise UsageError("give one of -- CMD, --module, --import and --run")

        result = diagnose(
            resolve_db_path(db),
            sources=list(source or []),
            modules=list(module or []),
            imports=list(imports or []),
            run_id=run,
            debug_dirs=[str(d) for d in debug_dir or []],
            program=program,
            timeout_s=timeout,
        )
        if fmt is DoctorFormat.json:
            sys.stdout.write(json.dumps(result.to_json(), indent=1, default=str) + "\n")
        else:
            sys.stdout.write(render_text(result))
        raise typer.Exit(1 if result.failed else 0)
