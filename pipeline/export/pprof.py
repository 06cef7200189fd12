"""pprof profiles: gzipped `profile.proto` (`perftools.profiles.Profile`), for pprof, Pyroscope, Parca, speedscope.

One sample per (run, kind, name, thread, stack) with one value, `events` (unit `count`), and
string labels `run`, `kind`, `name` and `thread`. Its locations are the stack's in combined order,
innermost (the leaf) first: a Python frame is a location of one line; a native return address
is a location of its module's mapping whose lines are its inline chain, innermost first; a
marker is a location of one line naming why the native walk stopped. Events without a stack are
samples of one `[no stack]` location, so the samples add up to the events.

Native locations keep what pprof needs to symbolize them itself (`-symbolize=force`, or a
location we could not symbolize): their mapping names the object's path and build-ID, and their
address is the object's own (ELF virtual) address, minus one for a return address so that it
falls in the call instruction as our symbolizer looked it up. Stacks are stored by content
across runs, so one run's load address means nothing for them; the mapping therefore spans the
whole address space at offset 0, which pprof reads as "addresses already relative to the file".
Python functions carry no start line: the database does not keep code objects' first lines.

The profile is written as a stream: first the tables (strings, mappings, locations, functions),
then the samples in batches, each batch one serialized `Profile` holding its samples and any new
strings. Serialized messages concatenate into their merge, with repeated fields appended in
order, so the file is one valid Profile whose string indices are those assigned here, while only
one batch of samples is ever in memory.
"""

from __future__ import annotations

import gzip
import re
from typing import Any, BinaryIO

from tbpipe.pipeline.export.frames import NO_STACK
from tbpipe.pipeline.export.profile_proto import message
from tbpipe.pipeline.export.source import BATCH_ROWS, ExportSource

SAMPLE_TYPE = ("events", "count")
LABEL_KEYS = ("run", "kind", "name", "thread")
_WHOLE_ADDRESS_SPACE = (1 << 64) - 1
_SAMPLES_PER_MESSAGE = 1 << 16
# What pprof takes for a shared library when it looks for the main binary (mapping[0]).
_LIBRARY = re.compile(r"([.]so$|[.]so[._][0-9]+)")


class StringTable:
    """`Profile.string_table`: each string once, index 0 the empty string; new strings wait in `pending`."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.pending: list[str] = []
        self("")

    def __call__(self, text: str | None) -> int:
        if text is None:
            return 0
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.index)
            self.pending.append(text)
        return found

    def take_pending(self) -> list[str]:
        pending, self.pending = self.pending, []
        return pending


def thread_label(thread_id: int, name: str | None) -> str:
    return f"{name} ({thread_id})" if name else str(thread_id)


class _Tables:
    """Mappings, locations and functions of the profile, built from `StackLocations`."""

    def __init__(self, strings: StringTable) -> None:
        self.strings = strings
        self.mappings: dict[str, Any] = {}  # module_key -> Mapping
        self.functions: dict[tuple[str, str], Any] = {}  # (name, file) -> Function
        self.locations: list[Any] = []
        self._Mapping, self._Location = message("Mapping"), message("Location")
        self._Line, self._Function = message("Line"), message("Function")

    def function_id(self, name: str, file: str | None) -> int:
        key = (name, file or "")
        function = self.functions.get(key)
        if function is None:
            function = self.functions[key] = self._Function(
                id=len(self.functions) + 1,
                # No system (mangled) name: pprof then takes `name` as demangled already and
                # leaves it whole (it would cut `<...>` out of a Python `<module>` otherwise).
                name=self.strings(name),
                filename=self.strings(file),
            )
        return function.id

    def mapping(self, location: dict[str, Any]) -> Any:
        key = location["module_key"] or location["module"] or "?"
        mapping = self.mappings.get(key)
        if mapping is None:
            mapping = self.mappings[key] = self._Mapping(
                id=len(self.mappings) + 1,
                memory_start=0,
                memory_limit=_WHOLE_ADDRESS_SPACE,
                file_offset=0,
                filename=self.strings(location["module"]),
                build_id=self.strings(location["build_id"]),
                has_functions=True,
                has_filenames=True,
                has_line_numbers=True,
                has_inline_frames=True,
            )
        return mapping

    def add_locations(self, locations: list[dict[str, Any]]) -> None:
        """Every location (`StackLocations.locations` rows), its mappings made first with the main
        program's ahead of the libraries': pprof reads mapping[0] as the main binary."""
        natives = [location for location in locations if location["kind"] == "native"]
        for location in sorted(natives, key=lambda loc: bool(_LIBRARY.search(loc["module"] or ""))):
            self.mapping(location)
        for location in locations:
            self.add_location(location["location_id"], location)

    def add_location(self, location_id: int, location: dict[str, Any]) -> None:
        kind, lines = location["kind"], location["lines"]
        entry = self._Location(id=location_id)
        if kind == "native":
            mapping = self.mapping(location)
            entry.mapping_id = mapping.id
            address = location["address"] or 0
            entry.address = address - 1 if address and not location["exact"] else address
            if not lines or not lines[0]["function"]:
                # Unsymbolized: pprof may symbolize the address itself.
                mapping.has_functions = mapping.has_filenames = False
                mapping.has_line_numbers = mapping.has_inline_frames = False
                self.locations.append(entry)
                return
            if any(line["file"] is None for line in lines):
                mapping.has_filenames = False
            if any(line["line"] is None for line in lines):
                mapping.has_line_numbers = mapping.has_inline_frames = False
        for line in lines:
            name = line["function"] or ("native walk stopped" if kind == "marker" else "<unknown code>")
            if kind == "marker":
                name = f"[{name}]"
            entry.line.add(function_id=self.function_id(name, line["file"]), line=line["line"] or 0)
        self.locations.append(entry)


def _header(source: ExportSource, strings: StringTable) -> Any:
    Profile, ValueType = message("Profile"), message("ValueType")
    started = [run.started_ns for run in source.runs if run.started_ns is not None]
    ended = [run.ended_ns for run in source.runs if run.ended_ns is not None]
    profile = Profile(
        sample_type=[ValueType(type=strings(SAMPLE_TYPE[0]), unit=strings(SAMPLE_TYPE[1]))],
        period_type=ValueType(type=strings(SAMPLE_TYPE[0]), unit=strings(SAMPLE_TYPE[1])),
        period=1,
        default_sample_type=strings(SAMPLE_TYPE[0]),
    )
    if started:
        profile.time_nanos = min(started)
        if ended:
            profile.duration_nanos = max(0, max(ended) - min(started))
    what = source.choice.describe()
    profile.comment.append(
        strings(f"tbpipe export of run{'s' if len(source.run_ids) > 1 else ''} {', '.join(source.run_ids)}")
    )
    if what:
        profile.comment.append(strings(f"events of {what}"))
    return profile


def write_pprof(source: ExportSource, out: BinaryIO, compresslevel: int = 1) -> int:
    """Writes the source's events as a gzipped pprof profile to `out`; returns the events its samples count.

    `compresslevel` 1 is what pprof itself writes (gzip's fastest)."""
    Profile, Sample, Label = message("Profile"), message("Sample"), message("Label")
    strings = StringTable()
    header = _header(source, strings)

    located = source.stack_locations()
    tables = _Tables(strings)
    tables.add_locations(located.locations.to_pylist())
    no_stack_id = located.locations.num_rows + 1
    tables.add_location(
        no_stack_id,
        {"kind": "python", "lines": [{"function": NO_STACK, "file": None, "line": None, "inlined": False}]},
    )
    # Each stack's location list, serialized once as a Sample holding only it; a sample is then
    # the merge of its stack's, its labels' and its value's serialized parts.
    stack_parts = {
        row["stack_id"]: Sample(location_id=row["location_ids"]).SerializeToString()
        for row in located.stacks.to_pylist()
    }
    no_stack = Sample(location_id=[no_stack_id]).SerializeToString()
    del located

    runs = {run.run_number: run for run in source.runs}
    keys = [strings(key) for key in LABEL_KEYS]
    label_parts: dict[tuple[int, int, int], bytes] = {}
    value_parts: dict[int, bytes] = {}

    def labels(run_number: int, name_id: int, thread_id: int) -> bytes:
        run = runs[run_number]
        kind, name = source.names[name_id]
        values = (run.run_id, kind, name, thread_label(thread_id, run.threads.get(thread_id)))
        part = Sample(label=[Label(key=key, str=strings(value)) for key, value in zip(keys, values)])
        label_parts[(run_number, name_id, thread_id)] = part = part.SerializeToString()
        return part

    def value(events: int) -> bytes:
        part = Sample(value=[events]).SerializeToString()
        if len(value_parts) < 1 << 16:
            value_parts[events] = part
        return part

    with gzip.GzipFile(filename="", fileobj=out, mode="wb", compresslevel=compresslevel, mtime=0) as packed:
        header.mapping.extend(tables.mappings.values())
        header.location.extend(tables.locations)
        header.function.extend(tables.functions.values())
        header.string_table.extend(strings.take_pending())
        packed.write(header.SerializeToString())
        del header, tables

        total = 0
        batch = Profile()
        add_sample = batch.sample.add
        for record in source.sample_batches(BATCH_ROWS):
            columns = [record.column(i).to_pylist() for i in range(5)]
            for run_number, name_id, thread_id, stack_id, events in zip(*columns):
                # The loop runs once per sample (millions): caches are read inline.
                label = label_parts.get((run_number, name_id, thread_id)) or labels(run_number, name_id, thread_id)
                count = value_parts.get(events) or value(events)
                add_sample().MergeFromString(stack_parts.get(stack_id, no_stack) + label + count)
                total += events
                if len(batch.sample) >= _SAMPLES_PER_MESSAGE:
                    batch.string_table.extend(strings.take_pending())
                    packed.write(batch.SerializeToString())
                    batch = Profile()
                    add_sample = batch.sample.add
        batch.string_table.extend(strings.take_pending())
        packed.write(batch.SerializeToString())
    return total
