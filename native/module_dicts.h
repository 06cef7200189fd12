// Modules of the registry as Python dicts (index, path, build_id, load_bias, ranges, ...), for
// `_modules()` of the extension and of the test extension alike.
#pragma once

#include <pybind11/pybind11.h>

#include "modules.h"

namespace tbpipe {

pybind11::dict module_to_dict(const Module& m);

}  // namespace tbpipe
