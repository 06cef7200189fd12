// Drained event columns laid out as Arrow arrays hold them, so that the flusher wraps buffers
// instead of computing per event in Python: validity bitmaps, and dictionary columns of interned
// strings (each string once in its dictionary, every event an index into it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tbpipe {

// Arrow's validity bitmap of `count` values into `bits` (bit i set: value i is valid), least
// significant bit first.
template <typename IsValid>
void fill_validity(std::vector<uint8_t>* bits, size_t count, IsValid is_valid) {
  bits->assign((count + 7) / 8, 0);
  for (size_t byte = 0; byte < bits->size(); ++byte) {  // a byte at a time: no store per value
    const size_t first = byte * 8;
    const size_t end = first + 8 < count ? first + 8 : count;
    unsigned value = 0;
    for (size_t i = first; i < end; ++i) value |= (is_valid(i) ? 1u : 0u) << (i - first);
    (*bits)[byte] = static_cast<uint8_t>(value);
  }
}

// A column of interned string ids as an Arrow dictionary column: `indices` into `strings` (the ids
// used, in the order first used), and where id 0 means none, `validity` (else empty).
struct DictionaryColumn {
  std::vector<int32_t> indices;
  std::vector<uint32_t> strings;
  std::vector<uint8_t> validity;
};

// Fills `column` (its vectors' room is reused) from `ids`.
void fill_dictionary(const std::vector<uint32_t>& ids, bool zero_is_null, DictionaryColumn* column);

}  // namespace tbpipe
