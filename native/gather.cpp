#include "gather.h"

#include <memory>

#include "python_frames.h"

namespace tbpipe {

RawStack& thread_scratch_stack() {
  thread_local std::unique_ptr<RawStack> scratch;
  if (!scratch) scratch.reset(new RawStack());
  return *scratch;
}

void gather_stack(RawStack* stack, bool python, bool native, const UnwindOptions& options) {
  gather_stack_spliced(stack, python, native, options, nullptr, nullptr, nullptr);
}

void gather_stack_spliced(RawStack* stack, bool python, bool native, const UnwindOptions& options,
                          NativeFrameState* states, const void** python_top, const StackSplice* splice) {
  stack->status = 0;
  stack->native_count = 0;
  stack->python_count = 0;
  if (python_top != nullptr) *python_top = nullptr;
  // An earlier stack's halves are usable only if it has them and its anchor is on this stack.
  const bool live = splice != nullptr && address_on_this_stack(splice->anchor);
  if (native) {
    NativeSplice native_splice;
    const bool splice_native = live && !(splice->stack->status & kStackNoNative) && splice->native_states != nullptr;
    if (splice_native) {
      native_splice = NativeSplice{splice->stack->native, splice->native_states, splice->stack->native_count,
                                   reinterpret_cast<uintptr_t>(splice->anchor)};
    }
    stack->native_count = unwind_native_spliced(stack->native, states, kMaxNativeFrames, options,
                                                splice_native ? &native_splice : nullptr);
    if (stack->native_count > 0 && (stack->native[stack->native_count - 1].flags & kFrameMarker)) {
      stack->status |= kStackNativeTruncated;
    }
  } else {
    stack->status |= kStackNoNative;
  }
  if (python) {
    bool truncated = false;
    PythonSplice python_splice;
    const bool splice_python = live && !(splice->stack->status & kStackNoPython) && splice->python_top != nullptr;
    if (splice_python) {
      python_splice = PythonSplice{splice->python_top, splice->stack->python, splice->stack->python_count,
                                   (splice->stack->status & kStackPythonTruncated) != 0};
    }
    stack->python_count = walk_python_frames_spliced(stack->python, kMaxPythonFrames, &truncated,
                                                     splice_python ? &python_splice : nullptr, python_top);
    if (truncated) stack->status |= kStackPythonTruncated;
  } else {
    stack->status |= kStackNoPython;
  }
}

namespace {

constexpr uint64_t kMultiplier = 0x9E3779B97F4A7C15ULL;

inline uint64_t fold(uint64_t lane, uint64_t word) {
  lane ^= word;
  lane *= kMultiplier;
  return lane ^ (lane >> 31);
}

}  // namespace

uint64_t hash_stack(const RawStack& stack) {
  // Four independent lanes so the multiplies of neighbouring frames overlap;
  // a single chained hash would cost ~4 cycles of latency per frame.
  uint64_t lanes[4] = {0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL, 0xA4093822299F31D0ULL, 0x082EFA98EC4E6C89ULL};
  size_t i = 0;
  for (; i < stack.native_count; ++i) {
    const NativeFrame& frame = stack.native[i];
    uint64_t word = static_cast<uint64_t>(frame.pc) ^ (static_cast<uint64_t>(frame.flags) << 56) ^
                    (static_cast<uint64_t>(static_cast<uint32_t>(frame.module)) << 40);
    lanes[i & 3] = fold(lanes[i & 3], word);
  }
  for (size_t j = 0; j < stack.python_count; ++j, ++i) {
    const PythonFrame& frame = stack.python[j];
    uint64_t word =
        (frame.code_id << 34) ^ (static_cast<uint64_t>(frame.flags) << 32) ^ static_cast<uint32_t>(frame.instr_offset);
    lanes[i & 3] = fold(lanes[i & 3], word);
  }
  uint64_t h = fold(lanes[0], lanes[1]);
  h = fold(h, lanes[2]);
  h = fold(h, lanes[3]);
  h = fold(h, (static_cast<uint64_t>(stack.native_count) << 40) ^ (static_cast<uint64_t>(stack.python_count) << 8) ^
                  stack.status);
  return h == 0 ? 1 : h;
}

}  // namespace tbpipe
