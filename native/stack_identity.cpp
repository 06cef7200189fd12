// Stack hashes in one pass (stack_identity.h). Every constant and step below mirrors
// schemas/identity.py and pipeline/stacks/flatten.py; the tests compare the two on real and
// random runs, since the hash keys `stacks` rows of databases already written.
#include "stack_identity.h"

#include <vector>

#include "frames.h"
#include "hash_mix.h"

namespace tbpipe {
namespace {

constexpr uint64_t kMul1 = 0xBF58476D1CE4E5B9ull;  // also mix64's first multiplier (hash_mix.h)
constexpr uint64_t kNativeBase = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kPythonBase = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kNativeTag = 0x165667B19E3779F9ull;
constexpr uint64_t kPythonTag = 0x27D4EB2F165667C5ull;
constexpr uint64_t kStatusMul = 0xD6E8FEB86659FD93ull;
constexpr uint64_t kLengthMul = 0xFF51AFD7ED558CCDull;
constexpr uint64_t kMissing = 0x5BD1E9955BD1E995ull;

// Open addressing from a 64-bit key to a row: the first row of each key wins, as a stable sort and
// a left search do in the numpy version.
class RowsByKey {
 public:
  RowsByKey(size_t count, const uint64_t* keys) {
    size_t capacity = 16;
    while (capacity < count * 2) capacity <<= 1;
    mask_ = capacity - 1;
    keys_.resize(capacity);
    rows_.assign(capacity, -1);
    for (size_t row = 0; row < count; ++row) {
      size_t slot = mix64(keys[row]) & mask_;
      while (rows_[slot] >= 0 && keys_[slot] != keys[row]) slot = (slot + 1) & mask_;
      if (rows_[slot] < 0) {
        keys_[slot] = keys[row];
        rows_[slot] = static_cast<int64_t>(row);
      }
    }
  }

  int64_t find(uint64_t key) const {
    size_t slot = mix64(key) & mask_;
    while (rows_[slot] >= 0) {
      if (keys_[slot] == key) return rows_[slot];
      slot = (slot + 1) & mask_;
    }
    return -1;
  }

 private:
  size_t mask_ = 0;
  std::vector<uint64_t> keys_;
  std::vector<int64_t> rows_;
};

}  // namespace

void hash_raw_stacks(const RawStackColumns& columns, const RawStackReferences& references, uint64_t* out) {
  std::vector<uint64_t> module_keys(references.modules);
  for (size_t row = 0; row < references.modules; ++row)
    module_keys[row] = static_cast<uint64_t>(references.module_index[row]);
  const RowsByKey module_rows(references.modules, module_keys.data());
  const RowsByKey code_rows(references.codes, references.code_id);

  // Repeated frames hit the same module: remember the last one looked up.
  int32_t last_module = -1;
  uint64_t last_module_hash = kMissing;
  bool have_last_module = false;

  for (size_t stack = 0; stack < columns.stacks; ++stack) {
    uint64_t native = 0;
    uint64_t power = 1;
    const int32_t native_begin = columns.native_offsets[stack];
    const int32_t native_end = columns.native_offsets[stack + 1];
    for (int32_t frame = native_begin; frame < native_end; ++frame) {
      const int32_t module = columns.native_module[frame];
      if (!have_last_module || module != last_module) {
        const int64_t row = module_rows.find(static_cast<uint64_t>(static_cast<int64_t>(module)));
        last_module_hash = row >= 0 ? references.module_hash[row] : kMissing;
        last_module = module;
        have_last_module = true;
      }
      const uint32_t flags = columns.native_flags[frame];
      // An eval-loop frame stands for the Python frames it ran: where in the loop it was is noise.
      const uint64_t address = (flags & kFrameEvalLoop) ? 0 : columns.native_address[frame];
      const uint64_t kept_flags = flags & ~static_cast<uint32_t>(kFrameByFramePointer);
      const uint64_t inner = mix64(address ^ kNativeTag) + kept_flags * kStatusMul;
      native += mix64(last_module_hash ^ mix64(inner)) * power;
      power *= kNativeBase;
    }

    uint64_t python = 0;
    power = 1;
    const int32_t python_begin = columns.python_offsets[stack];
    const int32_t python_end = columns.python_offsets[stack + 1];
    for (int32_t frame = python_begin; frame < python_end; ++frame) {
      const uint64_t code = columns.python_code[frame];
      const int64_t row = code_rows.find(code);
      const uint64_t code_hash = row >= 0 ? references.code_hash[row] : mix64(code ^ kMissing);
      const uint64_t line = static_cast<uint64_t>(static_cast<int64_t>(columns.python_line[frame]));
      const uint64_t kept_flags = columns.python_flags[frame] & ~static_cast<uint32_t>(kPyFrameLineResolved);
      const uint64_t inner = mix64(line ^ kPythonTag) + kept_flags * kStatusMul;
      python += mix64(code_hash ^ mix64(inner)) * power;
      power *= kPythonBase;
    }

    const uint64_t native_length = static_cast<uint64_t>(native_end - native_begin);
    const uint64_t python_length = static_cast<uint64_t>(python_end - python_begin);
    const uint64_t shape =
        native_length * kLengthMul + python_length * kMul1 + static_cast<uint64_t>(columns.status[stack]) * kStatusMul;
    out[stack] = mix64(mix64(native ^ kNativeTag) + mix64(python ^ kPythonTag) + mix64(shape));
  }
}

}  // namespace tbpipe
