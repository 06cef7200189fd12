#include "module_dicts.h"

#include <vector>

namespace py = pybind11;

namespace tbpipe {
namespace {

py::list ranges_to_list(const std::vector<AddressRange>& ranges) {
  py::list out;
  for (const AddressRange& r : ranges) out.append(py::make_tuple(py::int_(r.lo), py::int_(r.hi)));
  return out;
}

}  // namespace

py::dict module_to_dict(const Module& m) {
  py::dict d;
  d["index"] = m.index;
  d["path"] = m.path;
  d["build_id"] = m.build_id;
  d["load_bias"] = py::int_(m.load_bias);
  d["exec_ranges"] = ranges_to_list(m.exec_ranges);
  d["eval_ranges"] = ranges_to_list(m.eval_ranges);
  d["image"] = py::make_tuple(py::int_(m.image.lo), py::int_(m.image.hi));
  d["readable_ranges"] = ranges_to_list(m.readable_ranges);
  d["eh_frame_hdr"] = py::int_(reinterpret_cast<uintptr_t>(m.eh_frame_hdr));
  d["has_eh_frame_hdr"] = m.eh_frame_hdr != nullptr;
  return d;
}

py::list registry_modules() {
  ModuleRegistry& reg = ModuleRegistry::instance();
  py::list out;
  for (size_t i = 0; i < reg.size(); ++i) {
    if (const Module* mod = reg.module(static_cast<int32_t>(i))) out.append(module_to_dict(*mod));
  }
  return out;
}

}  // namespace tbpipe
