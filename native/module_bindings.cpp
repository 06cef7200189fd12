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
  m.def(
      "_modules",
      [] {
        ModuleRegistry& reg = ModuleRegistry::instance();
        py::list out;
        for (size_t i = 0; i < reg.size(); ++i) {
          if (const Module* mod = reg.module(static_cast<int32_t>(i))) out.append(module_to_dict(*mod));
        }
        return out;
      },
      "Every module the registry has seen, by index (dlclose'd ones included).");
}

}  // namespace tbpipe
