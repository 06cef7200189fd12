"""`tbpipe lake export --db FILE --lake DIR`, `tbpipe lake package` and `tbpipe lake views`: the Parquet lake's commands."""

from __future__ import annotations

from pathlib import Path

import typer

from tbpipe.pipeline.errors import UsageError


def register(app: typer.Typer) -> None:
    lake_app = typer.Typer(
        help="The Parquet lake: the database's tables as Hive-partitioned Parquet.", no_args_is_help=True
    )
    app.add_typer(lake_app, name="lake")

    @lake_app.command("export")
    def export(
        db: Path = typer.Option(..., "--db", help="The DuckDB database file to export."),
        lake: Path = typer.Option(
            ..., "--lake", help="The lake folder (made if needed; tables written replace its own)."
        ),
        progress: bool | None = typer.Option(
            None, "--progress/--no-progress", help="Progress bar on stderr (default: on a terminal, not under CI)."
        ),
    ) -> None:
        """Write a DuckDB database as a lake (content-derived ids, events partitioned by run)."""
        from tbpipe.pipeline.lake.export import export_database

        if not db.is_file():
            raise UsageError(f"no database at {db}")
        summary = export_database(db, lake, progress=progress)
        total = sum(summary.rows.values())
        print(
            f"tbpipe: exported {db} to {lake}: {summary.rows.get('runs', 0):,} runs, "
            f"{summary.rows.get('event_rows', 0):,} events, {total:,} rows in {summary.seconds:.1f} s"
        )

    @lake_app.command("package")
    def package(
        out: Path = typer.Option(Path("tbpipe-env.tar.gz"), "--out", help="The archive to write (.tar.gz or .zip)."),
        venv: Path | None = typer.Option(
            None, "--venv", help="The virtual environment to pack (default: the one tbpipe runs in)."
        ),
        force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
    ) -> None:
        """Pack a virtual environment holding tbpipe for Spark's executors (spark.archives)."""
        from tbpipe.pipeline.lake.package import package_venv, running_venv

        packed = package_venv(venv or running_venv(), out, force=force)
        print(f"tbpipe: packed {packed.venv} (tbpipe {packed.version}, Python {packed.python}) into {packed.archive}")
        print("executors run it with: " + " ".join(f"--conf {k}={v}" for k, v in packed.spark_conf().items()))

    @lake_app.command("views")
    def views() -> None:
        """Print the packaged views in Spark SQL (CREATE TEMP VIEW statements over the lake's tables)."""
        try:
            from tbpipe.pipeline.lake.sparksql import duckdb_only_views, spark_views
        except ImportError as error:
            raise UsageError(f"translating views needs sqlglot: pip install 'tbpipe[spark]' ({error})") from None
        for name, sql in spark_views():
            print(f"CREATE OR REPLACE TEMP VIEW {name} AS\n{sql};\n")
        for name, why in duckdb_only_views().items():
            print(f"-- {name}: not on Spark ({why}); DuckDB over the lake reads it (tbpipe query --lake)")
