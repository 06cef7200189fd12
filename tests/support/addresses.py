"""Reproducible random code addresses of an ELF file: the address sets of the symbolization tests and benchmarks."""

from __future__ import annotations

import os

from tbpipe.pipeline.symbols.elf import executable_ranges, inspect_elf


def sample_code_addresses(path: str | os.PathLike[str], count: int, seed: int) -> list[int]:
    """`count` addresses drawn uniformly (reproducibly, by `seed`) from the executable
    segments of the ELF file at `path`: the address sets of the tests and benchmarks."""
    import random

    ranges = executable_ranges(inspect_elf(str(path)).segments)
    total = sum(end - start for start, end in ranges)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        offset = rng.randrange(total)
        for start, end in ranges:
            if offset < end - start:
                out.append(start + offset)
                break
            offset -= end - start
    return out
