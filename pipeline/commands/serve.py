"""`tbpipe serve [--db PATH] [--host 127.0.0.1] [--port 8000] [--watch RUNS_DIR]... [--token-file F]`"""

from __future__ import annotations

from pathlib import Path

import typer

from tbpipe.pipeline.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        db: Path | None = typer.Option(None, "--db", help="Database file (default: $TBPIPE_DB or ./tbpipe.duckdb)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
        port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
        watch: list[Path] | None = typer.Option(
            None, "--watch", help="Folder whose run folders are ingested as they appear; repeatable."
        ),
        token_file: Path | None = typer.Option(
            None, "--token-file", help="File holding the token that uploads (POST /api/runs) must send."
        ),
        idle: float = typer.Option(
            30.0, "--idle", help="Seconds a run still being written must stay unchanged before it is ingested."
        ),
        max_upload_mb: int = typer.Option(512, "--max-upload-mb", help="Largest upload accepted, in MiB."),
        uploads_dir: Path | None = typer.Option(
            None, "--uploads-dir", help="Where uploaded runs are kept (default: <db>.uploads beside the database)."
        ),
        query_timeout: float = typer.Option(10.0, "--query-timeout", help="Time limit of /api/query, in seconds."),
        query_rows: int = typer.Option(10_000, "--query-rows", help="Row limit of /api/query."),
        debug_dir: list[Path] | None = typer.Option(None, "--debug-dir", help="As for tbpipe ingest; repeatable."),
        cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Symbol store, as for tbpipe ingest."),
        log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
        repo: Path | None = typer.Option(
            None, "--repo", help="Git repository the comparison's suspects are read from, as for tbpipe report."
        ),
        max_unpacked_mb: int | None = typer.Option(
            None, "--max-unpacked-mb", help="Most an upload may unpack to, in MiB (default: 4 x --max-upload-mb)."
        ),
        max_expansion: float = typer.Option(
            10.0, "--max-expansion", help="Most bytes an upload may unpack to per byte of archive (0: no such limit)."
        ),
        retain_keep_runs: int | None = typer.Option(
            None,
            "--retain-keep-runs",
            help="Roll up, on a schedule, all but the newest N runs of each --retain-by group.",
        ),
        retain_by: list[str] | None = typer.Option(
            None,
            "--retain-by",
            help="Label grouping the runs for --retain-keep-runs; repeatable (as tbpipe retain --by).",
        ),
        retain_keep_days: float | None = typer.Option(
            None, "--retain-keep-days", help="Roll up, on a schedule, the runs started more than D days ago."
        ),
        retain_every: float = typer.Option(24.0, "--retain-every", help="Hours between two scheduled retains."),
        keep_quarantined_days: float | None = typer.Option(
            None, "--keep-quarantined-days", help="On the schedule, delete quarantined uploads older than D days."
        ),
        delete_ingested: float | None = typer.Option(
            None,
            "--delete-ingested-runs-after-days",
            help="On the schedule, delete run folders (watched, uploaded) ingested more than D days ago, unchanged since.",
        ),
    ) -> None:
        """Serve the database: web UI, JSON API, and the ingest service (--watch, uploads)."""
        import logging

        import uvicorn

        from tbpipe.pipeline.db import IngestOptions, resolve_db_path
        from tbpipe.pipeline.db.retain import RetainPolicy
        from tbpipe.pipeline.serve import ServeConfig, create_app
        from tbpipe.pipeline.serve.security import read_token

        if not 0 <= port <= 65535:
            raise UsageError(f"--port {port}: not a port number")
        if idle < 0 or query_timeout <= 0 or query_rows < 1 or max_upload_mb < 1:
            raise UsageError("--idle, --query-timeout, --query-rows and --max-upload-mb must be positive")
        if (max_unpacked_mb is not None and max_unpacked_mb < 1) or max_expansion < 0 or retain_every <= 0:
            raise UsageError("--max-unpacked-mb and --retain-every must be positive, --max-expansion 0 or more")
        retain = None
        if retain_keep_runs is not None or retain_keep_days is not None or retain_by:
            retain = RetainPolicy(retain_keep_runs, tuple(retain_by or ()), retain_keep_days)
            retain.check()
        for folder in watch or []:
            if folder.exists() and not folder.is_dir():
                raise UsageError(f"--watch {folder}: not a folder")
        if repo is not None:
            from tbpipe.pipeline.reports.regression.repository import Repository

            if Repository.find(repo) is None:
                raise UsageError(f"--repo {repo}: not a git repository (or git is not installed)")
        level = getattr(logging, log_level.upper(), None)
        if not isinstance(level, int):
            raise UsageError(f"--log-level {log_level!r}: expected debug, info, warning or error")
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = ServeConfig(
            db_path=resolve_db_path(db).absolute(),
            host=host,
            port=port,
            watch=[w.absolute() for w in watch or []],
            token=read_token(token_file) if token_file is not None else None,
            uploads_dir=uploads_dir.absolute() if uploads_dir else None,
            max_upload_bytes=max_upload_mb << 20,
            idle_s=idle,
            query_timeout_s=query_timeout,
            query_max_rows=query_rows,
            ingest=IngestOptions(debug_dirs=list(debug_dir or []), cache_dir=cache_dir),
            repo=repo.absolute() if repo is not None else None,
            max_unpacked_bytes=max_unpacked_mb << 20 if max_unpacked_mb is not None else None,
            max_expansion=max_expansion or None,
            retain=retain,
            retain_every_s=retain_every * 3600,
            keep_quarantined_days=keep_quarantined_days,
            delete_ingested_runs_after_days=delete_ingested,
        )
        app = create_app(config)
        # Opened here, so that a database another process holds is one clear line, not a failed start-up.
        app.state.service.database.open()
        try:
            uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), access_log=True)
        finally:
            app.state.service.database.close()
