"""The lake: the database's tables as Hive-partitioned zstd Parquet under one folder, read by DuckDB
and Spark alike, with content-derived ids so that a distributed job can write it.

- `ids`           content-derived 64-bit ids (stacks, runs, event names, frames, sites)
- `store`         the folder: table and partition folders, swaps, DuckDB views over the files
- `steps`         the ingest's steps per run or per symbol shard, over Arrow (what executors run)
- `export`        a DuckDB database file into a lake
- `sparksql`      the packaged views (sql/*.sql) translated from DuckDB to Spark SQL
- `spark_ingest`  `tbpipe ingest --engine spark`: the steps as a Spark job

The tables' schemas are defined once, in `tbpipe.schemas.lake`.
"""
