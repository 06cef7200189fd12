// The torch-ops source's RecordFunction observer: the extension `_tbpipe_torch_observer`, compiled on
// the user's machine against the installed torch's headers (tbpipe.capture.torch_observer builds and
// caches it per torch version) and loaded once the program has imported torch.
//
// PyTorch's profiler hooks ops the same way: a global RecordFunction callback runs on every thread,
// for every op as it is called (composite ops and the ops they call, nested), for autograd's backward
// nodes and for user scopes (`record_function`). The start callback records an `op` event through
// tbpipe._native's C API (capi.h): the recorder gathers the calling thread's combined stack and
// applies sampling and the per-stack limit. Nothing here touches Python objects on the hot path: the
// attributes are typed fields (TbpipeOpAttrs, the events table's op_* columns), names are interned
// once per thread.
//
// Attributes of an event, each in the events table's column op_<name> (absent where it does not apply):
//   id          this op's number on its thread (with the event's thread, unique in the run)
//   depth       how many observed ops enclose it on its thread (0: called from outside any op);
//               absent at sample rates below 1, where torch draws the ops (see g_torch_rate)
//   parent      id of the innermost enclosing op; absent likewise
//   seq         autograd sequence number of a forward op dispatched through autograd: the backward
//               node it creates (if any) gets the same number
//   seq_thread  RecordFunction's number for the thread that ran the forward op (pairs with seq)
//   bwd_seq, fwd_thread, bwd_node   on a backward node's event and every op inside it: the node's
//               sequence number, the number of the thread that ran its forward op, its name
//   scope       for what is not a plain op: "backward" (an autograd node), "user" (record_function),
//               "torchscript", ...
#include <ATen/record_function.h>
#include <Python.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "capi.h"

namespace {

// ---------------------------------------------------------------------------- state shared by all threads

const TbpipeCApi* g_api = nullptr;  // set before the callback is added, never cleared
at::CallbackHandle g_handle = 0;    // 0 while no callback is registered (changed with the GIL held)
// Below 1, the rate torch's own sampler draws ops with (the callback's samplingProb): an op not drawn
// costs nearly nothing (no RecordFunction is made active for it), and none of our code runs for it.
std::atomic<double> g_torch_rate{1.0};
// With torch drawing: the unsampled callback that keeps each thread's open backward nodes, so that
// the ops drawn inside one still say which forward op they belong to.
at::CallbackHandle g_backward_handle = 0;
uint32_t g_kind_op = 0;  // interned "op"
// Whether the start callback does anything (cleared by stop(); a forked child that must not touch
// torch's callback lock stops this way without removing the callback).
std::atomic<bool> g_enabled{false};
// What the start callback does: 0 nothing but keep the nesting (for measuring the RecordFunction
// machinery alone), 1 describe and record.
std::atomic<int> g_level{1};
// Whether torch.compile is compiling: its ops (type promotion, shape checks, tracing) are the
// compiler's, not the program's, and are not recorded. Dynamo's compile callbacks say when, once
// for all threads (its start and end callbacks run for the first compile to start and the last to
// end, maybe on different threads), so ops of other threads are left out meanwhile too.
std::atomic<bool> g_compiling{false};

// ---------------------------------------------------------------------------- per thread

// One observed op in progress on this thread.
struct Frame {
  const at::RecordFunction* fn;  // identifies the op when it ends
  const char* name;              // owned by the RecordFunction (alive while the op runs)
  uint64_t id;
  int64_t bwd_seq;       // -1 outside a backward node
  uint64_t fwd_thread;   // with bwd_seq
  const char* bwd_node;  // with bwd_seq: the node's name, owned by its RecordFunction (alive while nested)
  uint32_t bwd_node_id;  // bwd_node interned (0: not yet), for the ops inside to share
  bool scoped;           // its event opened a scope in the recorder (end_scope when it ends)
  bool traced;           // run on fake tensors (tracing, not work): neither it nor anything inside is recorded
};

// The last names seen at each address, with their text inline (one cache line each), two lines per
// set of addresses (the newer first): an op's name is its schema's, at the same address every call,
// and a step's few hundred names would often share a line of a direct-mapped table. The text is
// compared too, because names built per call (backward nodes, user scopes) can come at an address
// another name had before. A step's ops come in the same order every time, and its names' lines are
// out of the cache by the time they come again: each line keeps the set looked up after it last
// time, fetched into the cache while the op runs.
class RecentNames {
 public:
  static constexpr size_t kTextBytes = 48;

  // The id of `name` if a line holds this address with this text, else 0.
  uint32_t find(const char* name) {
    const size_t set_index = set_of(name);
    if (previous_ != nullptr) previous_->next_set = static_cast<uint16_t>(set_index);
    previous_ = nullptr;
    Line* set = &lines_[set_index * kWays];
    for (size_t way = 0; way < kWays; ++way) {
      Line& line = set[way];
      if (line.address != name) continue;
      const size_t length = strnlen(name, kTextBytes);
      if (length == line.length && std::memcmp(line.text, name, length) == 0) {
        previous_ = &line;
        const Line* next = &lines_[line.next_set * kWays];
        __builtin_prefetch(next);
        __builtin_prefetch(next + 1);
        return line.id;
      }
    }
    return 0;
  }

  void remember(const char* name, uint32_t id) {
    const size_t length = strnlen(name, kTextBytes);
    if (length == kTextBytes) return;  // too long to keep inline: the table by text has it
    Line* set = &lines_[set_of(name) * kWays];
    set[1] = set[0];
    Line& line = set[0];
    line.address = name;
    line.id = id;
    line.length = static_cast<uint16_t>(length);
    line.next_set = 0;
    std::memcpy(line.text, name, length);
    previous_ = &line;
  }

 private:
  struct alignas(64) Line {
    const char* address = nullptr;
    uint32_t id = 0;
    uint16_t length = 0;
    uint16_t next_set = 0;  // the set looked up after this line's name, last time
    char text[kTextBytes];
  };
  static_assert(sizeof(Line) == 64, "a name's line is one cache line");
  static constexpr size_t kWays = 2;
  static constexpr size_t kSets = 256;
  static size_t set_of(const char* name) {
    const uint64_t key = reinterpret_cast<uintptr_t>(name);
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> 56);  // top 8 bits: kSets == 256
  }
  Line lines_[kSets * kWays];
  Line* previous_ = nullptr;  // the line found or filled last (its next_set is the next lookup's)
};

// Names that are new on every call ("ProfilerStep#17") would grow the table without bound.
constexpr size_t kMaxNamesPerThread = 4096;

// Op names to string-table ids by their text, for the names RecentNames misses: those built per call
// (a backward node's, at another address each time), those longer than its lines, those whose set
// was taken. Open addressing with each text's hash kept beside it: a lookup compares hashes in one
// array and one text, where a node-based map chased a pointer per node and hashed each node's text
// again to tell where its bucket ends.
class NamesByText {
 public:
  uint32_t find(std::string_view text, uint64_t hash) const {
    if (slots_.empty()) return 0;
    for (size_t i = hash & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& slot = slots_[i];
      if (slot.id == 0) return 0;
      if (slot.hash == hash && slot.text == text) return slot.id;
    }
  }

  void add(std::string_view text, uint64_t hash, uint32_t id) {
    if (count_ >= kMaxNamesPerThread) clear();
    if (2 * (count_ + 1) > slots_.size()) grow();  // at most half full: probes stay short
    place(Slot{hash, id, std::string(text)});
    ++count_;
  }

  static uint64_t hash_of(std::string_view text) { return std::hash<std::string_view>{}(text); }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t id = 0;  // 0: empty
    std::string text;
  };

  void place(Slot&& slot) {
    size_t i = slot.hash & (slots_.size() - 1);
    while (slots_[i].id != 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = std::move(slot);
  }

  void grow() {
    std::vector<Slot> old(std::max<size_t>(256, 2 * slots_.size()));
    old.swap(slots_);
    for (Slot& slot : old) {
      if (slot.id != 0) place(std::move(slot));
    }
  }

  void clear() {
    slots_.clear();
    count_ = 0;
  }

  std::vector<Slot> slots_;  // a power of two long
  size_t count_ = 0;
};

// An autograd backward node running on this thread (kept with torch drawing ops, see g_torch_rate).
struct BackwardNode {
  const at::RecordFunction* fn;
  int64_t seq;
  uint64_t fwd_thread;
  const char* name;  // owned by the node's RecordFunction (alive while it runs)
};

struct ThreadState {
  std::vector<Frame> frames;
  std::vector<BackwardNode> backward;
  uint64_t next_id = 1;
  RecentNames recent;
  NamesByText names;  // behind `recent`

  ThreadState() { frames.reserve(64); }
};

// Deeper nesting than this is recorded with its depth but not kept as a parent.
constexpr size_t kMaxFrames = 1024;

// The calling thread's state, reached through an initial-exec thread-local pointer (a load off
// %fs): a thread_local of the state itself, in a library loaded with dlopen, costs __tls_get_addr
// calls at every access, several per op. `t_owned` deletes it when the thread ends.
thread_local ThreadState* t_state __attribute__((tls_model("initial-exec"))) = nullptr;

struct OwnedState {
  std::unique_ptr<ThreadState> state;
  ~OwnedState() { t_state = nullptr; }
};
thread_local OwnedState t_owned;

__attribute__((noinline)) ThreadState& new_thread_state() {
  t_owned.state.reset(new ThreadState());
  t_state = t_owned.state.get();
  return *t_state;
}

inline ThreadState& thread_state() {
  ThreadState* state = t_state;
  return __builtin_expect(state != nullptr, 1) ? *state : new_thread_state();
}

uint32_t name_id(ThreadState& state, const char* name) {
  if (name == nullptr) name = "";
  if (const uint32_t id = state.recent.find(name)) return id;
  const std::string_view text(name);
  const uint64_t hash = NamesByText::hash_of(text);
  uint32_t id = state.names.find(text, hash);
  if (id == 0) {
    id = g_api->intern(text.data(), text.size());
    if (id != 0) state.names.add(text, hash, id);
  }
  state.recent.remember(name, id);
  return id;
}

// ---------------------------------------------------------------------------- attributes

const char* scope_name(at::RecordScope scope) {
  switch (scope) {
    case at::RecordScope::FUNCTION:
      return nullptr;
    case at::RecordScope::BACKWARD_FUNCTION:
      return "backward";
    case at::RecordScope::TORCHSCRIPT_FUNCTION:
      return "torchscript";
    case at::RecordScope::KERNEL_FUNCTION_DTYPE:
      return "kernel_dtype";
    case at::RecordScope::CUSTOM_CLASS:
      return "custom_class";
    case at::RecordScope::BUILD_FEATURE:
      return "build_feature";
    case at::RecordScope::LITE_INTERPRETER:
      return "lite_interpreter";
    case at::RecordScope::USER_SCOPE:
      return "user";
    case at::RecordScope::STATIC_RUNTIME_OP:
      return "static_runtime_op";
    case at::RecordScope::STATIC_RUNTIME_MODEL:
      return "static_runtime_model";
    default:
      return "other";
  }
}

// ---------------------------------------------------------------------------- the callbacks

// The interned text of a scope that is not a plain op (0 for a plain op), looked up once per scope.
uint32_t scope_id(at::RecordScope scope) {
  static std::atomic<uint32_t> ids[static_cast<size_t>(at::RecordScope::NUM_SCOPES)];
  const size_t index = static_cast<size_t>(scope);
  if (index >= static_cast<size_t>(at::RecordScope::NUM_SCOPES)) return 0;
  uint32_t id = ids[index].load(std::memory_order_relaxed);
  if (id == 0) {
    const char* text = scope_name(scope);
    if (text == nullptr) return 0;
    id = g_api->intern(text, std::strlen(text));
    ids[index].store(id, std::memory_order_relaxed);
  }
  return id;
}

void record_op(ThreadState& state, const at::RecordFunction& fn, const char* name, Frame& frame, const Frame* parent,
               at::RecordScope scope, bool scoped) {
  const uint32_t name_number = name_id(state, name);
  TbpipeOpAttrs op;
  op.present = TBPIPE_OP_ID;
  op.id = frame.id;
  // With torch drawing ops, the enclosing ops were mostly not drawn: the nesting is not known.
  if (g_torch_rate.load(std::memory_order_relaxed) >= 1.0) {
    op.present |= TBPIPE_OP_DEPTH;
    op.depth = static_cast<uint32_t>(state.frames.size());
    if (parent != nullptr) {
      op.present |= TBPIPE_OP_PARENT;
      op.parent = parent->id;
    }
  }
  const int64_t seq = fn.seqNr();
  if (scope == at::RecordScope::FUNCTION && seq >= 0) {
    op.present |= TBPIPE_OP_SEQ;
    op.seq = seq;
    op.seq_thread = static_cast<uint64_t>(fn.threadId());
  }
  op.bwd_node = 0;
  if (frame.bwd_seq >= 0) {
    op.present |= TBPIPE_OP_BACKWARD;
    op.bwd_seq = frame.bwd_seq;
    op.fwd_thread = frame.fwd_thread;
    if (frame.bwd_node != nullptr && frame.bwd_node_id == 0) {
      frame.bwd_node_id = frame.bwd_node == name ? name_number : name_id(state, frame.bwd_node);
    }
    op.bwd_node = frame.bwd_node_id;
  }
  op.scope = scope_id(scope);
  // Drawn by torch at rates below 1 (not again by the session's rate); else by the session's rate,
  // in record_op. A nesting op runs on this thread until its end callback: the ops inside it reuse
  // the outer part of this event's stack. An op called inside another: the session may give it the
  // enclosing op's stack (op_stacks).
  const uint32_t flags = (g_torch_rate.load(std::memory_order_relaxed) < 1.0 ? TBPIPE_RECORD_SAMPLED : 0u) |
                         (parent != nullptr ? TBPIPE_RECORD_NESTED : 0u);
  g_api->record_op(g_kind_op, name_number, &op, scoped ? &fn : nullptr, flags);
}

// The autograd engine's range around one node: the node's own range, then the checks and sums of
// its outputs (`aten::sum` reducing a broadcast gradient, `aten::add` accumulating one).
constexpr std::string_view kEngineEvaluate = "autograd::engine::evaluate_function: ";

bool is_engine_evaluate(const char* name) {
  return name != nullptr && std::strncmp(name, kEngineEvaluate.data(), kEngineEvaluate.size()) == 0;
}

// Whether ops dispatched on this thread now only trace: torch.compile, torch.export and make_fx run
// a model's ops on fake tensors (FakeTensorMode), or record them (proxy and functionalization
// modes), to build a graph. The dispatch mode is never called then (`ignore_compile_internals`);
// the observer would see those ops at the line that triggered the compile.
bool tracing_on_this_thread() {
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  if (!TorchDispatchModeTLS::any_modes_set(/*skip_infra_modes=*/false)) return false;
  return TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::FAKE).has_value() ||
         TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::PROXY).has_value() ||
         TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::FUNCTIONAL).has_value();
}

void start_op(const at::RecordFunction& fn) {
  if (!g_enabled.load(std::memory_order_relaxed)) return;
  ThreadState& state = thread_state();
  Frame* parent = state.frames.empty() ? nullptr : &state.frames.back();
  // An async op may end on another thread: it is recorded, but nothing nests under it here.
  const bool nests = !fn.isAsync() && state.frames.size() < kMaxFrames;
  // A traced op's fake implementation runs with the fake mode popped: its ops are skipped as inside it.
  if ((parent != nullptr && parent->traced) || g_compiling.load(std::memory_order_relaxed) ||
      tracing_on_this_thread()) {
    if (nests) state.frames.push_back(Frame{&fn, nullptr, 0, -1, 0, nullptr, 0, false, true});
    return;
  }
  const at::RecordScope scope = fn.scope();
  const char* name = fn.name();
  Frame frame{&fn, name, state.next_id++, -1, 0, nullptr, 0, false, false};
  if (parent != nullptr) {
    frame.bwd_seq = parent->bwd_seq;
    frame.fwd_thread = parent->fwd_thread;
    frame.bwd_node = parent->bwd_node;
    frame.bwd_node_id = parent->bwd_node_id;
  }
  if (frame.bwd_seq < 0 && !state.backward.empty()) {  // torch drawing: the node itself was not drawn
    const BackwardNode& node = state.backward.back();
    frame.bwd_seq = node.seq;
    frame.fwd_thread = node.fwd_thread;
    frame.bwd_node = node.name;
    frame.bwd_node_id = 0;
  }
  // An autograd node's RecordFunction carries its sequence number and its forward op's thread; the ops
  // its backward calls inherit both, and so do the ops the engine runs on its outputs afterwards
  // (their range encloses the node's; it was recorded before the node was known).
  if (scope == at::RecordScope::BACKWARD_FUNCTION && fn.seqNr() >= 0) {
    frame.bwd_seq = fn.seqNr();
    frame.fwd_thread = fn.forwardThreadId();
    frame.bwd_node = name;
    frame.bwd_node_id = 0;
    if (parent != nullptr && parent->bwd_seq < 0 && is_engine_evaluate(parent->name)) {
      parent->bwd_seq = frame.bwd_seq;
      parent->fwd_thread = frame.fwd_thread;
      parent->bwd_node = parent->name + kEngineEvaluate.size();  // the node's name, in text the parent owns
      parent->bwd_node_id = 0;
    }
  }
  if (g_level.load(std::memory_order_relaxed) > 0) {
    frame.scoped = nests;  // (an op the session's sample rate leaves out opens no scope: ending it is a no-op)
    record_op(state, fn, name, frame, parent, scope, nests);
  }
  if (nests) state.frames.push_back(frame);
}

void end_op(const at::RecordFunction& fn) {
  std::vector<Frame>& frames = thread_state().frames;
  // Normally the innermost; an op that never reached our end callback (one started before the
  // callback was added ends without it) is dropped with whatever it left above it.
  for (size_t i = frames.size(); i > 0; --i) {
    if (frames[i - 1].fn == &fn) {
      if (frames[i - 1].scoped) g_api->end_scope(&fn);  // and any left open inside it
      frames.resize(i - 1);
      return;
    }
  }
}

std::unique_ptr<at::ObserverContext> on_backward_start(const at::RecordFunction& fn) {
  try {
    if (fn.seqNr() >= 0) {
      thread_state().backward.push_back(BackwardNode{&fn, fn.seqNr(), fn.forwardThreadId(), fn.name()});
    }
  } catch (...) {
  }
  return nullptr;
}

void on_backward_end(const at::RecordFunction& fn, at::ObserverContext*) {
  std::vector<BackwardNode>& nodes = thread_state().backward;
  for (size_t i = nodes.size(); i > 0; --i) {
    if (nodes[i - 1].fn == &fn) {
      nodes.resize(i - 1);
      return;
    }
  }
}

// RecordFunction catches what a callback throws and logs it per op; nothing may escape here either
// way, and a failure to describe an op must never fail it.
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  try {
    start_op(fn);
  } catch (...) {
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  try {
    end_op(fn);
  } catch (...) {
  }
}

// ---------------------------------------------------------------------------- Python functions

const TbpipeCApi* api_from(PyObject* capsule) {
  auto* api = static_cast<const TbpipeCApi*>(PyCapsule_GetPointer(capsule, TBPIPE_CAPI_CAPSULE));
  if (api == nullptr) return nullptr;
  if (api->abi_version != TBPIPE_CAPI_VERSION || !TBPIPE_CAPI_HAS(api, record_op)) {
    PyErr_Format(PyExc_RuntimeError,
                 "tbpipe._native's C API (version %u, %u bytes) is not the one this observer was built for "
                 "(version %u)",
                 api->abi_version, api->size, TBPIPE_CAPI_VERSION);
    return nullptr;
  }
  return api;
}

bool remove_callbacks() {
  const at::CallbackHandle handles[] = {g_handle, g_backward_handle};
  g_handle = 0;
  g_backward_handle = 0;
  try {
    for (const at::CallbackHandle handle : handles) {
      if (handle != 0) at::removeCallback(handle);
    }
  } catch (const std::exception& error) {
    PyErr_Format(PyExc_RuntimeError, "at::removeCallback failed: %s", error.what());
    return false;
  }
  return true;
}

PyObject* start(PyObject*, PyObject* args) {
  PyObject* capsule = nullptr;
  double rate = 1.0;
  int may_replace = 1;
  if (!PyArg_ParseTuple(args, "O|dp", &capsule, &rate, &may_replace)) return nullptr;
  if (!(rate > 0.0 && rate <= 1.0)) {
    PyErr_SetString(PyExc_ValueError, "the sample rate must be in (0, 1]");
    return nullptr;
  }
  const TbpipeCApi* api = api_from(capsule);
  if (api == nullptr) return nullptr;
  // Added at another rate: added again at this one, where removing is safe (not in a forked child,
  // whose callbacks stay as they came; the session's own draw then applies on top).
  if (g_handle != 0 && rate != g_torch_rate.load() && may_replace) {
    g_enabled.store(false, std::memory_order_relaxed);
    if (!remove_callbacks()) return nullptr;
  }
  if (g_handle == 0) {
    g_api = api;
    g_kind_op = api->intern("op", 2);
    g_torch_rate.store(rate);
    try {
      if (rate < 1.0) {
        // Added first, so that it runs before the op's own callback on a node that both see.
        g_backward_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_backward_start, on_backward_end)
                                                      .needsInputs(false)
                                                      .needsIds(false)
                                                      .scopes({at::RecordScope::BACKWARD_FUNCTION}));
      }
      // Every scope, as the profiler's CPU activity sees them; no inputs (they would box every op's
      // arguments), no ids (ours are per thread and need no shared counter).
      g_handle = at::addGlobalCallback(
          at::RecordFunctionCallback(on_start, on_end).needsInputs(false).needsIds(false).samplingProb(rate));
    } catch (const std::exception& error) {
      remove_callbacks();
      PyErr_Clear();
      PyErr_Format(PyExc_RuntimeError, "at::addGlobalCallback failed: %s", error.what());
      return nullptr;
    }
  }
  g_enabled.store(true, std::memory_order_relaxed);
  return PyFloat_FromDouble(g_torch_rate.load());
}

PyObject* stop(PyObject*, PyObject* remove) {
  g_enabled.store(false, std::memory_order_relaxed);
  if (g_handle == 0 || !PyObject_IsTrue(remove)) Py_RETURN_NONE;
  if (!remove_callbacks()) return nullptr;
  Py_RETURN_NONE;
}

PyObject* registered(PyObject*, PyObject*) { return PyBool_FromLong(g_handle != 0); }

PyObject* set_level(PyObject*, PyObject* arg) {
  const long level = PyLong_AsLong(arg);
  if (level == -1 && PyErr_Occurred()) return nullptr;
  if (level < 0 || level > 1) {
    PyErr_SetString(PyExc_ValueError, "level must be 0 (keep the nesting only) or 1 (record)");
    return nullptr;
  }
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyObject* compiling(PyObject*, PyObject* flag) {
  const int on = PyObject_IsTrue(flag);
  if (on < 0) return nullptr;
  g_compiling.store(on != 0, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"start", start, METH_VARARGS,
     "start(capsule, sample_rate=1.0, may_replace=True) -> the rate torch draws ops at: add the global "
     "RecordFunction callback (once) and enable it; it records through tbpipe._native's C API capsule. Below 1, "
     "torch's own sampler draws the ops "
     "recorded (ops not drawn cost nearly nothing), and events carry no depth or parent. A callback added at "
     "another rate is replaced when may_replace (false in a forked child)."},
    {"stop", stop, METH_O,
     "stop(remove): disable the callback; with remove true, also remove it from torch (not in a forked child: "
     "removing takes a lock that a thread of the parent may have held at the fork)."},
    {"registered", registered, METH_NOARGS, "registered() -> bool: whether the callback is added."},
    {"compiling", compiling, METH_O,
     "compiling(flag): torch.compile starts (true) or ends (false) compiling; ops in between are "
     "not recorded (Dynamo's compile callbacks call it, through tbpipe.capture.torch_compile)."},
    {"set_level", set_level, METH_O,
     "set_level(level): 1 records every op (the default); 0 keeps the callback running but records nothing "
     "(the RecordFunction machinery's own cost, for benchmarks)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "_tbpipe_torch_observer",
    "tbpipe's RecordFunction observer for the torch-ops source (built against the installed torch).",
    -1,
    kMethods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__tbpipe_torch_observer() { return PyModule_Create(&kModule); }
