// One combined raw stack of the calling thread: native frames from the
// unwinder, Python frames from the frame-chain walk, and a content hash that
// deduplicates identical stacks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "frames.h"
#include "unwind.h"

namespace tbpipe {

enum StackStatus : uint32_t {
  kStackNativeTruncated = 1u << 0,  // native walk ended with a marker frame (see its reason)
  kStackPythonTruncated = 1u << 1,  // more than kMaxPythonFrames Python frames
  kStackNoNative = 1u << 2,         // native frames were not requested
  kStackNoPython = 1u << 3,         // Python frames were not requested
};

struct RawStack {
  size_t native_count = 0;
  size_t python_count = 0;
  uint32_t status = 0;
  NativeFrame native[kMaxNativeFrames];
  PythonFrame python[kMaxPythonFrames];
};

// Scratch stack of the calling thread, allocated on its first use and reused:
// RawStack is ~24 KiB, too big for the stacks of some callback threads.
RawStack& thread_scratch_stack();

void gather_stack(RawStack* stack, bool python, bool native, const UnwindOptions& options);

// Content hash over every frame and the status; never 0 (0 means "no stack").
uint64_t hash_stack(const RawStack& stack);

}  // namespace tbpipe
