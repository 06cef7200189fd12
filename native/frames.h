// Raw frame records shared by every part of the native capture library.
//
// Nothing here is symbolized: a native frame is an absolute PC plus the index of
// the loaded module it falls in; a Python frame is an interned code id plus the
// instruction offset. The pipeline turns both into names, files and lines later.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tbpipe {

// Depth caps: a walk that reaches them ends with a kDepthLimit marker frame.
constexpr size_t kMaxNativeFrames = 512;
constexpr size_t kMaxPythonFrames = 1024;

enum NativeFrameFlags : uint32_t {
  // The PC lies in CPython's eval loop (_PyEval_EvalFrameDefault or one of its
  // .cold/.part clones): this C frame runs a group of Python frames.
  kFrameEvalLoop = 1u << 0,
  // Found by the frame-pointer fallback rather than by DWARF CFI.
  kFrameByFramePointer = 1u << 1,
  // The PC is exact (innermost frame, or the frame interrupted by a signal), so
  // symbolizers must not look it up at pc - 1.
  kFrameExactPc = 1u << 2,
  // Not a real frame: the walk stopped here; `pc` holds a StopReason.
  kFrameMarker = 1u << 7,
};

// Why a native walk ended early. Stored in a marker frame's `pc` field.
enum class StopReason : uint32_t {
  kComplete = 0,         // reached the outermost frame (return address undefined / zero)
  kUnknownPc = 1,        // PC outside every loaded module, even after a refresh
  kNoUnwindInfo = 2,     // module has no CFI for this PC and frame pointers did not help
  kUnsupportedRule = 3,  // CFI rule the recipe compiler does not handle
  kBadStackRead = 4,     // a needed stack read fell outside the thread's stack
  kDepthLimit = 5,       // kMaxNativeFrames reached
  kNotSupported = 6,     // no native unwinder on this platform
};

struct NativeFrame {
  uintptr_t pc;    // absolute address (return address for callers), or StopReason for markers
  int32_t module;  // index in ModuleRegistry, -1 for markers / unknown
  uint32_t flags;  // NativeFrameFlags
};

enum PythonFrameFlags : uint32_t {
  // The outermost Python frame run by one C-level eval-loop call.
  kPyFrameEntry = 1u << 0,
  // `instr_offset` already holds a resolved line number (captured without the
  // GIL for a code object that was not interned yet; see python_frames.cpp).
  kPyFrameLineResolved = 1u << 1,
};

struct PythonFrame {
  uint64_t code_id;      // interned code id (CodeRegistry)
  int32_t instr_offset;  // byte offset of the current instruction in co_code, or a line
  uint32_t flags;        // PythonFrameFlags
};

}  // namespace tbpipe
