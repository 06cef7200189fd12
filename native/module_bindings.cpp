// Python bindings of the module registry: `tbpipe._native._modules()`, what the writer and the
// in-process symbolizer read to describe the modules a run's stacks refer to. Diagnostics of the
// unwinder itself live in the test-only extension (native/testing/).

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "module_dicts.h"
#include "modules.h"

namespace py = pybind11;

namespace tbpipe {

void register_module_bindings(py::module_& m) {
  m.def("_modules", &registry_modules, "Every module the registry has seen, by index (dlclose'd ones included).");
}

}  // namespace tbpipe
