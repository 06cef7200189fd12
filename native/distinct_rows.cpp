#include "distinct_rows.h"

#include <cstring>

#include "hash_mix.h"

namespace tbpipe {
namespace {

uint64_t hash_row(const uint8_t* row, size_t width) {
  uint64_t hash = width;
  size_t at = 0;
  for (; at + 8 <= width; at += 8) {
    uint64_t word;
    std::memcpy(&word, row + at, 8);
    hash = mix64(hash ^ word) + 0x9E3779B97F4A7C15ull;
  }
  if (at < width) {
    uint64_t word = 0;
    std::memcpy(&word, row + at, width - at);
    hash = mix64(hash ^ word);
  }
  return mix64(hash);
}

struct Entry {
  uint64_t hash = 0;
  int64_t id = -1;  // -1: empty
};

constexpr size_t kAhead = 16;  // rows whose table slot is fetched ahead of their lookup

// One pass over the rows with their hashes. With `exact`, rows of one hash are compared byte by
// byte; without, equal hashes are taken for equal rows (the caller checks afterwards). Returns
// false when `exact` is off and two rows of one hash differ.
void assign_ids(const uint8_t* rows, size_t count, size_t width, const uint64_t* hashes, bool exact, int64_t* ids,
                std::vector<int64_t>& first, std::vector<uint8_t>& values) {
  // The table grows with the distinct values, not the rows, and the distinct rows' bytes are kept
  // together: most rows repeat a value, so both stay in cache where the input rows would not.
  std::vector<Entry> table(1024);
  size_t mask = table.size() - 1;
  for (size_t row = 0; row < count; ++row) {
    if (row + kAhead < count) __builtin_prefetch(&table[hashes[row + kAhead] & mask]);
    const uint8_t* bytes = rows + row * width;
    const uint64_t hash = hashes[row];
    size_t slot = hash & mask;
    while (true) {
      Entry& entry = table[slot];
      if (entry.id < 0) {
        const auto id = static_cast<int64_t>(first.size());
        entry = Entry{hash, id};
        ids[row] = id;
        first.push_back(static_cast<int64_t>(row));
        values.insert(values.end(), bytes, bytes + width);
        break;
      }
      if (entry.hash == hash &&
          (!exact || std::memcmp(values.data() + static_cast<size_t>(entry.id) * width, bytes, width) == 0)) {
        ids[row] = entry.id;
        break;
      }
      slot = (slot + 1) & mask;
    }
    if (first.size() * 2 > table.size()) {  // over half full: twice the size, entries placed again
      std::vector<Entry> grown(table.size() * 2);
      mask = grown.size() - 1;
      for (const Entry& entry : table) {
        if (entry.id < 0) continue;
        size_t at = entry.hash & mask;
        while (grown[at].id >= 0) at = (at + 1) & mask;
        grown[at] = entry;
      }
      table.swap(grown);
    }
  }
}

}  // namespace

std::vector<int64_t> distinct_rows(const uint8_t* rows, size_t count, size_t width, int64_t* ids,
                                   bool exact_pass_only) {
  std::vector<uint64_t> hashes(count);
  for (size_t row = 0; row < count; ++row) hashes[row] = hash_row(rows + row * width, width);
  // Ids by hash first: each lookup then waits on one memory read, not on a comparison of bytes
  // far away. The bytes are compared afterwards, row after row (reads that can overlap); two
  // different rows with one 64-bit hash send everything through the exact pass.
  std::vector<int64_t> first;
  std::vector<uint8_t> values;
  if (exact_pass_only) {
    assign_ids(rows, count, width, hashes.data(), true, ids, first, values);
    return first;
  }
  assign_ids(rows, count, width, hashes.data(), false, ids, first, values);
  for (size_t row = 0; row < count; ++row) {
    if (row + kAhead < count) __builtin_prefetch(values.data() + static_cast<size_t>(ids[row + kAhead]) * width);
    if (std::memcmp(values.data() + static_cast<size_t>(ids[row]) * width, rows + row * width, width) != 0) {
      first.clear();
      values.clear();
      assign_ids(rows, count, width, hashes.data(), true, ids, first, values);
      break;
    }
  }
  return first;
}

}  // namespace tbpipe
