// One combined raw stack of the calling thread: native frames from the
// unwinder, Python frames from the frame-chain walk, and a content hash that
// deduplicates identical stacks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "frames.h"
#include "python_frames.h"
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

// A stack gathered earlier on this thread whose frames are all still running (an event inside
// an op whose own event gathered it): a later gather copies its outer part instead of walking it.
struct StackSplice {
  const RawStack* stack;
  const NativeFrameState* native_states;  // one per native frame of `stack`
  const void* python_top;                 // the first Python frame it wrote (its interpreter frame)
  const void* anchor;                     // an address in a stack frame that has not returned since
};

// gather_stack, also keeping what a later gather needs to splice onto this one (`states`, sized
// kMaxNativeFrames, and *python_top), and splicing onto `splice` when not null. Same result.
void gather_stack_spliced(RawStack* stack, bool python, bool native, const UnwindOptions& options,
                          NativeFrameState* states, const void** python_top, const StackSplice* splice);

// Content hash over every frame and the status; never 0 (0 means "no stack").
uint64_t hash_stack(const RawStack& stack);

}  // namespace tbpipe
