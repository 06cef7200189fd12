#include "recorder.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <memory>
#include <mutex>

#include "modules.h"
#include "python_frames.h"
#include "string_table.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TBPIPE_CPU_RELAX() _mm_pause()
#else
#define TBPIPE_CPU_RELAX() ((void)0)
#endif

namespace tbpipe {
namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Set of stack hashes already written in this session. Inserts are lock-free
// (CAS into an open-addressed table); growing takes a mutex and publishes a
// new table. An insert that races with a grow may miss and report a stack as
// new twice: harmless, the stack id is a content hash and ingest keeps one.
class SeenStacks {
 public:
  SeenStacks() { current_.store(make(1u << 16), std::memory_order_release); }

  bool insert(uint64_t hash) {
    Table* table = current_.load(std::memory_order_acquire);
    for (size_t probe = 0, i = hash & table->mask; probe <= table->mask;
         ++probe, i = (i + 1) & table->mask) {
      uint64_t seen = table->slots[i].load(std::memory_order_relaxed);
      if (seen == hash) return false;
      if (seen == 0) {
        uint64_t expected = 0;
        if (table->slots[i].compare_exchange_strong(expected, hash, std::memory_order_relaxed)) {
          size_t count = table->count.fetch_add(1, std::memory_order_relaxed) + 1;
          if (count * 2 > table->mask + 1) grow(table);
          return true;
        }
        if (expected == hash) return false;
      }
    }
    return true;  // full: treat as new rather than wait
  }

  void reset() {
    std::lock_guard<std::mutex> guard(mutex_);
    Table* old = current_.load(std::memory_order_relaxed);
    current_.store(make(1u << 16), std::memory_order_release);
    retired_.emplace_back(old);
  }

  void after_fork_in_child() { new (&mutex_) std::mutex(); }

 private:
  struct Table {
    size_t mask = 0;
    std::unique_ptr<std::atomic<uint64_t>[]> slots;
    std::atomic<size_t> count{0};
  };

  static Table* make(size_t capacity) {
    Table* table = new Table;
    table->mask = capacity - 1;
    table->slots.reset(new std::atomic<uint64_t>[capacity]);
    for (size_t i = 0; i < capacity; ++i) table->slots[i].store(0, std::memory_order_relaxed);
    return table;
  }

  void grow(Table* full) {
    std::unique_lock<std::mutex> guard(mutex_, std::try_to_lock);
    if (!guard.owns_lock() || current_.load(std::memory_order_relaxed) != full) return;
    Table* bigger = make((full->mask + 1) * 4);
    for (size_t i = 0; i <= full->mask; ++i) {
      uint64_t hash = full->slots[i].load(std::memory_order_relaxed);
      if (hash == 0) continue;
      for (size_t j = hash & bigger->mask;; j = (j + 1) & bigger->mask) {
        if (bigger->slots[j].load(std::memory_order_relaxed) == 0) {
          bigger->slots[j].store(hash, std::memory_order_relaxed);
          bigger->count.fetch_add(1, std::memory_order_relaxed);
          break;
        }
      }
    }
    current_.store(bigger, std::memory_order_release);
    retired_.emplace_back(full);  // readers may still probe it
  }

  std::atomic<Table*> current_{nullptr};
  std::mutex mutex_;
  std::vector<std::unique_ptr<Table>> retired_;
};

class SpinGuard {
 public:
  explicit SpinGuard(std::atomic_flag& flag) : flag_(flag) {
    while (flag_.test_and_set(std::memory_order_acquire)) TBPIPE_CPU_RELAX();
  }
  ~SpinGuard() { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag& flag_;
};

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

// What one thread has recorded since the last drain.
struct BufferData {
  std::vector<EventRecord> events;
  std::vector<PyObject*> attrs;
  std::vector<uint64_t> stack_ids;
  std::vector<uint32_t> stack_status;
  std::vector<uint32_t> native_ends, python_ends;
  std::vector<int32_t> native_module;
  std::vector<uint64_t> native_offset;
  std::vector<uint32_t> native_flags;
  std::vector<uint64_t> python_code;
  std::vector<int32_t> python_offset;
  std::vector<uint32_t> python_flags;

  void clear() {
    events.clear();
    attrs.clear();
    stack_ids.clear();
    stack_status.clear();
    native_ends.clear();
    python_ends.clear();
    native_module.clear();
    native_offset.clear();
    native_flags.clear();
    python_code.clear();
    python_offset.clear();
    python_flags.clear();
  }
};

struct Recorder::ThreadBuffer {
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  int64_t thread_id = 0;
  // Per-thread counters (written by the owner only): a shared atomic would
  // bounce one cache line between every recording thread.
  std::atomic<uint64_t> recorded{0};
  std::atomic<uint64_t> dropped{0};
  std::atomic<bool> exited{false};
  // The producer appends to `front`; a drain swaps it with `back` under the
  // spin flag (O(1)) and copies `back` out afterwards, so the producer never
  // waits for a copy and keeps reusing the vectors' capacity.
  BufferData front, back;
};

struct Recorder::Impl {
  std::mutex mutex;  // guards `buffers` and serializes drains
  std::vector<Recorder::ThreadBuffer*> buffers;
  uint64_t exited_recorded = 0;  // counters of buffers already freed
  uint64_t exited_dropped = 0;
  SeenStacks seen;
  std::atomic<uint64_t> fork_generation{0};
};

namespace {

struct ThreadSlot {
  Recorder::ThreadBuffer* buffer = nullptr;
  uint64_t generation = 0;
  std::atomic<uint64_t>* live_generation = nullptr;
  ~ThreadSlot();
};

}  // namespace

}  // namespace tbpipe

namespace tbpipe {
namespace {

thread_local ThreadSlot this_thread_slot;

ThreadSlot::~ThreadSlot() {
  if (buffer != nullptr && live_generation != nullptr &&
      live_generation->load(std::memory_order_relaxed) == generation) {
    buffer->exited.store(true, std::memory_order_release);
  }
  buffer = nullptr;
}

void child_after_fork() { Recorder::instance().after_fork_in_child(); }

}  // namespace

Recorder::Recorder() : impl_(new Impl) { pthread_atfork(nullptr, nullptr, child_after_fork); }

Recorder& Recorder::instance() {
  static Recorder* recorder = new Recorder();  // never destroyed: threads may record until exit
  return *recorder;
}

Recorder::ThreadBuffer* Recorder::this_thread_buffer() {
  ThreadSlot& slot = this_thread_slot;
  const uint64_t generation = impl_->fork_generation.load(std::memory_order_relaxed);
  if (slot.buffer != nullptr && slot.generation == generation) return slot.buffer;
  // First event of this thread (or first since a fork): register a buffer.
  auto* buffer = new ThreadBuffer();
  buffer->thread_id = static_cast<int64_t>(syscall(SYS_gettid));
  {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    impl_->buffers.push_back(buffer);
  }
  slot.buffer = buffer;
  slot.generation = generation;
  slot.live_generation = &impl_->fork_generation;
  return buffer;
}

bool Recorder::insert_seen(uint64_t stack_id) { return impl_->seen.insert(stack_id); }

void Recorder::start(bool python, bool native, uint64_t max_buffered_events) {
  Drained discarded;
  drain(&discarded);
  for (PyObject* attrs : discarded.attrs) Py_XDECREF(attrs);
  impl_->seen.reset();
  want_python_ = python;
  want_native_ = native;
  max_buffered_events_ = max_buffered_events;
  {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    impl_->exited_recorded = impl_->exited_dropped = 0;
    for (ThreadBuffer* buffer : impl_->buffers) {
      buffer->recorded.store(0, std::memory_order_relaxed);
      buffer->dropped.store(0, std::memory_order_relaxed);
    }
  }
  stacks_.store(0);
  active_.store(true, std::memory_order_release);
}

void Recorder::stop() { active_.store(false, std::memory_order_release); }

bool Recorder::record(uint32_t kind_id, uint32_t name_id, PyObject* attrs,
                      const UnwindOptions& options) {
  ThreadBuffer* buffer = this_thread_buffer();
  RawStack& stack = thread_scratch_stack();
  uint64_t stack_id = 0;
  if (want_python_ || want_native_) {
    gather_stack(&stack, want_python_, want_native_, options);
    stack_id = hash_stack(stack);
  }
  const bool new_stack = stack_id != 0 && insert_seen(stack_id);
  const int64_t ts = now_ns();

  SpinGuard guard(buffer->busy);
  BufferData& data = buffer->front;
  if (data.events.size() >= max_buffered_events_) {
    // The flusher is not keeping up: drop rather than grow without bound.
    buffer->dropped.store(buffer->dropped.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    Py_XDECREF(attrs);
    return false;
  }
  if (new_stack) {
    stacks_.fetch_add(1, std::memory_order_relaxed);
    data.stack_ids.push_back(stack_id);
    data.stack_status.push_back(stack.status);
    const ModuleRegistry& modules = ModuleRegistry::instance();
    for (size_t i = 0; i < stack.native_count; ++i) {
      const NativeFrame& frame = stack.native[i];
      const Module* module = frame.module >= 0 ? modules.module(frame.module) : nullptr;
      data.native_module.push_back(module ? frame.module : -1);
      data.native_offset.push_back(module ? frame.pc - module->load_bias : frame.pc);
      data.native_flags.push_back(frame.flags);
    }
    data.native_ends.push_back(static_cast<uint32_t>(data.native_module.size()));
    for (size_t i = 0; i < stack.python_count; ++i) {
      const PythonFrame& frame = stack.python[i];
      data.python_code.push_back(frame.code_id);
      data.python_offset.push_back(frame.instr_offset);
      data.python_flags.push_back(frame.flags);
    }
    data.python_ends.push_back(static_cast<uint32_t>(data.python_code.size()));
  }
  int32_t attrs_index = -1;
  if (attrs != nullptr) {
    attrs_index = static_cast<int32_t>(data.attrs.size());
    data.attrs.push_back(attrs);
  }
  data.events.push_back(EventRecord{ts, stack_id, kind_id, name_id, attrs_index, 0});
  buffer->recorded.store(buffer->recorded.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  return true;
}

void Recorder::drain(Drained* out) {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  std::vector<ThreadBuffer*> keep;
  keep.reserve(impl_->buffers.size());
  for (ThreadBuffer* buffer : impl_->buffers) {
    // Read `exited` before swapping: a thread that has exited adds nothing after.
    const bool exited = buffer->exited.load(std::memory_order_acquire);
    {
      SpinGuard spin(buffer->busy);
      std::swap(buffer->front, buffer->back);
    }
    BufferData& data = buffer->back;
    const int32_t attrs_base = static_cast<int32_t>(out->attrs.size());
    for (const EventRecord& event : data.events) {
      out->ts_ns.push_back(event.ts_ns);
      out->thread_id.push_back(buffer->thread_id);
      out->stack_id.push_back(event.stack_id);
      out->kind_id.push_back(event.kind_id);
      out->name_id.push_back(event.name_id);
      out->attrs_index.push_back(event.attrs_index < 0 ? -1 : attrs_base + event.attrs_index);
    }
    append(out->attrs, data.attrs);
    const uint32_t native_base = static_cast<uint32_t>(out->native_module.size());
    const uint32_t python_base = static_cast<uint32_t>(out->python_code.size());
    append(out->stack_ids, data.stack_ids);
    append(out->stack_status, data.stack_status);
    out->stack_thread.insert(out->stack_thread.end(), data.stack_ids.size(), buffer->thread_id);
    for (uint32_t end : data.native_ends) out->native_ends.push_back(native_base + end);
    for (uint32_t end : data.python_ends) out->python_ends.push_back(python_base + end);
    append(out->native_module, data.native_module);
    append(out->native_offset, data.native_offset);
    append(out->native_flags, data.native_flags);
    append(out->python_code, data.python_code);
    append(out->python_offset, data.python_offset);
    append(out->python_flags, data.python_flags);
    data.clear();
    if (exited) {
      impl_->exited_recorded += buffer->recorded.load(std::memory_order_relaxed);
      impl_->exited_dropped += buffer->dropped.load(std::memory_order_relaxed);
      delete buffer;
    } else {
      keep.push_back(buffer);
    }
  }
  impl_->buffers.swap(keep);
  out->dropped = impl_->exited_dropped;
  for (ThreadBuffer* buffer : impl_->buffers) out->dropped += buffer->dropped.load(std::memory_order_relaxed);
}

RecorderCounters Recorder::counters() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  RecorderCounters counters;
  counters.recorded = impl_->exited_recorded;
  counters.dropped = impl_->exited_dropped;
  for (ThreadBuffer* buffer : impl_->buffers) {
    counters.recorded += buffer->recorded.load(std::memory_order_relaxed);
    counters.dropped += buffer->dropped.load(std::memory_order_relaxed);
  }
  counters.stacks = stacks_.load(std::memory_order_relaxed);
  return counters;
}

void Recorder::after_fork_in_child() {
  // Only the forking thread exists now. Locks held by vanished threads are
  // remade and their buffers abandoned (leaked, never touched again): the
  // parent flushes those events, the child must not write them twice.
  active_.store(false, std::memory_order_relaxed);
  new (&impl_->mutex) std::mutex();
  impl_->buffers.clear();
  impl_->fork_generation.fetch_add(1, std::memory_order_relaxed);
  impl_->seen.after_fork_in_child();
  CodeRegistry::instance().reset_after_fork();
  StringTable::instance().reset_after_fork();
}

}  // namespace tbpipe
