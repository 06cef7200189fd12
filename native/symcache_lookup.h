// Batched address lookups in a symbolic SymCache, for the offline symbolizer.
//
// symbolic's Python API costs microseconds per address (a Python object per
// frame, every string decoded); its C ABI answers in a fraction of that. This
// calls the C entry points of the symbolic library that the Python package has
// already loaded (function pointers handed over from its cffi handle) and
// writes the results straight into the columns of a result chunk, with strings
// interned once per resolver. Nothing here touches Python; the bindings
// (symbolize_bindings.cpp) adapt it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tbpipe {

// The part of symbolic's C ABI (symbolic-cabi's symbolic.h) used here. The
// bindings compare these layouts with what cffi reports for the installed
// symbolic before any call goes through them.
struct SymbolicStrAbi {
  const char* data;
  uintptr_t len;
  bool owned;
};

struct SymbolicSourceLocationAbi {
  uint64_t sym_addr;
  uint64_t instr_addr;
  uint32_t line;
  SymbolicStrAbi lang;
  SymbolicStrAbi symbol;
  SymbolicStrAbi full_path;
};

struct SymbolicLookupResultAbi {
  SymbolicSourceLocationAbi* items;
  uintptr_t len;
};

struct SymbolicFunctions {
  SymbolicLookupResultAbi (*lookup)(void* symcache, uint64_t address);
  void (*free_result)(SymbolicLookupResultAbi* result);
  void (*free_str)(SymbolicStrAbi* text);
};

// Content-unique strings by dense id (-1 stands for "none" everywhere).
class InternedStrings {
 public:
  // Id of `text`; `is_new` says whether it was added by this call.
  int32_t intern(std::string_view text, bool* is_new);
  const std::string& at(int32_t id) const { return strings_[static_cast<size_t>(id)]; }
  size_t size() const { return strings_.size(); }

 private:
  std::deque<std::string> strings_;  // a deque: the views in ids_ stay valid as it grows
  std::unordered_map<std::string_view, int32_t> ids_;
};

// Resolved addresses, column by column, in the layout of a ResultChunk.
struct LookupColumns {
  std::vector<uint64_t> keys;
  std::vector<uint32_t> counts;
  std::vector<int32_t> reasons;
  std::vector<int32_t> functions;
  std::vector<int32_t> files;
  std::vector<uint32_t> lines;
  std::vector<uint8_t> inlined;
  // Entries the caller must finish: (entry, frame position) of a single frame
  // without a line (code the line table may still place).
  std::vector<std::pair<uint32_t, uint32_t>> without_line;
  std::vector<uint64_t> outside;  // keys outside every executable range
  std::vector<uint64_t> empty;    // keys the SymCache has no frame for
};

class SymCacheBatchLookup {
 public:
  // Called when a string is interned for the first time (the bindings mirror
  // the table into a Python list).
  using NewString = std::function<void(int32_t id, const std::string& text)>;
  // Name of function symbol `index` (as given to set_symbols); empty: none.
  using SymbolName = std::function<std::string(size_t index)>;

  SymCacheBatchLookup(SymbolicFunctions functions, void* symcache, NewString on_new_string);

  int32_t intern(std::string_view text);
  size_t string_count() const { return strings_.size(); }

  // Function symbols sorted by start; the outermost frame of an address is
  // named after the symbol containing it (SymCache names a function split into
  // hot and .cold parts after whichever part starts lower).
  void set_symbols(std::vector<uint64_t> starts, std::vector<uint64_t> ends, SymbolName name_of);
  // Executable address ranges; addresses outside all of them are not looked up.
  void set_code_ranges(std::vector<std::pair<uint64_t, uint64_t>> ranges);

  // Looks up `count` keys, appending found entries (reason id `reason` each)
  // to `out`. With `threads` > 1 the SymCache lookups of big batches run on
  // that many threads (symbolic's lookups only read the cache); strings are
  // interned on the calling thread, in key order.
  void resolve(const uint64_t* keys, size_t count, int32_t reason, LookupColumns* out, unsigned threads = 1);

  // String id of the name of the function symbol containing `address` (-1: none).
  int32_t symbol_name_id(uint64_t address);

  // The SymCache's frames for each key alone, innermost first: frame count
  // per key, then function id, file id and line per frame.
  void lookup_flat(const uint64_t* keys, size_t count, std::vector<uint32_t>* counts, std::vector<int32_t>* functions,
                   std::vector<int32_t>* files, std::vector<uint32_t>* lines);

 private:
  // Appends the frames of a lookup result and frees it; returns their count.
  uint32_t take_frames(SymbolicLookupResultAbi result, std::vector<int32_t>* functions, std::vector<int32_t>* files,
                       std::vector<uint32_t>* lines);
  // The raw lookup results of keys[begin, end), on `threads` threads.
  void fetch(const uint64_t* keys, size_t begin, size_t end, unsigned threads,
             std::vector<SymbolicLookupResultAbi>* results) const;
  bool outside(uint64_t address) const;

  SymbolicFunctions functions_;
  void* symcache_;
  NewString on_new_string_;
  InternedStrings strings_;
  // Function names point into the SymCache: one id per distinct pointer.
  std::unordered_map<const char*, int32_t> name_ids_;
  std::vector<uint64_t> symbol_starts_;
  std::vector<uint64_t> symbol_ends_;
  std::vector<int32_t> symbol_name_ids_;  // -2: not read yet, -1: no name
  SymbolName symbol_name_;
  std::vector<std::pair<uint64_t, uint64_t>> code_ranges_;
};

// Rewrites string ids in `columns` to a dense numbering of the ids they use
// (-1 stays -1); returns the old id of each new one, in order.
std::vector<int32_t> compact_string_ids(const std::vector<std::pair<int32_t*, size_t>>& columns);

}  // namespace tbpipe
