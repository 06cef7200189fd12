// MD5 (RFC 1321) of many short texts at once, for the portable stack identity: the ingest hashes
// every module key and code object of every run, and `md5_number_lower` (DuckDB's name for the low
// 64 bits of the digest, read little-endian) keys the `stacks` rows of databases already written, so
// the function cannot change. Python's hashlib did the same one text at a time, which cost a
// night of small runs more than the rest of their stack hashing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tbpipe {

// The low 64 bits of the MD5 digest of `size` bytes at `data`, as md5_number_lower gives them.
uint64_t md5_low64(const uint8_t* data, size_t size);

// The same for each text of an Arrow string column: text i is data[offsets[i], offsets[i + 1]).
// Offsets must be non-decreasing and within the data (checked by the caller).
template <typename Offset>
void md5_low64_texts(const Offset* offsets, size_t texts, const uint8_t* data, uint64_t* out) {
  for (size_t i = 0; i < texts; ++i) {
    out[i] = md5_low64(data + offsets[i], static_cast<size_t>(offsets[i + 1] - offsets[i]));
  }
}

}  // namespace tbpipe
