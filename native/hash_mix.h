// The 64-bit finalizer the ingest's hash tables spread their keys with (SplitMix64's): every input
// bit reaches every output bit, so the low bits a table masks with are well mixed.
#pragma once

#include <cstdint>

namespace tbpipe {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

}  // namespace tbpipe
