"""Helpers shared by the tests and the benchmarks (bench/ puts tests/ on sys.path): never shipped."""
