"""The raw run format written by tbpipe.capture and read by tbpipe.pipeline, defined once.

- `format`     the format's name and versions and the manifest's file name (no pyarrow: the capture's
               start-up path writes the first manifest with them)
- `raw`        the run folder's Arrow schemas, table names and format constants (`schemas/README.md`
               documents them for people who read the files with other tools).
- `modulekey`  the name of a native module (its build-ID, else its path).
- `identity`   the portable hashes of modules, code objects and stacks.
- `lake`       the lake's tables, for both engines.

Nothing is imported here: each user imports the module it needs (the capture's and the
symbolizer's start-up paths stay free of pyarrow).
"""
