// Portable stack hashes computed in one pass over a run's raw frame columns: the same function as
// schemas/identity.py (which spells it out in numpy and stays the reference), for the capture and
// the ingest, which hashes every raw stack of every run to find the few it has not seen.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tbpipe {

// One run's raw stacks as Arrow lays out its `native` and `python` list<struct> columns: per stack,
// frames [offsets[i], offsets[i + 1]) of the child columns. Offsets must be non-decreasing and stay
// within the child columns (checked by the caller).
struct RawStackColumns {
  size_t stacks = 0;
  const uint32_t* status = nullptr;
  const int32_t* native_offsets = nullptr;  // stacks + 1
  const int32_t* native_module = nullptr;   // module_index
  const uint64_t* native_address = nullptr;
  const uint32_t* native_flags = nullptr;
  const int32_t* python_offsets = nullptr;  // stacks + 1
  const uint64_t* python_code = nullptr;    // code_id
  const int32_t* python_line = nullptr;
  const uint32_t* python_flags = nullptr;
};

// What the run's frames refer to, already hashed: its module rows (module_index -> hash of the
// module key) and its code objects (code_id -> hash of file, qualname, first line). Indices and ids
// the run does not describe hash as identity.py's MISSING says.
struct RawStackReferences {
  size_t modules = 0;
  const int64_t* module_index = nullptr;
  const uint64_t* module_hash = nullptr;
  size_t codes = 0;
  const uint64_t* code_id = nullptr;
  const uint64_t* code_hash = nullptr;
};

// Writes one hash per stack into `out` (columns.stacks of them).
void hash_raw_stacks(const RawStackColumns& columns, const RawStackReferences& references, uint64_t* out);

}  // namespace tbpipe
