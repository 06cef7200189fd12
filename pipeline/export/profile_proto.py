"""pprof's `profile.proto` (package `perftools.profiles`) as message classes of the protobuf runtime.

The schema is declared here, field by field, and handed to the runtime's descriptor pool when
first used, so there is no generated code to keep in step with the installed protobuf and no
`protoc` in the build. Names and numbers are those of pprof's `proto/profile.proto` (the fields
tbpipe writes, and the rest of the Profile header); the tests read what is written with them back
with Go's own pprof (`go tool pprof`), which decodes by field number.

    Profile = message("Profile")
    profile = Profile(string_table=[""], ...)
"""

from __future__ import annotations

from functools import cache
from typing import Any

PACKAGE = "perftools.profiles"

# (message, [(field, number, type, repeated, message type)]): the schema, in pprof's order.
# Types: int64 / uint64 / bool / string, or "message" with the message type's name.
SCHEMA: tuple[tuple[str, tuple[tuple[str, int, str, bool, str | None], ...]], ...] = (
    (
        "Profile",
        (
            ("sample_type", 1, "message", True, "ValueType"),
            ("sample", 2, "message", True, "Sample"),
            ("mapping", 3, "message", True, "Mapping"),
            ("location", 4, "message", True, "Location"),
            ("function", 5, "message", True, "Function"),
            ("string_table", 6, "string", True, None),
            ("drop_frames", 7, "int64", False, None),
            ("keep_frames", 8, "int64", False, None),
            ("time_nanos", 9, "int64", False, None),
            ("duration_nanos", 10, "int64", False, None),
            ("period_type", 11, "message", False, "ValueType"),
            ("period", 12, "int64", False, None),
            ("comment", 13, "int64", True, None),
            ("default_sample_type", 14, "int64", False, None),
        ),
    ),
    ("ValueType", (("type", 1, "int64", False, None), ("unit", 2, "int64", False, None))),
    (
        "Sample",
        (
            ("location_id", 1, "uint64", True, None),
            ("value", 2, "int64", True, None),
            ("label", 3, "message", True, "Label"),
        ),
    ),
    (
        "Label",
        (
            ("key", 1, "int64", False, None),
            ("str", 2, "int64", False, None),
            ("num", 3, "int64", False, None),
            ("num_unit", 4, "int64", False, None),
        ),
    ),
    (
        "Mapping",
        (
            ("id", 1, "uint64", False, None),
            ("memory_start", 2, "uint64", False, None),
            ("memory_limit", 3, "uint64", False, None),
            ("file_offset", 4, "uint64", False, None),
            ("filename", 5, "int64", False, None),
            ("build_id", 6, "int64", False, None),
            ("has_functions", 7, "bool", False, None),
            ("has_filenames", 8, "bool", False, None),
            ("has_line_numbers", 9, "bool", False, None),
            ("has_inline_frames", 10, "bool", False, None),
        ),
    ),
    (
        "Location",
        (
            ("id", 1, "uint64", False, None),
            ("mapping_id", 2, "uint64", False, None),
            ("address", 3, "uint64", False, None),
            ("line", 4, "message", True, "Line"),
            ("is_folded", 5, "bool", False, None),
        ),
    ),
    ("Line", (("function_id", 1, "uint64", False, None), ("line", 2, "int64", False, None))),
    (
        "Function",
        (
            ("id", 1, "uint64", False, None),
            ("name", 2, "int64", False, None),
            ("system_name", 3, "int64", False, None),
            ("filename", 4, "int64", False, None),
            ("start_line", 5, "int64", False, None),
        ),
    ),
)


@cache
def _pool() -> Any:
    from google.protobuf import descriptor_pb2, descriptor_pool

    types = descriptor_pb2.FieldDescriptorProto
    scalar = {
        "int64": types.TYPE_INT64,
        "uint64": types.TYPE_UINT64,
        "bool": types.TYPE_BOOL,
        "string": types.TYPE_STRING,
        "message": types.TYPE_MESSAGE,
    }
    file = descriptor_pb2.FileDescriptorProto(name="tbpipe/pprof/profile.proto", package=PACKAGE, syntax="proto3")
    for message_name, fields in SCHEMA:
        message = file.message_type.add(name=message_name)
        for name, number, kind, repeated, type_name in fields:
            field = message.field.add(
                name=name,
                number=number,
                type=scalar[kind],
                label=types.LABEL_REPEATED if repeated else types.LABEL_OPTIONAL,
            )
            if type_name is not None:
                field.type_name = f".{PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


@cache
def message(name: str) -> type:
    """The runtime's message class for `perftools.profiles.<name>`."""
    from google.protobuf import message_factory

    descriptor = _pool().FindMessageTypeByName(f"{PACKAGE}.{name}")
    get_class = getattr(message_factory, "GetMessageClass", None)  # protobuf >= 4.22
    if get_class is None:
        return message_factory.MessageFactory(_pool()).GetPrototype(descriptor)
    return get_class(descriptor)
