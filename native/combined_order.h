// The combined order of a batch of stacks: where each raw frame goes when Python frames are placed
// among native ones. pipeline/stacks/order.py holds the rule (`combined_order`, the per-stack
// reference, beside `combined_orders`, this fast path's binding), and tests/test_rules.py holds the
// two equal. One pass over the frames of each stack instead of a sort of the whole batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tbpipe {

struct CombinedOrderInput {
  size_t stacks = 0;
  const int64_t* native_lengths = nullptr;  // per stack; the stacks' frames lie one after another
  const int64_t* python_lengths = nullptr;
  const uint32_t* status = nullptr;        // per stack
  const uint32_t* native_flags = nullptr;  // per native frame
  const uint32_t* python_flags = nullptr;  // per Python frame
  // The raw format's bits (schemas/raw.py), passed in so that they are defined once.
  uint32_t no_native_bit = 0;  // stack status: the native walk did not run
  uint32_t marker_bit = 0;     // native frame: a marker (why the walk stopped), never an eval loop
  uint32_t eval_bit = 0;       // native frame: CPython's eval loop
  uint32_t entry_bit = 0;      // Python frame: the first the eval loop runs (ends a group)
};

// Slots, stack after stack in combined order, and per stack what `combined_slots` reports on.
struct CombinedOrder {
  std::vector<int64_t> owner;       // per slot: the stack's index
  std::vector<int64_t> source;      // per slot: the row in the native or Python frames
  std::vector<uint8_t> is_python;   // per slot: 1 for a Python frame
  std::vector<int32_t> slot;        // per slot: its position in its stack
  std::vector<uint8_t> has_native;  // per stack: the native walk ran and found frames
  std::vector<uint8_t> truncated;   // per stack: a marker says the native walk stopped early
  std::vector<int64_t> leftover;    // per stack: Python frames no eval-loop frame claims
};

// The lengths must be non-negative and add up to the frame columns' lengths (the caller checks).
CombinedOrder combined_order(const CombinedOrderInput& input);

// What `combined_slots` shows of each slot, gathered from the frame columns in one pass (numpy took a
// pass over all the slots per column and condition).
struct SlotColumnsInput {
  size_t slots = 0;
  const int64_t* source = nullptr;     // per slot: CombinedOrder::source
  const uint8_t* is_python = nullptr;  // per slot: CombinedOrder::is_python
  size_t native_frames = 0;
  const int64_t* native_ref = nullptr;  // per native frame: row of the modules table, -1 none
  const uint64_t* native_address = nullptr;
  const uint32_t* native_flags = nullptr;
  size_t python_frames = 0;
  const int64_t* python_ref = nullptr;  // per Python frame: row of the code table, -1 none
  const int32_t* python_line = nullptr;
  const uint32_t* python_flags = nullptr;
  size_t code_rows = 0;
  const int32_t* code_first_line = nullptr;                  // per code row
  uint32_t marker_bit = 0, exact_bit = 0, origin_bit = 0;    // native marker, native exact PC, Python origin
  int8_t python_kind = 0, native_kind = 1, marker_kind = 2;  // the layout's kind codes
};

struct SlotColumns {
  std::vector<int8_t> kind;
  std::vector<int64_t> module_row;  // native frames: row of the modules table; else -1
  std::vector<int64_t> code_row;    // Python frames: row of the code table; else -1
  std::vector<uint64_t> address;    // native frames and markers (the stop reason); Python 0
  std::vector<uint8_t> exact;       // native frames: not a return address
  std::vector<int32_t> line;        // Python frames; else -1
  std::vector<uint8_t> inlined;     // Python frames placed from code origins
  std::vector<int32_t> first_line;  // Python frames of a known code row; else -1
};

// Throws std::out_of_range when a source row or code row lies outside its column.
SlotColumns slot_columns(const SlotColumnsInput& input);

}  // namespace tbpipe
