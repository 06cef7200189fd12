#include "symcache_lookup.h"

#include <algorithm>
#include <system_error>
#include <thread>

namespace tbpipe {

int32_t InternedStrings::intern(std::string_view text, bool* is_new) {
  auto found = ids_.find(text);
  if (found != ids_.end()) {
    *is_new = false;
    return found->second;
  }
  const auto id = static_cast<int32_t>(strings_.size());
  strings_.emplace_back(text);
  ids_.emplace(strings_.back(), id);
  *is_new = true;
  return id;
}

SymCacheBatchLookup::SymCacheBatchLookup(SymbolicFunctions functions, void* symcache, NewString on_new_string)
    : functions_(functions), symcache_(symcache), on_new_string_(std::move(on_new_string)) {}

int32_t SymCacheBatchLookup::intern(std::string_view text) {
  bool is_new = false;
  const int32_t id = strings_.intern(text, &is_new);
  if (is_new && on_new_string_) on_new_string_(id, strings_.at(id));
  return id;
}

void SymCacheBatchLookup::set_symbols(std::vector<uint64_t> starts, std::vector<uint64_t> ends, SymbolName name_of) {
  symbol_starts_ = std::move(starts);
  symbol_ends_ = std::move(ends);
  symbol_ends_.resize(symbol_starts_.size(), 0);
  symbol_name_ids_.assign(symbol_starts_.size(), -2);
  symbol_name_ = std::move(name_of);
}

void SymCacheBatchLookup::set_code_ranges(std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  code_ranges_ = std::move(ranges);
}

bool SymCacheBatchLookup::outside(uint64_t address) const {
  if (code_ranges_.empty()) return false;
  auto after =
      std::upper_bound(code_ranges_.begin(), code_ranges_.end(), address,
                       [](uint64_t value, const std::pair<uint64_t, uint64_t>& range) { return value < range.first; });
  if (after == code_ranges_.begin()) return true;
  return address >= std::prev(after)->second;
}

int32_t SymCacheBatchLookup::symbol_name_id(uint64_t address) {
  if (symbol_starts_.empty()) return -1;
  const auto after = std::upper_bound(symbol_starts_.begin(), symbol_starts_.end(), address);
  const auto index = static_cast<ptrdiff_t>(after - symbol_starts_.begin()) - 1;
  // Function symbols rarely overlap; a few steps back covers a large symbol
  // that encloses a smaller one (hand-written assembly does this).
  for (ptrdiff_t candidate = index; candidate >= 0 && candidate > index - 8; --candidate) {
    const auto at = static_cast<size_t>(candidate);
    if (symbol_starts_[at] <= address && address < symbol_ends_[at]) {
      int32_t& id = symbol_name_ids_[at];
      if (id == -2) {
        const std::string name = symbol_name_ ? symbol_name_(at) : std::string();
        id = name.empty() ? -1 : intern(name);
      }
      return id;
    }
  }
  return -1;
}

void SymCacheBatchLookup::fetch(const uint64_t* keys, size_t begin, size_t end, unsigned threads,
                                std::vector<SymbolicLookupResultAbi>* results) const {
  results->resize(end - begin);
  auto work = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) (*results)[i - begin] = functions_.lookup(symcache_, keys[i]);
  };
  const size_t count = end - begin;
  if (threads <= 1 || count < 4096) {
    work(begin, end);
    return;
  }
  std::vector<std::thread> helpers;
  const size_t share = (count + threads - 1) / threads;
  size_t next = std::min(end, begin + share);  // [begin, next) is this thread's; the rest is handed out
  const size_t own_end = next;
  for (unsigned t = 1; t < threads && next < end; ++t) {
    const size_t to = std::min(end, next + share);
    try {
      helpers.emplace_back(work, next, to);
    } catch (const std::system_error&) {
      break;  // no more threads (a process limit): what is left is done here
    }
    next = to;
  }
  work(begin, own_end);
  if (next < end) work(next, end);
  for (std::thread& helper : helpers) helper.join();
}

namespace {

// A lookup result owns the strings marked owned (joined paths) besides its
// array; freeing the array does not free them.
void release_result(const SymbolicFunctions& functions, SymbolicLookupResultAbi* result) {
  for (uintptr_t i = 0; i < result->len; ++i) {
    SymbolicSourceLocationAbi& location = result->items[i];
    for (SymbolicStrAbi* text : {&location.lang, &location.symbol, &location.full_path}) {
      if (text->owned) functions.free_str(text);
    }
  }
  functions.free_result(result);
}

}  // namespace

uint32_t SymCacheBatchLookup::take_frames(SymbolicLookupResultAbi result, std::vector<int32_t>* functions,
                                          std::vector<int32_t>* files, std::vector<uint32_t>* lines) {
  // Released however this returns: interning calls back into Python, which may throw.
  struct Release {
    const SymbolicFunctions& functions;
    SymbolicLookupResultAbi& result;
    ~Release() { release_result(functions, &result); }
  } release{functions_, result};
  const auto count = static_cast<uint32_t>(result.len);
  for (uint32_t i = 0; i < count; ++i) {
    const SymbolicSourceLocationAbi& location = result.items[i];
    int32_t name_id = -1;
    const SymbolicStrAbi& symbol = location.symbol;
    if (symbol.len != 0) {
      if (symbol.owned) {
        name_id = intern(std::string_view(symbol.data, symbol.len));
      } else {
        auto found = name_ids_.find(symbol.data);
        if (found == name_ids_.end()) {
          found = name_ids_.emplace(symbol.data, intern(std::string_view(symbol.data, symbol.len))).first;
        }
        name_id = found->second;
      }
    }
    const int32_t path_id =
        location.full_path.len != 0 ? intern(std::string_view(location.full_path.data, location.full_path.len)) : -1;
    functions->push_back(name_id);
    files->push_back(path_id);
    lines->push_back(location.line);
  }
  return count;
}

void SymCacheBatchLookup::resolve(const uint64_t* keys, size_t count, int32_t reason, LookupColumns* out,
                                  unsigned threads) {
  out->keys.reserve(out->keys.size() + count);
  out->counts.reserve(out->counts.size() + count);
  out->reasons.reserve(out->reasons.size() + count);
  std::vector<uint64_t> inside;
  inside.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    if (outside(keys[i])) {
      out->outside.push_back(keys[i]);
    } else {
      inside.push_back(keys[i]);
    }
  }
  // Blocks bound the raw results held at once (~100 bytes a frame).
  constexpr size_t kBlock = 1 << 15;
  std::vector<SymbolicLookupResultAbi> results;
  for (size_t block = 0; block < inside.size(); block += kBlock) {
    const size_t block_end = std::min(inside.size(), block + kBlock);
    fetch(inside.data(), block, block_end, threads, &results);
    size_t i = block;
    try {
      for (; i < block_end; ++i) {
        const uint64_t key = inside[i];
        const size_t first = out->functions.size();
        const uint32_t frames = take_frames(results[i - block], &out->functions, &out->files, &out->lines);
        if (frames == 0) {
          out->empty.push_back(key);
          continue;
        }
        const size_t last = first + frames - 1;
        const int32_t named = symbol_name_id(key);
        if (named >= 0) out->functions[last] = named;
        const auto entry = static_cast<uint32_t>(out->keys.size());
        if (frames == 1 && out->lines[first] == 0) {
          out->without_line.emplace_back(entry, static_cast<uint32_t>(first));
        }
        out->keys.push_back(key);
        out->counts.push_back(frames);
        out->reasons.push_back(reason);
        // Every frame but the outermost (the function the code is in) is inlined.
        out->inlined.insert(out->inlined.end(), frames - 1, 1);
        out->inlined.push_back(0);
      }
    } catch (...) {
      // The result being taken released itself; the ones after it are still held.
      for (size_t rest = i + 1; rest < block_end; ++rest) release_result(functions_, &results[rest - block]);
      throw;
    }
  }
}

void SymCacheBatchLookup::lookup_flat(const uint64_t* keys, size_t count, std::vector<uint32_t>* counts,
                                      std::vector<int32_t>* functions, std::vector<int32_t>* files,
                                      std::vector<uint32_t>* lines) {
  counts->reserve(counts->size() + count);
  for (size_t i = 0; i < count; ++i) {
    counts->push_back(take_frames(functions_.lookup(symcache_, keys[i]), functions, files, lines));
  }
}

std::vector<int32_t> compact_string_ids(const std::vector<std::pair<int32_t*, size_t>>& columns) {
  int32_t highest = -1;
  for (const auto& [values, size] : columns) {
    for (size_t i = 0; i < size; ++i) highest = std::max(highest, values[i]);
  }
  std::vector<int32_t> renumbered(static_cast<size_t>(highest + 1), -1);
  for (const auto& [values, size] : columns) {
    for (size_t i = 0; i < size; ++i) {
      if (values[i] >= 0) renumbered[static_cast<size_t>(values[i])] = 0;
    }
  }
  std::vector<int32_t> used;
  for (size_t old = 0; old < renumbered.size(); ++old) {
    if (renumbered[old] == 0) {
      renumbered[old] = static_cast<int32_t>(used.size());
      used.push_back(static_cast<int32_t>(old));
    }
  }
  for (const auto& [values, size] : columns) {
    for (size_t i = 0; i < size; ++i) {
      if (values[i] >= 0) values[i] = renumbered[static_cast<size_t>(values[i])];
    }
  }
  return used;
}

}  // namespace tbpipe
