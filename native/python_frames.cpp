// Direct walk of CPython's frame chain and the code-object registry.
//
// The frame layouts are private to CPython and change in every minor version,
// so this file reads them through CPython's own internal headers (Py_BUILD_CORE)
// of the version the extension is built for, rather than mirrored structs.
#define Py_BUILD_CORE 1
#include "python_frames.h"

#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000
#include <internal/pycore_frame.h>
#endif

#include <deque>
#include <memory>
#include <mutex>

#include "hash_mix.h"
#include "pointer_map.h"

#if defined(Py_GIL_DISABLED)
#error "tbpipe reads frames without the GIL; free-threaded CPython builds are not supported yet"
#endif

namespace tbpipe {
namespace {

PyThreadState* current_thread_state_or_null() {
#if PY_VERSION_HEX >= 0x030D0000
  return PyThreadState_GetUnchecked();
#else
  return _PyThreadState_UncheckedGet();
#endif
}

// The calling thread's own thread state even while it has released the GIL
// (the "current" one is cleared then; the GIL-state slot keeps it). Before
// 3.12 the "current" thread state is one per process: that of whichever
// thread holds the GIL, which need not be the caller (a launch callback runs
// while another thread holds it), so only the GIL-state slot can say.
PyThreadState* own_thread_state() {
#if PY_VERSION_HEX >= 0x030C0000
  PyThreadState* state = current_thread_state_or_null();  // per thread from 3.12
  if (state != nullptr) return state;
#endif
  return PyGILState_GetThisThreadState();
}

PyObject* qualname_of(PyCodeObject* code) {
#if PY_VERSION_HEX >= 0x030B0000
  return code->co_qualname;
#else
  return code->co_name;  // 3.10 code objects carry no qualified name
#endif
}

// UTF-8 copy of a str without calling into the interpreter (no GIL needed):
// reads the canonical compact representation directly.
std::string copy_unicode_without_gil(PyObject* text) {
  if (text == nullptr || !PyUnicode_Check(text)) return "<?>";
#if PY_VERSION_HEX < 0x030C0000
  if (!PyUnicode_IS_READY(text)) return "<?>";
#endif
  const Py_ssize_t length = PyUnicode_GET_LENGTH(text);
  const int kind = PyUnicode_KIND(text);
  const void* data = PyUnicode_DATA(text);
  std::string out;
  out.reserve(static_cast<size_t>(length));
  for (Py_ssize_t i = 0; i < length; ++i) {
    uint32_t c = PyUnicode_READ(kind, data, i);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

bool is_code(PyObject* object) { return object != nullptr && Py_TYPE(object) == &PyCode_Type; }

}  // namespace

// ---------------------------------------------------------------------------
// CodeRegistry

struct CodeRegistry::Impl {
  // Strong entries: interned with the GIL, the object is kept alive.
  PointerIdMap strong;
  // Copies made without the GIL. The address may be reused after the object
  // dies, so a hit is only trusted when the identity signature still matches.
  PointerIdMap copies;
  mutable std::mutex mutex;    // guards `infos`, `signatures` and writers of `copies`
  std::deque<CodeInfo> infos;  // index = code_id - 1
  struct Signature {
    PyObject* filename;
    PyObject* qualname;
    int first_line;
  };
  std::deque<Signature> signatures;  // parallel to infos

  static Signature signature_of(PyCodeObject* code) {
    return Signature{code->co_filename, qualname_of(code), code->co_firstlineno};
  }
};

CodeRegistry::CodeRegistry() : impl_(new Impl) {}

CodeRegistry& CodeRegistry::instance() {
  static CodeRegistry* registry = new CodeRegistry();  // never destroyed: used until exit
  return *registry;
}

uint64_t CodeRegistry::find(PyObject* code, bool* is_copy) const {
  *is_copy = false;
  uint64_t id = impl_->strong.find(reinterpret_cast<uintptr_t>(code));
  if (id != 0) return id;
  id = impl_->copies.find(reinterpret_cast<uintptr_t>(code));
  if (id == 0) return 0;
  // A copy: make sure the address still holds the same code object.
  std::lock_guard<std::mutex> guard(impl_->mutex);
  const Impl::Signature& expected = impl_->signatures[id - 1];
  Impl::Signature actual = Impl::signature_of(reinterpret_cast<PyCodeObject*>(code));
  if (expected.filename == actual.filename && expected.qualname == actual.qualname &&
      expected.first_line == actual.first_line) {
    *is_copy = true;
    return id;
  }
  return 0;
}

uint64_t CodeRegistry::intern_with_gil(PyObject* object) {
  uint64_t existing = impl_->strong.find(reinterpret_cast<uintptr_t>(object));
  if (existing != 0) return existing;
  PyCodeObject* code = reinterpret_cast<PyCodeObject*>(object);
  CodeInfo info;
  Py_ssize_t size = 0;
  const char* filename = PyUnicode_AsUTF8AndSize(code->co_filename, &size);
  info.filename = filename ? std::string(filename, static_cast<size_t>(size)) : "<?>";
  const char* name = PyUnicode_AsUTF8AndSize(qualname_of(code), &size);
  info.qualname = name ? std::string(name, static_cast<size_t>(size)) : "<?>";
  if (PyErr_Occurred()) PyErr_Clear();
  info.first_line = code->co_firstlineno;
  Py_INCREF(object);
  info.code = object;
  uint64_t id;
  {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    id = impl_->infos.size() + 1;
    info.code_id = id;
    impl_->infos.push_back(std::move(info));
    impl_->signatures.push_back(Impl::signature_of(code));
  }
  impl_->strong.insert(reinterpret_cast<uintptr_t>(object), id);  // GIL-serialized writer
  return id;
}

uint64_t CodeRegistry::intern_copy_without_gil(PyObject* object) {
  PyCodeObject* code = reinterpret_cast<PyCodeObject*>(object);
  CodeInfo info;
  info.filename = copy_unicode_without_gil(code->co_filename);
  info.qualname = copy_unicode_without_gil(qualname_of(code));
  info.first_line = code->co_firstlineno;
  std::lock_guard<std::mutex> guard(impl_->mutex);
  uint64_t id = impl_->infos.size() + 1;
  info.code_id = id;
  impl_->infos.push_back(std::move(info));
  impl_->signatures.push_back(Impl::signature_of(code));
  impl_->copies.insert(reinterpret_cast<uintptr_t>(object), id);  // mutex-serialized writer
  return id;
}

bool CodeRegistry::info(uint64_t code_id, CodeInfo* out) const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  if (code_id == 0 || code_id > impl_->infos.size()) return false;
  *out = impl_->infos[code_id - 1];
  return true;
}

int CodeRegistry::line_for(uint64_t code_id, int32_t instr_offset) const {
  PyObject* code = nullptr;
  int first_line = -1;
  {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    if (code_id == 0 || code_id > impl_->infos.size()) return -1;
    code = impl_->infos[code_id - 1].code;
    first_line = impl_->infos[code_id - 1].first_line;
  }
  if (code == nullptr) return first_line;
  return PyCode_Addr2Line(reinterpret_cast<PyCodeObject*>(code), instr_offset);
}

size_t CodeRegistry::size() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  return impl_->infos.size();
}

void CodeRegistry::reset_after_fork() {
  // The mutex may have been held by a thread that does not exist in the child.
  new (&impl_->mutex) std::mutex();
}

// ---------------------------------------------------------------------------
// The walk

bool thread_holds_gil() {
  PyThreadState* current = current_thread_state_or_null();
#if PY_VERSION_HEX >= 0x030C0000
  return current != nullptr;
#else
  return current != nullptr && current == PyGILState_GetThisThreadState();
#endif
}

namespace {

// Lines of frames whose code object was only ever seen without the GIL (the outer frames of a call
// that released it, such as `loss.backward()` while autograd runs): their line is resolved at
// capture time, and PyCode_Addr2Line walks the line table linearly (~1 ns per byte, microseconds
// for a long function). Code ids are never reused, so a (code id, offset) pair keeps its line for
// good; each thread keeps its own cache and needs no lock.
class LineCache {
 public:
  int32_t line(uint64_t code_id, int32_t byte_offset, PyObject* code) {
    const uint64_t key = (code_id << 32) ^ static_cast<uint32_t>(byte_offset);
    Entry& entry = entries_[(key * 0x9E3779B97F4A7C15ULL) >> (64 - kBits)];
    if (entry.code_id == code_id && entry.byte_offset == byte_offset) return entry.line;
    const int32_t line = PyCode_Addr2Line(reinterpret_cast<PyCodeObject*>(code), byte_offset);
    entry = Entry{code_id, byte_offset, line};
    return line;
  }

  static LineCache& of_this_thread() {
    thread_local std::unique_ptr<LineCache> cache;  // 16 KiB, allocated on first use
    if (!cache) cache.reset(new LineCache());
    return *cache;
  }

 private:
  static constexpr int kBits = 10;
  struct Entry {
    uint64_t code_id = 0;  // 0: empty (ids start at 1)
    int32_t byte_offset = 0;
    int32_t line = 0;
  };
  Entry entries_[size_t{1} << kBits];
};

struct FrameSink {
  PythonFrame* out;
  size_t max;
  size_t count;
  bool holds_gil;
  bool truncated;
  CodeRegistry& registry;

  // Appends one frame; false once the output is full.
  bool emit(PyObject* code, int32_t byte_offset, uint32_t flags) {
    if (count == max) {
      truncated = true;
      return false;
    }
    bool is_copy = false;
    uint64_t id = registry.find(code, &is_copy);
    if (id == 0) {
      if (holds_gil) {
        id = registry.intern_with_gil(code);
      } else {
        id = registry.intern_copy_without_gil(code);
        is_copy = true;
      }
    }
    if (is_copy) {
      // No live code object will be around at flush time: resolve the line
      // now. PyCode_Addr2Line only reads the immutable line table.
      byte_offset = LineCache::of_this_thread().line(id, byte_offset, code);
      flags |= kPyFrameLineResolved;
    }
    out[count++] = PythonFrame{id, byte_offset, flags};
    return true;
  }
};

}  // namespace

#if PY_VERSION_HEX >= 0x030B0000
namespace {

// The thread's newest interpreter frame (3.12+: shim frames included).
_PyInterpreterFrame* newest_frame(PyThreadState* state) {
#if PY_VERSION_HEX >= 0x030D0000
  return state->current_frame;
#else
  return state->cframe != nullptr ? state->cframe->current_frame : nullptr;
#endif
}

// The code object a frame runs, or null (3.13: f_executable may be another callable).
PyObject* code_of(_PyInterpreterFrame* frame) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* code = frame->f_executable;
#else
  PyObject* code = reinterpret_cast<PyObject*>(frame->f_code);
#endif
  return is_code(code) ? code : nullptr;
}

}  // namespace
#endif

const void* innermost_python_frame() {
  PyThreadState* state = own_thread_state();
  if (state == nullptr) return nullptr;
#if PY_VERSION_HEX >= 0x030B0000
  for (_PyInterpreterFrame* frame = newest_frame(state); frame != nullptr; frame = frame->previous) {
#if PY_VERSION_HEX >= 0x030C0000
    if (frame->owner == FRAME_OWNED_BY_CSTACK) continue;
#endif
    if (code_of(frame) != nullptr) return frame;
  }
#else
  for (PyFrameObject* frame = state->frame; frame != nullptr; frame = frame->f_back) {
    if (is_code(reinterpret_cast<PyObject*>(frame->f_code))) return frame;
  }
#endif
  return nullptr;
}

namespace {

// One frame's share of a PythonStackKey: its code object (with its first line, against an address
// another code object took after the first died), instruction and entry flag. Read from the frame and
// the code object's header: the bytecode itself is not touched.
inline uint64_t key_step(uint64_t hash, PyObject* code, int32_t index, bool entry) {
  const PyCodeObject* object = reinterpret_cast<const PyCodeObject*>(code);
  const uint64_t word =
      reinterpret_cast<uintptr_t>(code) ^ (static_cast<uint64_t>(static_cast<uint32_t>(index)) << 40) ^
      (static_cast<uint64_t>(static_cast<uint32_t>(object->co_firstlineno)) << 20) ^ (entry ? 1u : 0u);
  return mix64(hash ^ word);
}

}  // namespace

PythonStackKey python_stack_key() {
  PythonStackKey key{nullptr, 0x6A09E667F3BCC909ULL};
  PyThreadState* state = own_thread_state();
  if (state == nullptr) return key;
  size_t frames = 0;
#if PY_VERSION_HEX >= 0x030B0000
  for (_PyInterpreterFrame* frame = newest_frame(state); frame != nullptr; frame = frame->previous) {
#if PY_VERSION_HEX >= 0x030C0000
    if (frame->owner == FRAME_OWNED_BY_CSTACK) continue;
#endif
    PyObject* code = code_of(frame);
    if (code == nullptr) continue;
    if (key.innermost == nullptr) key.innermost = frame;
    if (++frames > kMaxPythonFrames) break;  // as deep as a walk goes
#if PY_VERSION_HEX >= 0x030C0000
    const bool entry = frame->previous == nullptr || frame->previous->owner == FRAME_OWNED_BY_CSTACK;
#else
    const bool entry = frame->is_entry;
#endif
    key.hash = key_step(key.hash, code, _PyInterpreterFrame_LASTI(frame), entry);
  }
#else
  for (PyFrameObject* frame = state->frame; frame != nullptr; frame = frame->f_back) {
    PyObject* code = reinterpret_cast<PyObject*>(frame->f_code);
    if (!is_code(code)) continue;
    if (key.innermost == nullptr) key.innermost = frame;
    if (++frames > kMaxPythonFrames) break;
    key.hash = key_step(key.hash, code, frame->f_lasti, true);
  }
#endif
  key.hash = mix64(key.hash ^ frames);
  return key;
}

size_t walk_python_frames(PythonFrame* out, size_t max, bool* truncated) {
  return walk_python_frames_spliced(out, max, truncated, nullptr, nullptr);
}

size_t walk_python_frames_spliced(PythonFrame* out, size_t max, bool* truncated, const PythonSplice* splice,
                                  const void** first) {
  *truncated = false;
  if (first != nullptr) *first = nullptr;
  PyThreadState* state = own_thread_state();
  if (state == nullptr) return 0;
  FrameSink sink{out, max, 0, thread_holds_gil(), false, CodeRegistry::instance()};
  // The rest of the stack from a frame the earlier walk wrote first, as it wrote it.
  auto splice_at = [&](const void* frame) {
    if (splice == nullptr || frame != splice->top) return false;
    if (first != nullptr && sink.count == 0 && splice->count > 0) *first = splice->top;
    for (size_t i = 0; i < splice->count; ++i) {
      if (sink.count == sink.max) {
        sink.truncated = true;
        return true;
      }
      sink.out[sink.count++] = splice->frames[i];
    }
    sink.truncated = sink.truncated || splice->truncated;
    return true;
  };

#if PY_VERSION_HEX >= 0x030B0000
  for (_PyInterpreterFrame* frame = newest_frame(state); frame != nullptr; frame = frame->previous) {
#if PY_VERSION_HEX >= 0x030C0000
    // Shim frames owned by the C stack mark where an eval-loop call begins.
    if (frame->owner == FRAME_OWNED_BY_CSTACK) continue;
#endif
    if (splice_at(frame)) break;
    PyObject* code = code_of(frame);
    if (code == nullptr) continue;
    const int32_t byte_offset = static_cast<int32_t>(_PyInterpreterFrame_LASTI(frame) * sizeof(_Py_CODEUNIT));
#if PY_VERSION_HEX >= 0x030C0000
    const bool entry = frame->previous == nullptr || frame->previous->owner == FRAME_OWNED_BY_CSTACK;
#else
    const bool entry = frame->is_entry;
#endif
    // Incomplete frames (still in their prologue) are kept: their code object
    // is already set, and dropping an entry frame would misalign the groups
    // that eval-loop C frames stand for. Their offset maps to the first line.
    if (first != nullptr && sink.count == 0) *first = frame;
    if (!sink.emit(code, byte_offset < 0 ? -1 : byte_offset, entry ? static_cast<uint32_t>(kPyFrameEntry) : 0u)) break;
  }
#else
  // 3.10: every Python frame is its own C-level eval-loop call.
  for (PyFrameObject* frame = state->frame; frame != nullptr; frame = frame->f_back) {
    if (splice_at(frame)) break;
    PyObject* code = reinterpret_cast<PyObject*>(frame->f_code);
    if (!is_code(code)) continue;
    const int32_t byte_offset = frame->f_lasti < 0 ? -1 : static_cast<int32_t>(frame->f_lasti * sizeof(_Py_CODEUNIT));
    if (first != nullptr && sink.count == 0) *first = frame;
    if (!sink.emit(code, byte_offset, kPyFrameEntry)) break;
  }
#endif
  *truncated = sink.truncated;
  return sink.count;
}

}  // namespace tbpipe
