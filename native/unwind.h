// Native stack walker for the calling thread.
//
// x86-64: DWARF CFI from each module's .eh_frame_hdr/.eh_frame; every PC's rule
// is compiled once into a small recipe kept in a per-thread cache, so a warm
// frame costs one hash probe and a couple of loads. aarch64: frame-pointer walk
// with pointer-authentication bits stripped. Every stack read is bounds-checked
// against the thread's stack; the walk never crashes and ends with a marker
// frame when it cannot go on.
#pragma once

#include <cstddef>
#include <cstdint>

#include "frames.h"

namespace tbpipe {

struct UnwindOptions {
  // Leave out the innermost frames that belong to tbpipe's own extension module.
  bool skip_own_module = true;
  // Then also leave out the innermost frames of the module that called tbpipe (a native source's own
  // callback, recording through the C API); never an eval-loop frame.
  bool skip_caller_module = false;
  // Also leave out the frames between tbpipe and the first CPython eval-loop
  // frame (the interpreter's call machinery for a call made from Python).
  bool skip_until_eval = false;
};

// Where the walk was at each frame it wrote: the frame's stack pointer and frame-pointer register
// as the walk knew them. A later walk that reaches the same state at the same live frame reads
// the same stack slots from there on, so it can take the rest of the frames from this walk.
struct NativeFrameState {
  uintptr_t sp;
  uintptr_t bp;
  uintptr_t bp_valid;
};

// An earlier walk of this thread whose outer part is still live: frames whose stack pointer is
// above `anchor` (an address inside the stack frame of a function that has not returned since,
// such as a local of the caller that is still running) are unchanged, and a walk reaching one of
// them in the same state copies the rest instead of walking it.
struct NativeSplice {
  const NativeFrame* frames;
  const NativeFrameState* states;
  size_t count;
  uintptr_t anchor;
};

// Walks the calling thread's stack, innermost first, starting at unwind_native's
// own frame (exact PC; left out by skip_own_module). Writes at most `max` frames (the last one may be a marker with
// kFrameMarker set and pc = StopReason); a walk that reaches the outermost frame
// writes no marker. Returns the number of frames written. No locks and no
// allocation once the thread is warm (the first call sets up its cache and
// stack bounds).
size_t unwind_native(NativeFrame* out, size_t max, const UnwindOptions& options);

// Whether `address` lies on the calling thread's stack (bounds looked up once per thread).
bool address_on_this_stack(const void* address);

// The calling thread's stack, [*lo, *hi) (both 0 when unknown), for callers that keep them.
void this_thread_stack(uintptr_t* lo, uintptr_t* hi);

// How many walks of the calling thread took their outer frames from a splice (for tests).
uint64_t spliced_walks_on_this_thread();

// The same, also writing each frame's walk state into `states` (when not null; sized like `out`)
// and taking the outer frames from `splice` (when not null, and its anchor lies on this thread's
// stack) once the walk reaches them. The result equals a full walk's.
size_t unwind_native_spliced(NativeFrame* out, NativeFrameState* states, size_t max, const UnwindOptions& options,
                             const NativeSplice* splice);

}  // namespace tbpipe
