#include "inline_rows.h"

#include <algorithm>
#include <array>
#include <limits>
#include <stdexcept>

#include "distinct_rows.h"

namespace tbpipe {
namespace {

// The inline chains: the symbols rows of each address, ordered by depth (ties kept in input order),
// and the chain of each slot (-1: none, the slot is a row of its own).
struct Chains {
  std::vector<int64_t> start;    // per chain: where its rows begin in `rows` (one more at the end)
  std::vector<int64_t> rows;     // symbols rows, chain after chain
  std::vector<int32_t> of_slot;  // per slot
  int64_t length(int64_t chain) const { return chain >= 0 ? start[chain + 1] - start[chain] : 1; }
};

// An address in its module: (module key code * 2 + exact, address).
using AddressKey = std::array<uint64_t, 2>;

AddressKey address_key(int64_t key_code, bool exact, uint64_t address) {
  return {static_cast<uint64_t>(key_code) * 2 + (exact ? 1 : 0), address};
}

// One `distinct_rows` over the addresses of the symbols rows followed by those of the native slots:
// ids come in order of first appearance, so the symbols rows' addresses take the first ids (one
// per chain) and a slot whose id lies past them has no chain.
Chains find_chains(const InlineRowsInput& input) {
  std::vector<AddressKey> keys;
  std::vector<int64_t> symbol_rows, looked_up;
  for (size_t r = 0; r < input.symbols; ++r) {
    if (input.symbol_key_code[r] < 0) continue;  // a module no slot names
    symbol_rows.push_back(static_cast<int64_t>(r));
    keys.push_back(address_key(input.symbol_key_code[r], input.symbol_exact[r] != 0, input.symbol_address[r]));
  }
  for (size_t s = 0; s < input.slots; ++s) {
    if (input.kind[s] != input.native_kind || input.key_code[s] < 0) continue;
    looked_up.push_back(static_cast<int64_t>(s));
    keys.push_back(address_key(input.key_code[s], input.exact[s] != 0, input.address[s]));
  }
  std::vector<int64_t> ids(keys.size());
  const std::vector<int64_t> first =
      distinct_rows(reinterpret_cast<const uint8_t*>(keys.data()), keys.size(), sizeof(AddressKey), ids.data());
  const auto count = static_cast<size_t>(
      std::lower_bound(first.begin(), first.end(), static_cast<int64_t>(symbol_rows.size())) - first.begin());

  Chains chains;
  chains.of_slot.assign(input.slots, -1);
  for (size_t k = 0; k < looked_up.size(); ++k) {
    const int64_t id = ids[symbol_rows.size() + k];
    if (id < static_cast<int64_t>(count)) chains.of_slot[static_cast<size_t>(looked_up[k])] = static_cast<int32_t>(id);
  }
  chains.start.assign(count + 1, 0);
  for (size_t k = 0; k < symbol_rows.size(); ++k) ++chains.start[static_cast<size_t>(ids[k]) + 1];
  for (size_t c = 0; c < count; ++c) chains.start[c + 1] += chains.start[c];
  chains.rows.resize(symbol_rows.size());
  std::vector<int64_t> fill(chains.start.begin(), chains.start.end() - 1);
  for (size_t k = 0; k < symbol_rows.size(); ++k) {
    chains.rows[static_cast<size_t>(fill[static_cast<size_t>(ids[k])]++)] = symbol_rows[k];
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
  return chains;
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
  const Chains chains = find_chains(input);

  // Each slot's class, and the rows in all.
  std::vector<ClassKey> keys(input.slots);
  size_t total = 0;
  for (size_t s = 0; s < input.slots; ++s) {
    keys[s] = class_key(input, s, chains.of_slot[s]);
    total += static_cast<size_t>(chains.length(chains.of_slot[s]));
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
    const int64_t chain = chains.of_slot[s];
    const int64_t begin = chain >= 0 ? chains.start[chain] : 0;
    const int64_t length = chains.length(chain);
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
