// Registry of every loaded ELF object (executable, shared libraries, vDSO).
//
// Filled from dl_iterate_phdr, which takes the loader lock, so it is refreshed
// only when a PC falls outside every known module - never on each gather.
// Indices are stable for the life of the process: a library that is unloaded
// keeps its index, one loaded later gets a new one. Lookups are lock-free: they
// read an immutable, sorted snapshot of executable ranges published atomically.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tbpipe {

struct AddressRange {
  uintptr_t lo;  // inclusive
  uintptr_t hi;  // exclusive
};

struct Module {
  int32_t index = -1;
  std::string path;                       // absolute path ("/proc/self/exe" resolved for the main program)
  std::string build_id;                   // lowercase hex of NT_GNU_BUILD_ID, empty when absent
  uintptr_t load_bias = 0;                // dlpi_addr: runtime address = ELF vaddr + load_bias
  std::vector<AddressRange> exec_ranges;  // PT_LOAD segments with PF_X, runtime addresses
  std::vector<AddressRange> eval_ranges;  // CPython eval-loop function bodies in this module
  const uint8_t* eh_frame_hdr = nullptr;  // PT_GNU_EH_FRAME in memory, or null
  size_t eh_frame_hdr_size = 0;
  AddressRange image{0, 0};  // lowest..highest PT_LOAD, for bounds-checking CFI reads
  // PT_LOAD segments with PF_R, runtime addresses. The image range can contain
  // PROT_NONE holes between segments; CFI reads must stay inside one of these.
  std::vector<AddressRange> readable_ranges;
};

class ModuleRegistry {
 public:
  static ModuleRegistry& instance();

  // Lock-free: index of the module whose executable ranges contain `pc`, or -1.
  int32_t lookup(uintptr_t pc) const;
  // Stable pointer for the life of the process, or null for a bad index.
  const Module* module(int32_t index) const;
  size_t size() const { return count_.load(std::memory_order_acquire); }
  // Bumped on every refresh that changed anything; caches keyed by PC compare it.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // Rescan loaded objects under a mutex. Returns true when something new appeared.
  bool refresh();
  // True when `pc` is inside a CPython eval-loop function.
  bool is_eval_pc(int32_t module_index, uintptr_t pc) const;

 private:
  ModuleRegistry();
  struct Snapshot;
  std::atomic<const Snapshot*> snapshot_{nullptr};
  std::atomic<size_t> count_{0};
  std::atomic<uint64_t> generation_{0};
  static constexpr size_t kMaxModules = 1u << 16;
  std::atomic<Module*>* slots_;  // kMaxModules entries, filled append-only
};

}  // namespace tbpipe
