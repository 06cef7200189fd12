// C++ symbol demangling for the pipeline, batched and cached.
#pragma once

#include <string>
#include <vector>

namespace tbpipe {

// Demangled form of each name; names that are not mangled C++ come back as they are.
std::vector<std::string> demangle_all(const std::vector<std::string>& names);

}  // namespace tbpipe
