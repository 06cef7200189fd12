#include "demangle.h"

#include <cxxabi.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace tbpipe {
namespace {

std::string demangle_one(const std::string& name) {
  // Itanium-ABI names start with _Z (or ___Z for block invocations); anything
  // else would only cost a failed parse.
  if (name.size() < 2 || name[0] != '_' || (name[1] != 'Z' && name[1] != '_')) return name;
  int status = 0;
  char* demangled = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  if (status != 0 || demangled == nullptr) {
    std::free(demangled);
    return name;
  }
  std::string result(demangled);
  std::free(demangled);
  return result;
}

}  // namespace

std::vector<std::string> demangle_all(const std::vector<std::string>& names) {
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<std::string, std::string>();  // lives until exit
  constexpr size_t kMaxCached = 1u << 20;
  std::vector<std::string> out;
  out.reserve(names.size());
  std::lock_guard<std::mutex> guard(mutex);
  for (const std::string& name : names) {
    auto hit = cache->find(name);
    if (hit != cache->end()) {
      out.push_back(hit->second);
      continue;
    }
    std::string demangled = demangle_one(name);
    if (cache->size() < kMaxCached) cache->emplace(name, demangled);
    out.push_back(std::move(demangled));
  }
  return out;
}

}  // namespace tbpipe
