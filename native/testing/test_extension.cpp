// tbpipe._native_test: entry points for the test suite and the benchmarks, never shipped.
//
// Built only with -DTBPIPE_BUILD_TESTING=ON (the development install does this). It holds its own
// copy of the capture core (native/*.cpp): its unwinder, module registry and CFI recipes answer the
// unwinder's tests and the timing benchmarks, and `_unwind_c_entry` hands native test libraries a
// C function to walk from a signal handler or a thread with no Python. What must reach the recording
// session of tbpipe._native (an event recorded, a stack gathered with the GIL released or on a
// thread with no Python) goes through that extension's C API (capi.h), as an out-of-tree event
// source would.

#include <execinfo.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <time.h>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "capi.h"
#include "cfi.h"
#include "frames.h"
#include "module_dicts.h"
#include "modules.h"
#include "parquet_pages.h"
#include "stack_bounds.h"
#include "unwind.h"

namespace py = pybind11;

// A C entry point for test libraries: lets native code (a signal handler, a
// thread with no Python on it) run a walk and keep the result in plain arrays.
// Reached through the address _unwind_c_entry() returns, so it is not exported.
// `options`: bit 0 = skip_own_module, bit 1 = skip_until_eval.
extern "C" size_t tbpipe_unwind_into(uintptr_t* pcs, int32_t* modules, uint32_t* flags, size_t max, int options) {
  tbpipe::NativeFrame frames[tbpipe::kMaxNativeFrames];
  tbpipe::UnwindOptions opt;
  opt.skip_own_module = (options & 1) != 0;
  opt.skip_until_eval = (options & 2) != 0;
  if (max > tbpipe::kMaxNativeFrames) max = tbpipe::kMaxNativeFrames;
  size_t n = tbpipe::unwind_native(frames, max, opt);
  for (size_t i = 0; i < n; ++i) {
    pcs[i] = frames[i].pc;
    modules[i] = frames[i].module;
    flags[i] = frames[i].flags;
  }
  return n;
}

namespace tbpipe {
namespace {

py::list frames_to_list(const NativeFrame* frames, size_t n) {
  py::list out;
  for (size_t i = 0; i < n; ++i) {
    out.append(py::make_tuple(py::int_(frames[i].pc), frames[i].module, frames[i].flags));
  }
  return out;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

const char* ra_rule_name(cfi::RaRule r) {
  switch (r) {
    case cfi::RaRule::kAtCfa:
      return "cfa+k";
    case cfi::RaRule::kAtRsp:
      return "rsp+k";
    case cfi::RaRule::kAtRbp:
      return "rbp+k";
    case cfi::RaRule::kUndefined:
      return "undefined";
  }
  return "?";
}

const char* rbp_rule_name(cfi::RbpRule r) {
  switch (r) {
    case cfi::RbpRule::kSame:
      return "same";
    case cfi::RbpRule::kAtCfa:
      return "cfa+k";
    case cfi::RbpRule::kAtRsp:
      return "rsp+k";
    case cfi::RbpRule::kAtRbp:
      return "rbp+k";
    case cfi::RbpRule::kValCfa:
      return "val cfa+k";
    case cfi::RbpRule::kLost:
      return "lost";
  }
  return "?";
}

py::dict recipe_to_dict(const cfi::Recipe& r) {
  py::dict d;
  d["cfa_rule"] = cfi::cfa_rule_name(r.cfa_rule);
  d["cfa_off"] = r.cfa_off;
  d["ra_rule"] = ra_rule_name(r.ra_rule);
  d["ra_off"] = r.ra_off;
  d["rbp_rule"] = rbp_rule_name(r.rbp_rule);
  d["rbp_off"] = r.rbp_off;
  d["signal_frame"] = (r.flags & cfi::kRecipeSignalFrame) != 0;
  d["plt_threshold"] = r.plt_threshold;
  return d;
}

const TbpipeCApi& capi() {
  static const TbpipeCApi* api = [] {
    py::object capsule = py::module_::import("tbpipe._native").attr("_C_API");
    auto* table = static_cast<const TbpipeCApi*>(PyCapsule_GetPointer(capsule.ptr(), TBPIPE_CAPI_CAPSULE));
    if (table == nullptr) throw py::error_already_set();
    if (table->abi_version != TBPIPE_CAPI_VERSION) throw std::runtime_error("tbpipe._native C API version mismatch");
    return table;
  }();
  return *api;
}

py::object as_traceback(void* handle) {
  if (handle == nullptr) throw std::bad_alloc();
  PyObject* object = capi().traceback_object(handle);
  if (object == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(object);
}

}  // namespace

void register_session_hooks(py::module_& m) {
  m.def(
      "record_with_gil_released",
      [](const std::string& kind, const std::string& name, const std::string& attrs_json) {
        const TbpipeCApi& api = capi();
        py::gil_scoped_release released;
        api.record(kind.data(), kind.size(), name.data(), name.size(), attrs_json.data(), attrs_json.size());
      },
      py::arg("kind"), py::arg("name"), py::arg("attrs_json") = "",
      "Record an event through tbpipe._native's C API with the GIL released, as native sources do.");

  m.def(
      "record_interned_with_gil_released",
      [](const std::string& kind, const std::string& name, const std::string& attrs_json) {
        // The path of a busy native source (the torch-ops observer): texts interned once, then ids.
        const TbpipeCApi& api = capi();
        if (!TBPIPE_CAPI_HAS(&api, record_interned)) throw std::runtime_error("the C API has no record_interned");
        py::gil_scoped_release released;
        const uint32_t kind_id = api.intern(kind.data(), kind.size());
        const uint32_t name_id = api.intern(name.data(), name.size());
        api.record_interned(kind_id, name_id, attrs_json.data(), attrs_json.size());
      },
      py::arg("kind"), py::arg("name"), py::arg("attrs_json") = "",
      "Record an event through the C API's intern + record_interned with the GIL released.");
  m.def("capi_active", []() { return capi().active() != 0; }, "The C API's answer to whether a session is recording.");

  // One op event flagged nested, its scope (a local here) opened and closed around nothing.
  static constexpr auto record_nested_op = [](const TbpipeCApi& api, uint32_t kind, const std::string& name) {
    int scope = 0;
    api.record_scoped(kind, api.intern(name.data(), name.size()), "", 0, &scope, TBPIPE_RECORD_NESTED);
    api.end_scope(&scope);
  };
  m.def(
      "record_ops_nested",
      [](const std::string& outer, const std::vector<std::string>& inner, const py::object& between) {
        // As the torch-ops observer records an op and the ops it calls: the outer event opens a scope
        // (a local of this frame), each inner one its own inside it, flagged nested. `between`, when
        // given, is Python code run inside the outer scope after them.
        const TbpipeCApi& api = capi();
        const uint32_t kind = api.intern("op", 2);
        int outer_scope = 0;
        api.record_scoped(kind, api.intern(outer.data(), outer.size()), "", 0, &outer_scope, 0);
        for (const std::string& name : inner) record_nested_op(api, kind, name);
        if (!between.is_none()) between();
        api.end_scope(&outer_scope);
      },
      py::arg("outer"), py::arg("inner"), py::arg("between") = py::none(),
      "Record an op event that opens a scope, the given nested op events inside it, then call `between`.");
  m.def(
      "record_op_nested", [](const std::string& name) { record_nested_op(capi(), capi().intern("op", 2), name); },
      py::arg("name"), "Record one op event flagged nested in whatever scope is open on this thread.");

  m.def(
      "gather_with_gil_released",
      [](bool python, bool native) {
        // What a C callback that released the GIL sees (CUPTI, a C++ extension).
        const TbpipeCApi& api = capi();
        void* handle;
        {
          py::gil_scoped_release released;
          handle = api.gather(python, native);
        }
        return as_traceback(handle);
      },
      py::arg("python") = true, py::arg("native") = true,
      "tbpipe._native's gather through its C API, called with the GIL released.");

  m.def(
      "gather_on_native_thread",
      []() {
        // A thread the interpreter has never seen: no thread state, no Python frames.
        const TbpipeCApi& api = capi();
        void* handle = nullptr;
        {
          py::gil_scoped_release released;
          std::thread worker([&api, &handle]() { handle = api.gather(1, 1); });
          worker.join();
        }
        return as_traceback(handle);
      },
      "tbpipe._native's gather through its C API on a new native thread with no Python thread state.");
}

void register_unwinder_diagnostics(py::module_& m) {
  m.def(
      "_unwind_pcs",
      [](bool skip_own_module, bool skip_until_eval) {
        NativeFrame frames[kMaxNativeFrames];
        UnwindOptions opt;
        opt.skip_own_module = skip_own_module;
        opt.skip_until_eval = skip_until_eval;
        size_t n = unwind_native(frames, kMaxNativeFrames, opt);
        return frames_to_list(frames, n);
      },
      py::arg("skip_own_module") = true, py::arg("skip_until_eval") = false,
      "The caller's native stack as [(pc, module_index, flags)], innermost first. "
      "A final frame with the marker flag holds a stop reason in pc.");

  m.def("_modules", &registry_modules, "Every module this extension's registry has seen, by index.");

  m.def(
      "_refresh_modules", [] { return ModuleRegistry::instance().refresh(); },
      "Rescan loaded objects; True when something changed.");

  m.def(
      "_module_generation", [] { return ModuleRegistry::instance().generation(); },
      "Registry generation: bumped by each refresh that changed the module set.");

  m.def(
      "_module_for_pc", [](uintptr_t pc) { return ModuleRegistry::instance().lookup(pc); }, py::arg("pc"),
      "Module index whose executable ranges contain pc, or -1 (no refresh).");

  m.def(
      "_recipe_for_pc",
      [](uintptr_t pc) {
        ModuleRegistry& reg = ModuleRegistry::instance();
        const Module* mod = reg.module(reg.lookup(pc));
        if (!mod) return py::object(py::none());
        return py::object(recipe_to_dict(cfi::compile_recipe(*mod, pc)));
      },
      py::arg("pc"), "The compiled CFI recipe for a lookup PC (use pc - 1 for return addresses), or None.");

  m.def(
      "_recipe_in_buffer",
      [](py::bytes data, size_t hdr_offset, int64_t pc_offset) {
        // A module made of one readable segment, a private copy of CFI bytes:
        // lets tests feed the parser damaged tables without touching real ones.
        std::string bytes = data;
        Module fake;
        const uintptr_t base = reinterpret_cast<uintptr_t>(bytes.data());
        fake.image = AddressRange{base, base + bytes.size()};
        fake.readable_ranges.push_back(fake.image);
        if (hdr_offset < bytes.size()) {
          fake.eh_frame_hdr = reinterpret_cast<const uint8_t*>(bytes.data()) + hdr_offset;
          fake.eh_frame_hdr_size = bytes.size() - hdr_offset;
        }
        const uintptr_t pc = base + static_cast<uintptr_t>(pc_offset);
        return recipe_to_dict(cfi::compile_recipe(fake, pc));
      },
      py::arg("data"), py::arg("hdr_offset"), py::arg("pc_offset"),
      "Compile a recipe from a copy of CFI bytes (a segment holding .eh_frame_hdr and "
      ".eh_frame); pc_offset is the PC relative to the copy's start.");

  m.def(
      "_stack_read_allowed",
      [](uintptr_t lo, uintptr_t hi, uintptr_t addr) { return StackBounds{lo, hi}.allows(addr); }, py::arg("lo"),
      py::arg("hi"), py::arg("addr"),
      "Whether the unwinder may read the word at addr of a stack [lo, hi) (its own rule; nothing is read).");
  m.def(
      "_stack_read",
      [](uintptr_t lo, uintptr_t hi, uintptr_t addr) {
        uintptr_t word;
        if (!StackBounds{lo, hi}.load(addr, &word)) return py::object(py::none());
        return py::object(py::int_(word));
      },
      py::arg("lo"), py::arg("hi"), py::arg("addr"),
      "The word at addr as the unwinder loads it from a stack [lo, hi), or None when refused. The "
      "caller owns readable memory there.");

  m.def(
      "_glibc_backtrace_pcs",
      [] {
        void* pcs[kMaxNativeFrames];
        int n = backtrace(pcs, static_cast<int>(kMaxNativeFrames));
        py::list out;
        for (int i = 0; i < n; ++i) out.append(py::int_(reinterpret_cast<uintptr_t>(pcs[i])));
        return out;
      },
      "glibc backtrace() from inside the extension, for comparison.");

  m.def(
      "_time_unwind",
      [](size_t iterations, bool skip_own_module) {
        NativeFrame frames[kMaxNativeFrames];
        UnwindOptions opt;
        opt.skip_own_module = skip_own_module;
        size_t n = unwind_native(frames, kMaxNativeFrames, opt);  // warm up
        uint64_t t0 = now_ns();
        for (size_t i = 0; i < iterations; ++i) n = unwind_native(frames, kMaxNativeFrames, opt);
        uint64_t t1 = now_ns();
        return py::make_tuple(iterations ? double(t1 - t0) / double(iterations) : 0.0, n);
      },
      py::arg("iterations"), py::arg("skip_own_module") = false,
      "(ns per unwind_native call, frames per walk), timed in C++.");

  m.def(
      "_time_glibc_backtrace",
      [](size_t iterations) {
        void* pcs[kMaxNativeFrames];
        int n = backtrace(pcs, static_cast<int>(kMaxNativeFrames));
        uint64_t t0 = now_ns();
        for (size_t i = 0; i < iterations; ++i) n = backtrace(pcs, static_cast<int>(kMaxNativeFrames));
        uint64_t t1 = now_ns();
        return py::make_tuple(iterations ? double(t1 - t0) / double(iterations) : 0.0, n);
      },
      py::arg("iterations"), "(ns per glibc backtrace() call, frames per call), timed in C++.");

  m.def(
      "_unwind_c_entry", [] { return py::int_(reinterpret_cast<uintptr_t>(&tbpipe_unwind_into)); },
      "Address of tbpipe_unwind_into(pcs, modules, flags, max, options) for native test code.");
  m.def(
      "crc32",
      [](const py::bytes& data) {
        const std::string bytes = data;
        return crc32(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      },
      py::arg("data"), "The CRC-32 the page checks compute (native/parquet_pages.cpp) of the bytes.");
}

}  // namespace tbpipe

PYBIND11_MODULE(_native_test, m) {
  m.doc() = "tbpipe's test-only entry points (never shipped).";
  tbpipe::register_unwinder_diagnostics(m);
  tbpipe::register_session_hooks(m);
}
