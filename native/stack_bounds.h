// The unwinder's one rule for reading the stack: which words of a thread's stack a walk may load.
#pragma once

#include <cstdint>

namespace tbpipe {

// Stack reads allowed in [lo, hi): the whole aligned word must lie inside, so the last readable word
// starts at hi - 8 (on the main thread the page past the top may be unmapped). lo is the walk's
// starting rsp, below which nothing of interest lives and the main thread's stack may not be mapped.
struct StackBounds {
  uintptr_t lo;
  uintptr_t hi;
  bool allows(uintptr_t addr) const {
    return !(addr < lo || hi < sizeof(uintptr_t) || addr > hi - sizeof(uintptr_t) || (addr & (sizeof(uintptr_t) - 1)));
  }
  bool load(uintptr_t addr, uintptr_t* v) const {
    if (!allows(addr)) return false;
    *v = *reinterpret_cast<const uintptr_t*>(addr);
    return true;
  }
};

}  // namespace tbpipe
