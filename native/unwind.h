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

// Walks the calling thread's stack, innermost first, starting at unwind_native's
// own frame (exact PC; left out by skip_own_module). Writes at most `max` frames (the last one may be a marker with
// kFrameMarker set and pc = StopReason); a walk that reaches the outermost frame
// writes no marker. Returns the number of frames written. No locks and no
// allocation once the thread is warm (the first call sets up its cache and
// stack bounds).
size_t unwind_native(NativeFrame* out, size_t max, const UnwindOptions& options);

}  // namespace tbpipe
