// Inline expansion of laid-out stacks (pipeline/stacks/layout.py's `expand`): each native slot whose
// address the symbols rows know becomes its inline chain (innermost first), every other slot one row
// of its own, and each row is given a distinct-frame id. Two `distinct_rows` passes (the addresses
// of symbols rows and slots, then the slots' classes) and one pass writing the rows, where numpy
// needed a sort of the symbols, several gathers per row and a hash of packed keys per row.
// Only integers are handled here; the frames' texts are taken in Arrow, once per distinct frame.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tbpipe {

struct InlineRowsInput {
  size_t slots = 0;  // per slot, stack after stack (a stack's slots contiguous, in order)
  const int64_t* stack_id = nullptr;
  const int32_t* slot = nullptr;
  const int8_t* kind = nullptr;
  const int64_t* key_code = nullptr;     // the module key's code shared with the symbols rows; -1 none
  const uint64_t* address = nullptr;     // native address; a marker's stop reason
  const uint8_t* exact = nullptr;        // native: not a return address
  const int64_t* module_code = nullptr;  // code of the module path (-1 none)
  const int64_t* function_code = nullptr;
  const int64_t* file_code = nullptr;
  const int32_t* line = nullptr;
  const int32_t* first_line = nullptr;
  const uint8_t* inlined = nullptr;          // Python frames placed from code origins; nullptr: none is
  size_t symbols = 0;                        // per symbols row: one row of an address's inline chain
  const int64_t* symbol_key_code = nullptr;  // -1: a module no slot can name (the row is never used)
  const uint64_t* symbol_address = nullptr;
  const uint8_t* symbol_exact = nullptr;
  const int32_t* symbol_depth = nullptr;  // 0 innermost
  int8_t python_kind = 0, native_kind = 1;
};

// A row per frame of each stack: a chain row per symbols row of a native slot's chain, else the
// slot's own row.
struct InlineRows {
  std::vector<int64_t> stack_id;     // per row: its slot's stack
  std::vector<int32_t> depth;        // position within the stack, 0 innermost
  std::vector<int32_t> slot;         // its slot's position
  std::vector<int32_t> chain_depth;  // position within the slot's inline chain
  // Distinct frames, numbered in order of first appearance. A chain row is its symbols row in its
  // module (and origin mark); a Python row is its function, file, line, first line and origin mark;
  // any other row is its address, module, module key, kind and exactness. Rows of the three groups
  // never share a frame.
  std::vector<int32_t> frame;
  std::vector<int64_t> frame_slot;        // per frame: the slot of its first row
  std::vector<int64_t> frame_symbol_row;  // per frame: the symbols row of a chain row's frame, else -1
};

InlineRows inline_rows(const InlineRowsInput& input);

}  // namespace tbpipe
