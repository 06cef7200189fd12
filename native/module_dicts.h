// Modules of the registry as Python dicts (index, path, build_id, load_bias, ranges, ...), for
// `_modules()` of the extension and of the test extension alike (each over its own registry).
#pragma once

#include <pybind11/pybind11.h>

#include "modules.h"

namespace tbpipe {

pybind11::dict module_to_dict(const Module& m);

// Every module the registry has seen, by index (dlclose'd ones included), as dicts.
pybind11::list registry_modules();

}  // namespace tbpipe
