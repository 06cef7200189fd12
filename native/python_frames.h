// Python side of a combined stack: a direct walk of the calling thread's own
// CPython frame chain (3.10 PyFrameObject, 3.11+ _PyInterpreterFrame), plus
// the registry that interns code objects.
//
// The walk reads only the calling thread's frames, which no other thread
// changes, so it needs no GIL - it works inside C callbacks that released it.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "frames.h"

namespace tbpipe {

// What the pipeline needs to know about one code object.
struct CodeInfo {
  uint64_t code_id = 0;
  std::string filename;
  std::string qualname;
  int first_line = 0;
  PyObject* code = nullptr;  // strong reference while interned with the GIL; null for copies
};

// Interns code objects. Interning with the GIL keeps a strong reference, so an
// interned pointer can never be reused by another object (the guard against
// address reuse). Without the GIL a code object cannot be referenced safely,
// so its strings are copied and its frame carries an already resolved line.
class CodeRegistry {
 public:
  static CodeRegistry& instance();
  // Id of an interned code object, or 0. Lock-free for objects interned with
  // the GIL; *is_copy is set for copies made without it.
  uint64_t find(PyObject* code, bool* is_copy) const;
  // Interns `code` (the GIL must be held). Returns its id.
  uint64_t intern_with_gil(PyObject* code);
  // Interns a copy of `code`'s names without the GIL (cold path). Returns its id.
  uint64_t intern_copy_without_gil(PyObject* code);
  // Copy of the info for `code_id` (the GIL must be held); false when unknown.
  bool info(uint64_t code_id, CodeInfo* out) const;
  // Line for an instruction byte offset of an interned code (GIL held); -1 if unknown.
  int line_for(uint64_t code_id, int32_t instr_offset) const;
  size_t size() const;
  void reset_after_fork();

 private:
  CodeRegistry();
  struct Impl;
  Impl* impl_;
};

// Walks the calling thread's Python frames, innermost first, into `out`.
// Returns the number written; sets *truncated when kMaxPythonFrames was hit.
size_t walk_python_frames(PythonFrame* out, size_t max, bool* truncated);

// An earlier walk of this thread whose frames are all still running: `top` is the first frame it
// wrote (an interpreter frame's address), suspended in a call that has not returned since.
struct PythonSplice {
  const void* top;
  const PythonFrame* frames;
  size_t count;
  bool truncated;
};

// The same, taking the frames from `splice` (when not null) once the walk reaches its top frame,
// and setting *first to the address of the first frame written (null when none).
size_t walk_python_frames_spliced(PythonFrame* out, size_t max, bool* truncated, const PythonSplice* splice,
                                  const void** first);

// The frame a walk of the calling thread would write first (an interpreter frame's address), or null
// when it has none: equal to an earlier walk's first frame, the thread's Python stack is the same.
const void* innermost_python_frame();

// What decides the calling thread's Python stack, read without interning anything: a hash over each
// frame's code object (its address and first line), instruction offset and entry flag, and the frame
// a walk would write first. Equal hashes mean that a walk writes the same frames, as long as a code
// object's address was not reused by another with the same first line. (Which C path an instruction
// takes, such as a call specialized by CPython in place, is told apart by the native frames: see
// Recorder::set_stack_reuse.)
struct PythonStackKey {
  const void* innermost;  // null when the thread has no Python frames
  uint64_t hash;
};
PythonStackKey python_stack_key();

// True when the calling thread holds the GIL (its thread state is current).
bool thread_holds_gil();

}  // namespace tbpipe
