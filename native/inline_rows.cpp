#include "inline_rows.h"

#include <array>
#include <limits>
#include <stdexcept>

#include "distinct_rows.h"
#include "hash_mix.h"

namespace tbpipe {
namespace {

// The chain of each address: (module key code * 2 + exact, address) -> chain id, by open addressing.
// The table holds the symbols rows' distinct addresses only, so it stays small and in cache.
class AddressChains {
 public:
  using Key = std::array<uint64_t, 2>;

  int64_t find(const Key& key) const {
    const uint64_t h = hash(key);
    for (size_t at = h & mask_;; at = (at + 1) & mask_) {
      const Entry& entry = table_[at];
      if (entry.id < 0) return -1;
      if (entry.key == key) return entry.id;
    }
  }

  int64_t find_or_add(const Key& key) {
    const uint64_t h = hash(key);
    size_t at = h & mask_;
    for (;; at = (at + 1) & mask_) {
      const Entry& entry = table_[at];
      if (entry.id < 0) break;
      if (entry.key == key) return entry.id;
    }
    const auto id = static_cast<int64_t>(count_++);
    table_[at] = Entry{key, id};
    if (count_ * 2 > table_.size()) grow();
    return id;
  }

  size_t size() const { return count_; }

 private:
  struct Entry {
    Key key{};
    int64_t id = -1;  // -1: empty
  };

  static uint64_t hash(const Key& key) { return mix64(mix64(key[0]) ^ key[1]); }

  void grow() {  // over half full: twice the size, entries placed again
    std::vector<Entry> grown(table_.size() * 2);
    mask_ = grown.size() - 1;
    for (const Entry& entry : table_) {
      if (entry.id < 0) continue;
      size_t at = hash(entry.key) & mask_;
      while (grown[at].id >= 0) at = (at + 1) & mask_;
      grown[at] = entry;
    }
    table_.swap(grown);
  }

  std::vector<Entry> table_ = std::vector<Entry>(1024);
  size_t count_ = 0;
  size_t mask_ = 1023;
};

AddressChains::Key address_key(int64_t key_code, bool exact, uint64_t address) {
  return {static_cast<uint64_t>(key_code) * 2 + (exact ? 1 : 0), address};
}

// The inline chains: the symbols rows of each address, ordered by depth (ties kept in input order).
struct Chains {
  AddressChains addresses;     // an id per distinct address: its chain
  std::vector<int64_t> start;  // per chain: where its rows begin in `rows` (one more at the end)
  std::vector<int64_t> rows;   // symbols rows, chain after chain
};

void build_chains(const InlineRowsInput& input, Chains& chains) {
  std::vector<int64_t> chain_of(input.symbols, -1);
  for (size_t r = 0; r < input.symbols; ++r) {
    if (input.symbol_key_code[r] < 0) continue;
    chain_of[r] = chains.addresses.find_or_add(
        address_key(input.symbol_key_code[r], input.symbol_exact[r] != 0, input.symbol_address[r]));
  }
  const size_t count = chains.addresses.size();
  chains.start.assign(count + 1, 0);
  for (int64_t chain : chain_of) {
    if (chain >= 0) ++chains.start[static_cast<size_t>(chain) + 1];
  }
  for (size_t c = 0; c < count; ++c) chains.start[c + 1] += chains.start[c];
  chains.rows.resize(static_cast<size_t>(chains.start[count]));
  std::vector<int64_t> fill(chains.start.begin(), chains.start.end() - 1);
  for (size_t r = 0; r < input.symbols; ++r) {
    if (chain_of[r] >= 0) chains.rows[static_cast<size_t>(fill[static_cast<size_t>(chain_of[r])]++)] = r;
  }
  // Chains are a few rows long: an insertion sort by depth, stable.
  for (size_t c = 0; c < count; ++c) {
    int64_t* begin = chains.rows.data() + chains.start[c];
    int64_t* end = chains.rows.data() + chains.start[c + 1];
    for (int64_t* at = begin + 1; at < end; ++at) {
      const int64_t row = *at;
      const int32_t depth = input.symbol_depth[row];
      int64_t* to = at;
      while (to > begin && input.symbol_depth[*(to - 1)] > depth) {
        *to = *(to - 1);
        --to;
      }
      *to = row;
    }
  }
}

// A slot's class: what determines the frames of its rows, packed in three words. Slots of one class
// show the same frames; classes of the three groups never share one.
// - a chain slot: its chain, module path and origin mark. A symbols row belongs to one chain, so
//   chain rows of different classes never share a frame: a class's frames are new when it first
//   appears, one per chain row.
// - a Python slot: function, file, line, first line and origin mark (one frame);
// - any other slot (an unsymbolized address, a marker): address, module path, module key, kind and
//   exactness (one frame).
// Codes are dense indices of a batch's distinct texts (-1 none), so 32 bits each hold them.
using ClassKey = std::array<uint64_t, 3>;

enum SlotGroup : uint64_t { kChainSlot = 0, kPythonSlot = 1, kOtherSlot = 2 };

uint64_t code32(int64_t code) { return static_cast<uint32_t>(code); }

ClassKey class_key(const InlineRowsInput& input, size_t s, int64_t chain) {
  const uint64_t inlined = input.inlined != nullptr && input.inlined[s] != 0 ? 1 : 0;
  if (chain >= 0) {
    return {kChainSlot | inlined << 8, static_cast<uint64_t>(chain), code32(input.module_code[s])};
  }
  if (input.kind[s] == input.python_kind) {
    const uint64_t lines = code32(input.line[s]) << 32 | code32(input.first_line[s]);
    return {kPythonSlot | inlined << 8, code32(input.function_code[s]) << 32 | code32(input.file_code[s]), lines};
  }
  const uint64_t kind = static_cast<uint64_t>(static_cast<uint8_t>(input.kind[s])) * 2 + (input.exact[s] ? 1 : 0);
  return {kOtherSlot | kind << 16, input.address[s], code32(input.module_code[s]) << 32 | code32(input.key_code[s])};
}

}  // namespace

InlineRows inline_rows(const InlineRowsInput& input) {
  Chains chains;
  build_chains(input, chains);

  // Each slot's chain (-1: the slot is a row of its own) and class, and the rows in all.
  std::vector<int32_t> chain_of_slot(input.slots, -1);
  std::vector<ClassKey> keys(input.slots);
  size_t total = 0;
  for (size_t s = 0; s < input.slots; ++s) {
    int64_t chain = -1;
    if (input.kind[s] == input.native_kind && input.key_code[s] >= 0) {
      chain = chains.addresses.find(address_key(input.key_code[s], input.exact[s] != 0, input.address[s]));
    }
    chain_of_slot[s] = static_cast<int32_t>(chain);
    keys[s] = class_key(input, s, chain);
    total += chain >= 0 ? static_cast<size_t>(chains.start[chain + 1] - chains.start[chain]) : 1;
  }
  if (total > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::length_error("too many stack rows in one batch for 32-bit depths and frame ids");
  }
  std::vector<int64_t> class_of_slot(input.slots);
  const std::vector<int64_t> first_slot =
      distinct_rows(reinterpret_cast<const uint8_t*>(keys.data()), input.slots, sizeof(ClassKey), class_of_slot.data());
  keys = std::vector<ClassKey>();  // the keys are no longer needed: free them before the rows grow

  InlineRows out;
  out.stack_id.resize(total);
  out.depth.resize(total);
  out.slot.resize(total);
  out.chain_depth.resize(total);
  out.frame.resize(total);
  // Frames are numbered in order of first appearance: a class's frames when its first slot's rows
  // are written.
  std::vector<int32_t> first_frame(first_slot.size(), -1);
  int32_t next_frame = 0;
  size_t row = 0;
  int32_t depth = 0;
  for (size_t s = 0; s < input.slots; ++s) {
    if (s > 0 && input.stack_id[s] != input.stack_id[s - 1]) depth = 0;
    const int64_t chain = chain_of_slot[s];
    const int64_t begin = chain >= 0 ? chains.start[chain] : 0;
    const int64_t length = chain >= 0 ? chains.start[chain + 1] - begin : 1;
    int32_t& frame = first_frame[static_cast<size_t>(class_of_slot[s])];
    if (frame < 0) {
      frame = next_frame;
      next_frame += static_cast<int32_t>(length);
      for (int64_t k = 0; k < length; ++k) {
        out.frame_slot.push_back(static_cast<int64_t>(s));
        out.frame_symbol_row.push_back(chain >= 0 ? chains.rows[static_cast<size_t>(begin + k)] : -1);
      }
    }
    for (int64_t k = 0; k < length; ++k) {
      out.stack_id[row] = input.stack_id[s];
      out.depth[row] = depth++;
      out.slot[row] = input.slot[s];
      out.chain_depth[row] = static_cast<int32_t>(k);
      out.frame[row] = frame + static_cast<int32_t>(k);
      ++row;
    }
  }
  return out;
}

}  // namespace tbpipe
