// Python bindings of the capture library: `tbpipe._native`.
//
// Everything here is raw: frames come back as addresses and code ids; the
// Python side (tbpipe.capture) symbolizes and writes files.
#include <Python.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "capi.h"
#include "demangle.h"
#include "drain_layout.h"
#include "gather.h"
#include "python_frames.h"
#include "recorder.h"
#include "string_table.h"

namespace py = pybind11;

namespace tbpipe {

void register_module_bindings(py::module_& m);     // native/module_bindings.cpp
void register_source_bindings(py::module_& m);     // native/source_bindings.cpp
void register_symbolize_bindings(py::module_& m);  // native/symbolize_bindings.cpp
void register_ingest_bindings(py::module_& m);     // native/ingest_bindings.cpp

namespace {

// A gathered stack kept raw: no symbolization, no Python object per frame.
struct RawTraceback {
  std::vector<NativeFrame> native;
  std::vector<PythonFrame> python;
  uint32_t status = 0;
};

// Calls made from Python pass through the interpreter's call machinery and
// this module before they reach the unwinder: leave all of that out.
UnwindOptions options_for_python_caller() {
  UnwindOptions options;
  options.skip_own_module = true;
  options.skip_until_eval = true;
  return options;
}

std::unique_ptr<RawTraceback> traceback_of(const RawStack& stack) {
  auto traceback = std::make_unique<RawTraceback>();
  traceback->native.assign(stack.native, stack.native + stack.native_count);
  traceback->python.assign(stack.python, stack.python + stack.python_count);
  traceback->status = stack.status;
  return traceback;
}

std::unique_ptr<RawTraceback> gather(bool python, bool native) {
  RawStack& stack = thread_scratch_stack();
  gather_stack(&stack, python, native, options_for_python_caller());
  return traceback_of(stack);
}

template <typename T>
py::bytes as_bytes(const std::vector<T>& values) {
  return py::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Drained columns come back here when Python drops them, and the next drain fills them again: their
// pages stay mapped. A busy flush drains tens of megabytes, and fresh memory each time cost the
// kernel a page fault and a zeroed page per 4 KiB. Never blocks: with the lock taken (or left taken
// by a thread that vanished at a fork) a column is made or freed as usual.
template <typename Container>
class Recycled {
 public:
  static Container take() {
    std::unique_lock<std::mutex> guard(pool().mutex, std::try_to_lock);
    if (!guard.owns_lock() || pool().spares.empty()) return Container();
    Container values = std::move(pool().spares.back());
    pool().spares.pop_back();
    values.clear();
    return values;
  }

  static void give(Container&& values) {
    std::unique_lock<std::mutex> guard(pool().mutex, std::try_to_lock);
    if (guard.owns_lock() && pool().spares.size() < kKept) pool().spares.push_back(std::move(values));
  }

 private:
  static constexpr size_t kKept = 32;  // of each type: more than a drain uses
  struct Pool {
    std::mutex mutex;
    std::vector<Container> spares;
  };
  static Pool& pool() {
    static Pool* pool = new Pool();  // never destroyed: columns may come back while the process exits
    return *pool;
  }
};

// A drained column handed to Python as it lies: a numpy array that owns the vector (or string), no
// copy; when Python drops it, the container goes back to Recycled.
template <typename Container>
py::array owning_array(Container&& values) {
  using Owned = std::decay_t<Container>;
  using Value = std::conditional_t<std::is_same_v<Owned, std::string>, uint8_t, typename Owned::value_type>;
  if (values.empty()) return py::array_t<Value>(0);
  auto* owner = new Owned(std::move(values));
  py::capsule release(owner, [](void* held) {
    auto* owned = static_cast<Owned*>(held);
    Recycled<Owned>::give(std::move(*owned));
    delete owned;
  });
  return py::array_t<Value>(static_cast<py::ssize_t>(owner->size()), reinterpret_cast<const Value*>(owner->data()),
                            release);
}

// A Drained whose columns come from Recycled (empty, with the room an earlier drain made).
void take_recycled(Drained* drained) {
  auto refill = [](auto&... columns) { ((columns = Recycled<std::decay_t<decltype(columns)>>::take()), ...); };
  refill(drained->ts_ns, drained->thread_id, drained->stack_id, drained->kind_id, drained->name_id,
         drained->correlation_id, drained->attr_text, drained->op_present, drained->op_id, drained->op_parent,
         drained->op_seq, drained->op_seq_thread, drained->op_bwd_seq, drained->op_fwd_thread, drained->op_depth,
         drained->op_bwd_node, drained->op_scope);
  drained->attr_offsets = Recycled<std::vector<int64_t>>::take();
  drained->attr_offsets.push_back(0);
}

// The drained columns' Arrow layout (drain_layout.h): dictionary columns of the names, validity
// bitmaps of the nullable columns (the op columns' by the TBPIPE_OP_* bit that says they hold a value).
struct DrainedLayout {
  DictionaryColumn kind, name, bwd_node, scope;
  std::vector<uint8_t> stack_valid, correlation_valid;
  std::vector<std::pair<uint32_t, std::vector<uint8_t>>> op_valid;  // (TBPIPE_OP_* bit, bitmap)
};

DictionaryColumn recycled_dictionary() {
  return DictionaryColumn{Recycled<std::vector<int32_t>>::take(), Recycled<std::vector<uint32_t>>::take(),
                          Recycled<std::vector<uint8_t>>::take()};
}

DrainedLayout layout_of(const Drained& drained) {
  DrainedLayout layout;
  const size_t events = drained.ts_ns.size();
  auto bits = [&](auto is_valid) {
    std::vector<uint8_t> valid = Recycled<std::vector<uint8_t>>::take();
    fill_validity(&valid, events, is_valid);
    return valid;
  };
  layout.kind = recycled_dictionary();
  layout.name = recycled_dictionary();
  fill_dictionary(drained.kind_id, false, &layout.kind);
  fill_dictionary(drained.name_id, false, &layout.name);
  layout.stack_valid = bits([&](size_t i) { return drained.stack_id[i] != 0; });
  layout.correlation_valid = bits([&](size_t i) { return drained.correlation_id[i] != 0; });
  if (!drained.op_present.empty()) {
    layout.bwd_node = recycled_dictionary();
    layout.scope = recycled_dictionary();
    fill_dictionary(drained.op_bwd_node, true, &layout.bwd_node);
    fill_dictionary(drained.op_scope, true, &layout.scope);
    for (const uint32_t bit : {TBPIPE_OP_ID, TBPIPE_OP_DEPTH, TBPIPE_OP_PARENT, TBPIPE_OP_SEQ, TBPIPE_OP_BACKWARD}) {
      layout.op_valid.emplace_back(bit, bits([&](size_t i) { return drained.op_present[i] & bit; }));
    }
  }
  return layout;
}

void put_dictionary(py::dict& out, const std::string& name, DictionaryColumn&& column) {
  out[py::str(name + "_index")] = owning_array(std::move(column.indices));
  out[py::str(name + "_strings")] = owning_array(std::move(column.strings));
  if (!column.validity.empty()) out[py::str(name + "_valid")] = owning_array(std::move(column.validity));
}

py::dict drain() {
  Drained drained;
  DrainedLayout layout;
  {
    // Merging the threads' buffers touches no Python object (attribute dicts change hands with
    // their references as they are): the program's threads run on meanwhile.
    py::gil_scoped_release released;
    take_recycled(&drained);
    Recorder::instance().drain(&drained);
    layout = layout_of(drained);
  }
  py::dict out;
  put_dictionary(out, "kind", std::move(layout.kind));
  put_dictionary(out, "name", std::move(layout.name));
  out["stack_id_valid"] = owning_array(std::move(layout.stack_valid));
  out["correlation_id_valid"] = owning_array(std::move(layout.correlation_valid));
  if (!drained.op_present.empty()) {
    put_dictionary(out, "op_bwd_node", std::move(layout.bwd_node));
    put_dictionary(out, "op_scope", std::move(layout.scope));
    for (auto& [bit, bits] : layout.op_valid)
      out[py::str("op_valid_" + std::to_string(bit))] = owning_array(std::move(bits));
  }
  out["ts_ns"] = owning_array(std::move(drained.ts_ns));
  out["thread_id"] = owning_array(std::move(drained.thread_id));
  out["stack_id"] = owning_array(std::move(drained.stack_id));
  out["kind_id"] = owning_array(std::move(drained.kind_id));
  out["name_id"] = owning_array(std::move(drained.name_id));
  out["correlation_id"] = owning_array(std::move(drained.correlation_id));
  out["attr_text"] = owning_array(std::move(drained.attr_text));
  out["attr_offsets"] = owning_array(std::move(drained.attr_offsets));
  py::list objects;
  for (const auto& [event, object] : drained.attr_objects) {
    objects.append(py::make_tuple(event, py::reinterpret_steal<py::object>(object)));
  }
  out["attr_objects"] = objects;
  out["op_present"] = owning_array(std::move(drained.op_present));
  out["op_id"] = owning_array(std::move(drained.op_id));
  out["op_depth"] = owning_array(std::move(drained.op_depth));
  out["op_parent"] = owning_array(std::move(drained.op_parent));
  out["op_seq"] = owning_array(std::move(drained.op_seq));
  out["op_seq_thread"] = owning_array(std::move(drained.op_seq_thread));
  out["op_bwd_seq"] = owning_array(std::move(drained.op_bwd_seq));
  out["op_fwd_thread"] = owning_array(std::move(drained.op_fwd_thread));
  out["op_bwd_node"] = owning_array(std::move(drained.op_bwd_node));
  out["op_scope"] = owning_array(std::move(drained.op_scope));
  out["stack_ids"] = owning_array(std::move(drained.stack_ids));
  out["stack_status"] = owning_array(std::move(drained.stack_status));
  out["stack_thread"] = owning_array(std::move(drained.stack_thread));
  out["native_ends"] = owning_array(std::move(drained.native_ends));
  out["python_ends"] = owning_array(std::move(drained.python_ends));
  out["native_module"] = owning_array(std::move(drained.native_module));
  out["native_offset"] = owning_array(std::move(drained.native_offset));
  out["native_flags"] = owning_array(std::move(drained.native_flags));
  out["python_code"] = owning_array(std::move(drained.python_code));
  out["python_offset"] = owning_array(std::move(drained.python_offset));
  out["python_flags"] = owning_array(std::move(drained.python_flags));
  out["dropped"] = drained.dropped;
  return out;
}

// The values of a buffer (bytes, or a drained column's array), copied out.
template <typename T>
std::vector<T> from_buffer(const py::buffer& raw) {
  const py::buffer_info info = raw.request();
  const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
  std::vector<T> values(bytes / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), info.ptr, values.size() * sizeof(T));
  return values;
}

// Lines are resolved off the hot path (at flush) and once per distinct
// (code, offset): PyCode_Addr2Line walks the line table linearly.
py::bytes resolve_lines(const py::buffer& code_ids, const py::buffer& offsets, const py::buffer& flags) {
  static auto* cache = new std::unordered_map<uint64_t, int32_t>();  // GIL-guarded, lives until exit
  std::vector<uint64_t> ids = from_buffer<uint64_t>(code_ids);
  std::vector<int32_t> offs = from_buffer<int32_t>(offsets);
  std::vector<uint32_t> flgs = from_buffer<uint32_t>(flags);
  const size_t count = std::min(ids.size(), std::min(offs.size(), flgs.size()));
  std::vector<int32_t> lines(count, -1);
  CodeRegistry& registry = CodeRegistry::instance();
  for (size_t i = 0; i < count; ++i) {
    if (flgs[i] & kPyFrameLineResolved) {
      lines[i] = offs[i];
      continue;
    }
    const uint64_t key = (ids[i] << 32) ^ static_cast<uint32_t>(offs[i]);
    auto hit = cache->find(key);
    if (hit != cache->end()) {
      lines[i] = hit->second;
      continue;
    }
    lines[i] = registry.line_for(ids[i], offs[i]);
    cache->emplace(key, lines[i]);
  }
  return as_bytes(lines);
}

// record(kind, name, **attrs): hand-written METH_FASTCALL glue because it is
// the one call made per event from Python, and when no session is active it
// must cost next to nothing - pybind11's generic argument handling would
// dominate that.
PyObject* record_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  Recorder& recorder = Recorder::instance();
  if (!recorder.active()) Py_RETURN_NONE;
  if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyUnicode_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "record(kind: str, name: str, **attrs) needs two str arguments");
    return nullptr;
  }
  StringTable& strings = StringTable::instance();
  const uint32_t kind_id = strings.intern_python(args[0]);
  const uint32_t name_id = strings.intern_python(args[1]);
  PyObject* attrs = nullptr;
  const Py_ssize_t attr_count = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  if (attr_count > 0) {
    attrs = PyDict_New();
    if (attrs == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < attr_count; ++i) {
      if (PyDict_SetItem(attrs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
        Py_DECREF(attrs);
        return nullptr;
      }
    }
  }
  recorder.record(kind_id, name_id, attrs, options_for_python_caller());
  Py_RETURN_NONE;
}

PyMethodDef record_method = {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(record_fast)),
                             METH_FASTCALL | METH_KEYWORDS,
                             "record(kind, name, **attrs): record an event with the calling thread's combined stack "
                             "(a no-op when no session is active)."};

// ---------------------------------------------------------------------------- the C API (capi.h)

// Native callers are not Python code: their stacks keep every frame (no skipping up to an eval loop).
UnwindOptions options_for_native_caller() {
  UnwindOptions options;
  options.skip_own_module = true;
  return options;
}

void capi_record(const char* kind, size_t kind_len, const char* name, size_t name_len, const char* attrs_json,
                 size_t attrs_len) {
  Recorder& recorder = Recorder::instance();
  if (!recorder.active()) return;
  StringTable& strings = StringTable::instance();
  recorder.record_native(strings.intern_utf8(kind, kind_len), strings.intern_utf8(name, name_len), attrs_json,
                         attrs_len, options_for_native_caller());
}

int capi_active() { return Recorder::instance().active() ? 1 : 0; }

uint32_t capi_intern(const char* text, size_t len) { return StringTable::instance().intern_utf8(text, len); }

void capi_record_interned(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_len) {
  Recorder& recorder = Recorder::instance();
  if (!recorder.active()) return;
  UnwindOptions options = options_for_native_caller();
  options.skip_caller_module = true;  // the source's own callback frames say nothing about the event
  recorder.record_native(kind_id, name_id, attrs_json, attrs_len, options);
}

void* capi_gather(int python, int native) {
  RawStack& stack = thread_scratch_stack();
  gather_stack(&stack, python != 0, native != 0, options_for_native_caller());
  try {
    return traceback_of(stack).release();
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

PyObject* capi_traceback_object(void* handle) {
  std::unique_ptr<RawTraceback> traceback(static_cast<RawTraceback*>(handle));
  try {
    return py::cast(std::move(traceback)).release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
    return nullptr;
  }
}

void capi_free_traceback(void* handle) { delete static_cast<RawTraceback*>(handle); }

static_assert(TBPIPE_RECORD_SAMPLED == Recorder::kScopedSampled, "capi.h and recorder.h must agree");
static_assert(TBPIPE_RECORD_NESTED == Recorder::kScopedNested, "capi.h and recorder.h must agree");

void capi_record_scoped(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_len, const void* scope,
                        uint32_t flags) {
  Recorder& recorder = Recorder::instance();
  if (!recorder.active()) return;
  UnwindOptions options = options_for_native_caller();
  options.skip_caller_module = true;
  recorder.record_native_scoped(kind_id, name_id, attrs_json, attrs_len, options, scope, flags);
}

int capi_sample() {
  Recorder& recorder = Recorder::instance();
  return recorder.active() && recorder.sample_next() ? 1 : 0;
}

void capi_record_op(uint32_t kind_id, uint32_t name_id, const TbpipeOpAttrs* op, const void* scope, uint32_t flags) {
  Recorder& recorder = Recorder::instance();
  if (!recorder.active() || op == nullptr) return;
  UnwindOptions options = options_for_native_caller();
  options.skip_caller_module = true;
  recorder.record_native_op(kind_id, name_id, *op, options, scope, flags);
}

// Always, active or not: a scope opened while recording may end after the session stopped.
void capi_end_scope(const void* scope) { Recorder::instance().end_scope(scope); }

const TbpipeCApi kCApi = {TBPIPE_CAPI_VERSION,   sizeof(TbpipeCApi),  capi_record,    capi_gather,
                          capi_traceback_object, capi_free_traceback, capi_active,    capi_intern,
                          capi_record_interned,  capi_record_scoped,  capi_end_scope, capi_sample,
                          capi_record_op};

}  // namespace
}  // namespace tbpipe

PYBIND11_MODULE(_native, m) {
  using namespace tbpipe;
  m.doc() = "tbpipe's in-process capture library (raw stacks, no symbolization).";

  py::class_<RawTraceback>(m, "RawTraceback", "A combined stack as captured: native PCs and Python (code id, offset).")
      .def_property_readonly(
          "native",
          [](const RawTraceback& t) {
            py::list frames;
            for (const NativeFrame& f : t.native) frames.append(py::make_tuple(f.pc, f.module, f.flags));
            return frames;
          },
          "(pc, module index, flags) per native frame, innermost first")
      .def_property_readonly(
          "python",
          [](const RawTraceback& t) {
            py::list frames;
            for (const PythonFrame& f : t.python) frames.append(py::make_tuple(f.code_id, f.instr_offset, f.flags));
            return frames;
          },
          "(code id, instruction offset or line, flags) per Python frame")
      .def_readonly("status", &RawTraceback::status)
      .def("__len__", [](const RawTraceback& t) { return t.native.size() + t.python.size(); });

  m.def("gather", &gather, py::arg("python") = true, py::arg("native") = true,
        "Combined raw stack of the calling thread, without tbpipe's own frames.");
  m.attr("record") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&record_method, nullptr, nullptr));

  m.def(
      "start",
      [](bool python, bool native, uint64_t max_buffered) { Recorder::instance().start(python, native, max_buffered); },
      py::arg("python") = true, py::arg("native") = true, py::arg("max_buffered_events") = 1u << 22);
  m.def("stop", []() { Recorder::instance().stop(); });
  m.def("active", []() { return Recorder::instance().active(); });
  m.def("drain", &drain, "Move every thread's buffered events and new stacks out, columnar.");
  m.def("counters", []() {
    RecorderCounters c = Recorder::instance().counters();
    py::dict out;
    out["recorded"] = c.recorded;
    out["dropped"] = c.dropped;
    out["stacks"] = c.stacks;
    return out;
  });
  m.def(
      "strings_since", [](uint32_t first_id) { return StringTable::instance().since(first_id); },
      "Interned strings with ids first_id, first_id + 1, ...");
  m.def(
      "code_info",
      [](const std::vector<uint64_t>& ids) {
        py::list out;
        CodeRegistry& registry = CodeRegistry::instance();
        for (uint64_t id : ids) {
          CodeInfo info;
          if (registry.info(id, &info)) {
            out.append(py::make_tuple(info.filename, info.qualname, info.first_line));
          } else {
            out.append(py::none());
          }
        }
        return out;
      },
      "(filename, qualname, first line) per code id, None when unknown.");
  m.def("resolve_lines", &resolve_lines, py::arg("code_ids"), py::arg("offsets"), py::arg("flags"),
        "Line per Python frame, from raw uint64 code ids, int32 offsets and uint32 flags; "
        "returns raw int32 lines (-1 when unknown). The GIL must be held.");
  m.def("demangle", &demangle_all, py::arg("names"), "Demangle C++ names in bulk; other names come back unchanged.");

  m.attr("NATIVE_FRAME_EVAL_LOOP") = static_cast<uint32_t>(kFrameEvalLoop);
  m.attr("NATIVE_FRAME_BY_FRAME_POINTER") = static_cast<uint32_t>(kFrameByFramePointer);
  m.attr("NATIVE_FRAME_EXACT_PC") = static_cast<uint32_t>(kFrameExactPc);
  m.attr("NATIVE_FRAME_MARKER") = static_cast<uint32_t>(kFrameMarker);
  m.attr("PYTHON_FRAME_ENTRY") = static_cast<uint32_t>(kPyFrameEntry);
  m.attr("PYTHON_FRAME_LINE_RESOLVED") = static_cast<uint32_t>(kPyFrameLineResolved);
  m.attr("STACK_NATIVE_TRUNCATED") = static_cast<uint32_t>(kStackNativeTruncated);
  m.attr("STACK_PYTHON_TRUNCATED") = static_cast<uint32_t>(kStackPythonTruncated);
  m.attr("STACK_NO_NATIVE") = static_cast<uint32_t>(kStackNoNative);
  m.attr("STACK_NO_PYTHON") = static_cast<uint32_t>(kStackNoPython);
  m.attr("STOP_COMPLETE") = static_cast<uint32_t>(StopReason::kComplete);
  m.attr("STOP_UNKNOWN_PC") = static_cast<uint32_t>(StopReason::kUnknownPc);
  m.attr("STOP_NO_UNWIND_INFO") = static_cast<uint32_t>(StopReason::kNoUnwindInfo);
  m.attr("STOP_UNSUPPORTED_RULE") = static_cast<uint32_t>(StopReason::kUnsupportedRule);
  m.attr("STOP_BAD_STACK_READ") = static_cast<uint32_t>(StopReason::kBadStackRead);
  m.attr("STOP_DEPTH_LIMIT") = static_cast<uint32_t>(StopReason::kDepthLimit);
  m.attr("STOP_NOT_SUPPORTED") = static_cast<uint32_t>(StopReason::kNotSupported);
  m.attr("MAX_NATIVE_FRAMES") = static_cast<uint32_t>(kMaxNativeFrames);
  m.attr("_C_API") = py::capsule(const_cast<TbpipeCApi*>(&kCApi), TBPIPE_CAPI_CAPSULE);

  register_module_bindings(m);
  register_source_bindings(m);
  register_symbolize_bindings(m);
  register_ingest_bindings(m);
}
