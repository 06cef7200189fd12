// Bindings of the event sources that need native code, registered into
// tbpipe._native by bindings.cpp through register_source_bindings():
//
//  - the `cuda` source: CUPTI start/stop/counters (native/cupti.cpp) and its
//    GPU activity: start, the columnar drain, counters (native/cupti_activity.cpp);
//  - the `torch-ops` source's dispatch entry point: torch calls it for every
//    aten op as the `__torch_dispatch__` of tbpipe's dispatch mode. It records
//    the op and runs it, so the mode has no Python frame and builds no Python
//    objects per op (the attributes are JSON text made here);
//  - the recorder's overhead limits and their counters.
//
// Nothing here includes torch headers: torch objects are reached through the
// CPython API only (attributes and callables handed over by the Python side).

#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "cupti.h"
#include "cupti_activity.h"
#include "recorder.h"
#include "string_table.h"
#include "unwind.h"

namespace py = pybind11;

namespace tbpipe {
namespace {

// ---------------------------------------------------------------------------
// torch-ops: everything below runs with the GIL held (torch calls
// __torch_dispatch__ holding it), so plain globals need no locks.

struct OpEntry {
  PyObject* name;      // str "aten::addmm" (strong): interned by address, so it must live
  PyObject* callable;  // what runs the op: OpOverload._op, or the operator itself (strong)
};

struct TorchOps {
  bool configured = false;
  bool enabled = false;
  PyObject* tensor_type = nullptr;   // torch.Tensor
  PyObject* sequence_nr = nullptr;   // torch._C._autograd._get_sequence_nr
  PyObject* current_node = nullptr;  // torch._C._current_autograd_node
  PyObject* resolve = nullptr;       // Python: operator -> (name, callable)
  PyObject* str_shape = nullptr;
  PyObject* str_dtype = nullptr;
  PyObject* str_device = nullptr;
  PyObject* str_is_cpu = nullptr;
  PyObject* str_node_seq = nullptr;   // "_sequence_nr"
  PyObject* str_node_name = nullptr;  // "name"
  // Operators are long-lived; keyed by address with a strong reference held,
  // so an address is never reused (OpOverload.__hash__ is Python code).
  std::unordered_map<PyObject*, OpEntry> ops;
  std::unordered_map<PyObject*, std::string> dtype_names;  // torch.dtype singletons
  // The autograd node of the last backward op: consecutive backward ops
  // mostly share one, and its name costs a call and a new str.
  PyObject* last_node = nullptr;  // strong, keeps the address from being reused
  int64_t last_node_seq = -1;
  std::string last_node_name;
  uint32_t kind_id = 0;
  uint64_t seen = 0;
  uint64_t recorded = 0;
};

TorchOps g_ops;

// Last autograd sequence number seen by an op on this thread; -1 before the
// thread's first op, whose predecessor is unknown.
thread_local int64_t t_last_sequence_nr = -1;

void clear_error_quietly() {
  if (PyErr_Occurred()) PyErr_Clear();
}

const std::string& dtype_name(PyObject* dtype) {
  auto hit = g_ops.dtype_names.find(dtype);
  if (hit != g_ops.dtype_names.end()) return hit->second;
  std::string name;
  if (PyObject* text = PyObject_Str(dtype)) {
    Py_ssize_t size = 0;
    if (const char* data = PyUnicode_AsUTF8AndSize(text, &size)) {
      name.assign(data, static_cast<size_t>(size));
      if (name.rfind("torch.", 0) == 0) name.erase(0, 6);
    }
    Py_DECREF(text);
  }
  clear_error_quietly();
  Py_INCREF(dtype);  // dtypes are singletons; the reference pins the key's address anyway
  return g_ops.dtype_names.emplace(dtype, std::move(name)).first->second;
}

bool is_tensor(PyObject* object) {
  return PyObject_TypeCheck(object, reinterpret_cast<PyTypeObject*>(g_ops.tensor_type)) != 0;
}

void put_shape(JsonAttrs& attrs, PyObject* tensor) {
  PyObject* shape = PyObject_GetAttr(tensor, g_ops.str_shape);
  if (shape == nullptr || !PyTuple_Check(shape)) {
    Py_XDECREF(shape);
    clear_error_quietly();
    attrs.put_raw("null", 4);
    return;
  }
  attrs.put_char('[');
  const Py_ssize_t rank = PyTuple_GET_SIZE(shape);
  for (Py_ssize_t i = 0; i < rank; ++i) {
    if (i > 0) attrs.put_char(',');
    PyObject* dim = PyTuple_GET_ITEM(shape, i);
    int overflow = 0;
    const long long value = PyLong_Check(dim) ? PyLong_AsLongLongAndOverflow(dim, &overflow) : -1;
    if (!PyLong_Check(dim) || overflow != 0 || (value == -1 && PyErr_Occurred())) {
      clear_error_quietly();
      attrs.put_raw("null", 4);  // a symbolic size
    } else {
      attrs.put_int(value);
    }
  }
  attrs.put_char(']');
  Py_DECREF(shape);
}

void put_first_tensor_fields(JsonAttrs& attrs, PyObject* tensor) {
  if (PyObject* dtype = PyObject_GetAttr(tensor, g_ops.str_dtype)) {
    const std::string& name = dtype_name(dtype);
    Py_DECREF(dtype);
    attrs.open("dtype");
    attrs.put_string(name.data(), name.size());
    attrs.commit();
  }
  clear_error_quietly();
  // `is_cpu` answers the common case without formatting a torch.device.
  PyObject* is_cpu = PyObject_GetAttr(tensor, g_ops.str_is_cpu);
  const bool cpu = is_cpu == Py_True;
  Py_XDECREF(is_cpu);
  clear_error_quietly();
  if (cpu) {
    attrs.open("device");
    attrs.put_string("cpu", 3);
    attrs.commit();
  } else if (PyObject* device = PyObject_GetAttr(tensor, g_ops.str_device)) {
    if (PyObject* text = PyObject_Str(device)) {
      Py_ssize_t size = 0;
      if (const char* data = PyUnicode_AsUTF8AndSize(text, &size)) {
        attrs.open("device");
        attrs.put_string(data, static_cast<size_t>(size));
        attrs.commit();
      }
      Py_DECREF(text);
    }
    Py_DECREF(device);
  }
  clear_error_quietly();
}

// "shapes": one entry per positional argument, aligned with the schema:
// a tensor's sizes, a list of sizes for a tensor list, null for anything else.
void put_shapes(JsonAttrs& attrs, PyObject* args) {
  if (args == nullptr || !PyTuple_Check(args)) return;
  constexpr Py_ssize_t kMaxListItems = 64;
  PyObject* first_tensor = nullptr;
  attrs.open("shapes");
  attrs.put_char('[');
  const Py_ssize_t count = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (i > 0) attrs.put_char(',');
    PyObject* arg = PyTuple_GET_ITEM(args, i);
    if (is_tensor(arg)) {
      if (first_tensor == nullptr) first_tensor = arg;
      put_shape(attrs, arg);
    } else if ((PyList_Check(arg) || PyTuple_Check(arg)) && PySequence_Fast_GET_SIZE(arg) > 0 &&
               is_tensor(PySequence_Fast_ITEMS(arg)[0])) {
      PyObject** items = PySequence_Fast_ITEMS(arg);
      const Py_ssize_t size = PySequence_Fast_GET_SIZE(arg);
      attrs.put_char('[');
      for (Py_ssize_t j = 0; j < size && j < kMaxListItems; ++j) {
        if (j > 0) attrs.put_char(',');
        if (is_tensor(items[j])) {
          if (first_tensor == nullptr) first_tensor = items[j];
          put_shape(attrs, items[j]);
        } else {
          attrs.put_raw("null", 4);
        }
      }
      attrs.put_char(']');
    } else {
      attrs.put_raw("null", 4);
    }
  }
  attrs.put_char(']');
  attrs.commit();
  if (first_tensor != nullptr) put_first_tensor_fields(attrs, first_tensor);
}

int64_t call_for_int(PyObject* callable) {
  PyObject* result = PyObject_CallNoArgs(callable);
  if (result == nullptr) {
    clear_error_quietly();
    return -1;
  }
  const unsigned long long value = PyLong_Check(result) ? PyLong_AsUnsignedLongLong(result) : ~0ULL;
  Py_DECREF(result);
  clear_error_quietly();
  return value > static_cast<unsigned long long>(INT64_MAX) ? -1 : static_cast<int64_t>(value);
}

// What links an op to autograd: "seq" on the forward op that created node
// number seq (the first op to see the thread's counter move past it), and
// "bwd_seq"/"bwd_node" on ops run by the backward of that node.
void put_autograd_link(JsonAttrs& attrs) {
  const int64_t next = call_for_int(g_ops.sequence_nr);
  if (next >= 0) {
    if (t_last_sequence_nr >= 0 && next != t_last_sequence_nr && next > 0) attrs.field_int("seq", next - 1);
    t_last_sequence_nr = next;
  }
  PyObject* node = PyObject_CallNoArgs(g_ops.current_node);
  if (node == nullptr) {
    clear_error_quietly();
    return;
  }
  if (node != Py_None) {
    if (node != g_ops.last_node) {
      Py_XDECREF(g_ops.last_node);
      Py_INCREF(node);
      g_ops.last_node = node;
      g_ops.last_node_seq = -1;
      g_ops.last_node_name.clear();
      if (PyObject* method = PyObject_GetAttr(node, g_ops.str_node_seq)) {
        g_ops.last_node_seq = call_for_int(method);  // AccumulateGrad has none: UINT64_MAX -> -1
        Py_DECREF(method);
      }
      clear_error_quietly();
      if (PyObject* method = PyObject_GetAttr(node, g_ops.str_node_name)) {
        if (PyObject* name = PyObject_CallNoArgs(method)) {
          Py_ssize_t size = 0;
          if (const char* data = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &size) : nullptr) {
            g_ops.last_node_name.assign(data, static_cast<size_t>(size));
          }
          Py_DECREF(name);
        }
        Py_DECREF(method);
      }
      clear_error_quietly();
    }
    if (g_ops.last_node_seq >= 0) attrs.field_int("bwd_seq", g_ops.last_node_seq);
    if (!g_ops.last_node_name.empty()) {
      attrs.open("bwd_node");
      attrs.put_string(g_ops.last_node_name.data(), g_ops.last_node_name.size());
      attrs.commit();
    }
  }
  Py_DECREF(node);
}

// Never raises: a failure to describe an op must not fail the op.
void record_op(const OpEntry& entry, PyObject* args) {
  PyObject* saved_type = nullptr;
  PyObject* saved_value = nullptr;
  PyObject* saved_traceback = nullptr;
  PyErr_Fetch(&saved_type, &saved_value, &saved_traceback);
  ++g_ops.seen;
  JsonAttrs attrs;
  put_shapes(attrs, args);
  put_autograd_link(attrs);
  size_t size = 0;
  const char* text = attrs.finish(&size);
  const uint32_t name_id = StringTable::instance().intern_python(entry.name);
  UnwindOptions options;
  options.skip_own_module = true;  // the torch dispatcher frames below stay: they show the path
  options.skip_until_eval = false;
  if (Recorder::instance().record_native(g_ops.kind_id, name_id, text, size, options)) ++g_ops.recorded;
  clear_error_quietly();
  PyErr_Restore(saved_type, saved_value, saved_traceback);
}

const OpEntry* op_entry(PyObject* op) {
  auto hit = g_ops.ops.find(op);
  if (hit != g_ops.ops.end()) return &hit->second;
  PyObject* resolved = PyObject_CallOneArg(g_ops.resolve, op);
  if (resolved == nullptr) return nullptr;
  if (!PyTuple_Check(resolved) || PyTuple_GET_SIZE(resolved) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(resolved, 0)) ||
      !PyCallable_Check(PyTuple_GET_ITEM(resolved, 1))) {
    Py_DECREF(resolved);
    PyErr_SetString(PyExc_TypeError, "tbpipe torch-ops: resolver must return (name: str, callable)");
    return nullptr;
  }
  OpEntry entry{PyTuple_GET_ITEM(resolved, 0), PyTuple_GET_ITEM(resolved, 1)};
  Py_INCREF(entry.name);
  Py_INCREF(entry.callable);
  Py_DECREF(resolved);
  Py_INCREF(op);
  return &g_ops.ops.emplace(op, entry).first->second;
}

// __torch_dispatch__(func, types, args=(), kwargs=None) of tbpipe's mode,
// installed as a builtin bound to the mode instance (`self` is unused).
PyObject* torch_op_dispatch(PyObject*, PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* func = nargs > 0 ? argv[0] : nullptr;
  PyObject* args = nargs > 2 ? argv[2] : nullptr;
  PyObject* kwargs = nargs > 3 ? argv[3] : nullptr;
  const Py_ssize_t keyword_count = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = 0; i < keyword_count; ++i) {
    const char* key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, i));
    if (key == nullptr) return nullptr;
    if (std::strcmp(key, "args") == 0)
      args = argv[nargs + i];
    else if (std::strcmp(key, "kwargs") == 0)
      kwargs = argv[nargs + i];
    else if (std::strcmp(key, "func") == 0)
      func = argv[nargs + i];
  }
  if (func == nullptr || !g_ops.configured) {
    PyErr_SetString(PyExc_RuntimeError, "tbpipe torch-ops dispatch called without an operator or before setup");
    return nullptr;
  }
  const OpEntry* entry = op_entry(func);
  if (entry == nullptr) return nullptr;
  if (g_ops.enabled && Recorder::instance().active()) record_op(*entry, args);

  PyObject* call_args = nullptr;
  if (args == nullptr || args == Py_None) {
    call_args = PyTuple_New(0);
  } else if (PyTuple_Check(args)) {
    call_args = args;
    Py_INCREF(call_args);
  } else {
    call_args = PySequence_Tuple(args);
  }
  if (call_args == nullptr) return nullptr;
  const bool has_kwargs = kwargs != nullptr && PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) > 0;
  PyObject* call_kwargs = has_kwargs ? kwargs : nullptr;
  PyObject* result = PyObject_Call(entry->callable, call_args, call_kwargs);
  Py_DECREF(call_args);
  return result;
}

PyMethodDef torch_op_dispatch_method = {
    "_torch_op_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(torch_op_dispatch)),
    METH_FASTCALL | METH_KEYWORDS,
    "__torch_dispatch__(func, types, args=(), kwargs=None) of the torch-ops mode: records an `op` "
    "event with the calling thread's stack (when enabled and a session is active), then runs the op."};

void replace(PyObject** slot, PyObject* value) {
  Py_XINCREF(value);
  Py_XDECREF(*slot);
  *slot = value;
}

void torch_ops_setup(py::object tensor_type, py::object sequence_nr, py::object current_node, py::object resolve) {
  if (!PyType_Check(tensor_type.ptr())) throw py::type_error("tensor_type must be a type (torch.Tensor)");
  replace(&g_ops.tensor_type, tensor_type.ptr());
  replace(&g_ops.sequence_nr, sequence_nr.ptr());
  replace(&g_ops.current_node, current_node.ptr());
  replace(&g_ops.resolve, resolve.ptr());
  if (g_ops.str_shape == nullptr) {
    g_ops.str_shape = PyUnicode_InternFromString("shape");
    g_ops.str_dtype = PyUnicode_InternFromString("dtype");
    g_ops.str_device = PyUnicode_InternFromString("device");
    g_ops.str_is_cpu = PyUnicode_InternFromString("is_cpu");
    g_ops.str_node_seq = PyUnicode_InternFromString("_sequence_nr");
    g_ops.str_node_name = PyUnicode_InternFromString("name");
  }
  g_ops.kind_id = StringTable::instance().intern_utf8("op", 2);
  g_ops.configured = true;
}

py::dict torch_ops_counters() {
  py::dict out;
  out["seen"] = g_ops.seen;
  out["recorded"] = g_ops.recorded;
  out["operators"] = g_ops.ops.size();
  return out;
}

py::dict cupti_start_binding(const std::vector<std::string>& candidates) {
  CuptiStartResult result = cupti_start(candidates);
  py::dict out;
  static const char* const kStatusNames[] = {"started", "no_library", "missing_symbols", "other_subscriber",
                                             "subscribe_failed"};
  const int status = static_cast<int>(result.status);
  out["status"] = (status >= 0 && status < 5) ? kStatusNames[status] : "unknown";
  out["library"] = result.library;
  out["message"] = result.message;
  out["enabled_callbacks"] = result.enabled_callbacks;
  return out;
}

template <typename T>
py::bytes column_bytes(const std::vector<T>& values) {
  return py::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

struct ActivityKindName {
  unsigned bit;
  const char* name;
};
constexpr ActivityKindName kActivityKindNames[] = {
    {kGpuKernel, "kernel"}, {kGpuMemcpy, "memcpy"}, {kGpuMemset, "memset"}, {kGpuSync, "sync"}};

py::list activity_kind_names(unsigned kinds) {
  py::list out;
  for (const ActivityKindName& kind : kActivityKindNames) {
    if ((kinds & kind.bit) != 0) out.append(kind.name);
  }
  return out;
}

py::dict cupti_activity_start_binding(const std::vector<std::string>& kinds) {
  unsigned wanted = 0;
  for (const std::string& name : kinds) {
    bool known = false;
    for (const ActivityKindName& kind : kActivityKindNames) {
      if (name == kind.name) {
        wanted |= kind.bit;
        known = true;
      }
    }
    if (!known) throw py::value_error("unknown GPU activity kind '" + name + "' (kernel, memcpy, memset, sync)");
  }
  CuptiActivityStartResult result;
  {
    py::gil_scoped_release release;  // CUPTI may call back into buffers on other threads meanwhile
    result = cupti_activity_start(wanted);
  }
  py::dict out;
  out["status"] = result.started ? "started" : "not_started";
  out["kinds"] = activity_kind_names(result.kinds);
  out["graph_nodes"] = result.graph_nodes;
  out["message"] = result.message;
  out["clock_offset_ns"] = result.clock_offset_ns;
  return out;
}

py::dict activity_counters_dict(const GpuActivityCounters& c) {
  py::dict out;
  out["records"] = c.records;
  out["dropped"] = c.dropped;
  out["lost"] = c.lost;
  out["malformed"] = c.malformed;
  out["buffers"] = c.buffers;
  out["graph_nodes"] = c.graph_nodes;
  return out;
}

// Everything GPU activity recorded since the last drain, as raw little-endian
// columns; None when activity never started in this process.
py::object gpu_activity_drain_binding(bool flush) {
  GpuActivityDrained d;
  {
    py::gil_scoped_release release;  // the flush waits for CUPTI's buffers
    if (flush) gpu_activity_flush();
    gpu_activity_drain(&d);
  }
  if (!d.active) return py::none();
  py::dict out;
  out["kind"] = column_bytes(d.kind);
  out["name_id"] = column_bytes(d.name_id);
  out["start_ns"] = column_bytes(d.start_ns);
  out["end_ns"] = column_bytes(d.end_ns);
  out["device"] = column_bytes(d.device);
  out["context"] = column_bytes(d.context);
  out["stream"] = column_bytes(d.stream);
  out["correlation_id"] = column_bytes(d.correlation_id);
  out["graph_id"] = column_bytes(d.graph_id);
  out["graph_node_id"] = column_bytes(d.graph_node_id);
  out["bytes"] = column_bytes(d.bytes);
  out["grid_x"] = column_bytes(d.grid_x);
  out["grid_y"] = column_bytes(d.grid_y);
  out["grid_z"] = column_bytes(d.grid_z);
  out["block_x"] = column_bytes(d.block_x);
  out["block_y"] = column_bytes(d.block_y);
  out["block_z"] = column_bytes(d.block_z);
  out["registers"] = column_bytes(d.registers);
  out["static_shared"] = column_bytes(d.static_shared);
  out["dynamic_shared"] = column_bytes(d.dynamic_shared);
  out["node_id"] = column_bytes(d.node_id);
  out["original_node_id"] = column_bytes(d.original_node_id);
  out["node_graph_id"] = column_bytes(d.node_graph_id);
  out["node_correlation_id"] = column_bytes(d.node_correlation_id);
  out["node_type"] = column_bytes(d.node_type);
  out["node_thread_id"] = column_bytes(d.node_thread_id);
  out["node_ts_ns"] = column_bytes(d.node_ts_ns);
  out["counters"] = activity_counters_dict(d.counters);
  out["clock_offset_ns"] = d.clock_offset_ns;
  return out;
}

}  // namespace

void register_source_bindings(py::module_& m) {
  m.def("_cupti_start", &cupti_start_binding, py::arg("candidates"),
        "Load libcupti (first loadable candidate) and subscribe to kernel launches; returns "
        "{status, library, message, enabled_callbacks}. Never raises for a missing GPU or library.");
  m.def("_cupti_stop", &cupti_stop, "Stop recording launches and unsubscribe from CUPTI.");
  m.def("_cupti_subscribed", &cupti_subscribed);
  m.def(
      "_cupti_abi",
      []() {
        py::list callbacks;
        for (const CuptiCallbackInfo& info : cupti_launch_callbacks()) {
          callbacks.append(py::make_tuple(info.domain, info.cbid, info.api, info.cbid_name, info.graph));
        }
        py::dict out;
        out["callbacks"] = callbacks;
        out["declared"] = cupti_declared_abi_all();
        return out;
      },
      "(domain, cbid, api, cbid enumerator, is graph) per enabled callback, and the declared CUPTI ABI.");
  m.def("_cupti_counters", []() {
    CuptiCounters c = cupti_counters();
    py::dict out;
    out["kernel_launches"] = c.kernel_launches;
    out["graph_launches"] = c.graph_launches;
    out["nested_skipped"] = c.nested_skipped;
    out["not_recorded"] = c.not_recorded;
    return out;
  });
  m.def("_cupti_activity_start", &cupti_activity_start_binding, py::arg("kinds"),
        "With the launch callbacks subscribed, record GPU activity of these kinds (kernel, memcpy, memset, sync); "
        "returns {status, kinds, graph_nodes, message, clock_offset_ns}.");
  m.def("_gpu_activity_drain", &gpu_activity_drain_binding, py::arg("flush") = true,
        "Ask CUPTI for its completed buffers (flush=True), then move every stored activity record and graph node "
        "out, columnar; None when GPU activity never started in this process.");
  m.def("_gpu_activity_counters", []() {
    py::dict out = activity_counters_dict(gpu_activity_counters());
    out["active"] = gpu_activity_active();
    out["transfers"] = cupti_counters().transfers;
    return out;
  });

  m.def("_torch_ops_setup", &torch_ops_setup, py::arg("tensor_type"), py::arg("sequence_nr"), py::arg("current_node"),
        py::arg("resolve"),
        "Hand the torch-ops fast path the torch objects it uses (no torch headers are compiled in).");
  m.def("_torch_ops_enable", [](bool enabled) { g_ops.enabled = enabled; }, py::arg("enabled"));
  m.def("_torch_ops_counters", &torch_ops_counters);
  m.attr("_torch_op_dispatch") =
      py::reinterpret_steal<py::object>(PyCFunction_NewEx(&torch_op_dispatch_method, nullptr, nullptr));
  m.def(
      "_torch_op_dispatch_bound_to",
      [](py::object mode) {
        // torch checks that `mode.__torch_dispatch__.__self__ is mode`: a
        // builtin created with the mode as its self passes, and still runs
        // without a Python frame.
        return py::reinterpret_steal<py::object>(PyCFunction_NewEx(&torch_op_dispatch_method, mode.ptr(), nullptr));
      },
      py::arg("mode"), "The torch-ops dispatch entry point as a builtin method bound to `mode`.");

  m.def(
      "_set_overhead_limits",
      [](double sample_rate, uint32_t max_per_stack_per_s) {
        if (!(sample_rate > 0.0 && sample_rate <= 1.0)) throw py::value_error("sample_rate must be in (0, 1]");
        OverheadLimits limits;
        limits.sample_rate = sample_rate;
        limits.max_per_stack_per_s = max_per_stack_per_s;
        Recorder::instance().set_overhead_limits(limits);
      },
      py::arg("sample_rate") = 1.0, py::arg("max_per_stack_per_s") = 0,
      "Sampling rate and per-stack rate limit for events recorded from now on.");
  m.def(
      "_sample_rate", []() { return Recorder::instance().sample_rate(); },
      "The sampling rate set last (1.0: every event is kept).");
  m.def(
      "_set_splicing", [](bool enabled) { Recorder::instance().set_splicing(enabled); }, py::arg("enabled"),
      "Whether events that open scopes (the torch-ops observer's) take the outer part of their stack from the "
      "enclosing scope's event (on by default): tests compare the stacks both ways.");
  m.def(
      "_set_nested_op_stacks", [](bool enclosing) { Recorder::instance().set_nested_stacks_enclosing(enclosing); },
      py::arg("enclosing"),
      "Whether an op called inside another op (the torch-ops observer's nested events) takes the enclosing op's "
      "stack, with no Python code run in between, instead of gathering its own (the Session's op_stacks).");
  m.def("_spliced_walks", &spliced_walks_on_this_thread,
        "How many native walks of the calling thread took their outer frames from an enclosing scope's stack.");
  m.def(
      "_set_stack_parts", [](bool python, bool native) { Recorder::instance().set_stack_parts(python, native); },
      py::arg("python") = true, py::arg("native") = true,
      "Which halves of the stack events recorded from now on get (the session's python/native settings), "
      "changed inside a session: for benchmarks that compare them.");
  m.def(
      "_set_stack_reuse",
      [](bool enabled, uint32_t check_every) { Recorder::instance().set_stack_reuse(enabled, check_every); },
      py::arg("enabled"), py::arg("check_every") = 256,
      "Whether scoped events (the torch-ops observer's) take the stack an earlier event of their thread gathered "
      "in the same place instead of gathering one (on by default), and how often a reuse is checked by gathering "
      "anyway (1 in about check_every): tests compare both ways.");
  m.def("_overhead_counters", []() {
    RecorderCounters c = Recorder::instance().counters();
    py::dict out;
    out["sampled_out"] = c.sampled_out;
    out["rate_limited"] = c.rate_limited;
    out["stacks_reused"] = c.stacks_reused;
    out["reuse_checked"] = c.reuse_checked;
    out["reuse_mismatched"] = c.reuse_mismatched;
    return out;
  });
}

}  // namespace tbpipe
