#include "recorder.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include "hash_mix.h"
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

// Millisecond clock for the per-stack windows: the coarse clock costs a few
// nanoseconds (no syscall, no TSC read) and a window is a whole second.
uint32_t coarse_now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<uint32_t>(static_cast<uint64_t>(ts.tv_sec) * 1000u + ts.tv_nsec / 1000000);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Key of the per-stack limit: the Python frames alone when there are any.
// One Python call path reaches the same event through different native PCs
// (CPython's specialized and generic bytecode paths), which would otherwise
// each get their own budget.
uint64_t limit_key(const RawStack& stack, uint64_t stack_id) {
  if (stack.python_count == 0) return stack_id;
  uint64_t key = 0x243F6A8885A308D3ULL;
  for (size_t i = 0; i < stack.python_count; ++i) {
    const PythonFrame& frame = stack.python[i];
    const uint64_t offset = static_cast<uint32_t>(frame.instr_offset);
    key = splitmix64(key ^ frame.code_id ^ (offset << 32));
  }
  return key | 1;
}

// One thread's count of events per stack in the current one-second window.
// Two-way set associative and fixed in size: a stack evicted by a collision
// starts a fresh window, so the limit can be exceeded a little, never missed
// by much, and the table never allocates on the hot path after its creation.
class StackWindows {
 public:
  static constexpr size_t kSlots = 2048;

  bool admit(uint64_t stack_id, uint32_t limit, uint32_t now_ms) {
    Slot* pair = &slots_[(splitmix64(stack_id) & (kSlots - 1)) & ~size_t{1}];
    Slot* slot = pair[0].stack_id == stack_id ? &pair[0] : pair[1].stack_id == stack_id ? &pair[1] : nullptr;
    if (slot == nullptr) {
      slot = pair[0].window_ms <= pair[1].window_ms ? &pair[0] : &pair[1];  // evict the older window
      *slot = Slot{stack_id, now_ms, 0};
    } else if (now_ms - slot->window_ms >= 1000) {
      slot->window_ms = now_ms;
      slot->count = 0;
    }
    if (slot->count >= limit) return false;
    ++slot->count;
    return true;
  }

 private:
  struct Slot {
    uint64_t stack_id = 0;
    uint32_t window_ms = 0;
    uint32_t count = 0;
  };
  Slot slots_[kSlots];
};

// Set of stack hashes already written in this session. Inserts are lock-free
// (CAS into an open-addressed table); growing takes a mutex and publishes a
// new table. An insert that races with a grow may miss and report a stack as
// new twice: harmless, the stack id is a content hash and ingest keeps one.
class SeenStacks {
 public:
  SeenStacks() { current_.store(make(1u << 16), std::memory_order_release); }

  bool insert(uint64_t hash) {
    Table* table = current_.load(std::memory_order_acquire);
    for (size_t probe = 0, i = hash & table->mask; probe <= table->mask; ++probe, i = (i + 1) & table->mask) {
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

// Room for `size` elements, growing geometrically (drains append one thread's buffer at a time).
template <typename T>
void grow_to(std::vector<T>& values, size_t size) {
  if (values.capacity() < size) values.reserve(std::max(size, values.capacity() * 2));
}

}  // namespace

// What one thread has recorded since the last drain.
struct BufferData {
  std::vector<EventRecord> events;
  // Attributes: a Python dict (record() from Python, GIL held) or JSON text
  // in `attr_text` (native sources, which may not hold the GIL).
  struct Attr {
    PyObject* object;
    uint32_t text_begin, text_end;
  };
  std::vector<Attr> attrs;
  std::string attr_text;
  // Op attributes (record_native_op), with the index of their event in `events`.
  struct Op {
    TbpipeOpAttrs attrs;
    uint32_t event;
  };
  std::vector<Op> ops;
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
    attr_text.clear();
    ops.clear();
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

// The scopes open on one thread (record_native_scoped): for each, the stack its event gathered,
// kept where it was gathered (one slot per nesting level, reused), for the events inside it.
class OpenScopes {
 public:
  static constexpr size_t kMaxDepth = 64;  // deeper scopes are recorded without a slot

  struct Level {
    const void* scope = nullptr;
    bool has_stack = false;  // `stack` holds the event's frames (false: sampled out, reused, past the depth cap)
    bool has_id = false;     // `stack_id` is the event's stack (gathered or reused), its scope on this stack
    const void* python_top = nullptr;
    uint64_t stack_id = 0;   // with has_id: the stack's hash
    uint64_t limit_key = 0;  // with has_id, while a per-stack limit applies: the stack's limit_key()
    uint32_t name_id = 0;    // its event's name
    uint32_t children = 0;   // scopes opened directly inside this one so far
    uint32_t place = 0;      // this scope's place among its parent's children (0 at the outermost)
    std::unique_ptr<RawStack> stack;
    std::unique_ptr<NativeFrameState[]> states;
  };

  // The slot for a new scope, pushed; null past the depth cap (the scope is then not tracked).
  Level* open(const void* scope) {
    if (depth_ == kMaxDepth) return nullptr;
    const uint32_t place = depth_ > 0 ? levels_[depth_ - 1].children++ : 0;
    if (levels_.size() == depth_) levels_.emplace_back();
    Level& level = levels_[depth_++];
    if (!level.stack) {
      level.stack.reset(new RawStack());
      level.states.reset(new NativeFrameState[kMaxNativeFrames]);
    }
    level.scope = scope;
    level.has_stack = false;
    level.has_id = false;
    level.python_top = nullptr;
    level.children = 0;
    level.place = place;
    return &level;
  }

  // The innermost open scope below `level` whose stack id is known and whose scope encloses
  // `scope` on the C stack (deeper frames lie at lower addresses), or null.
  const Level* parent_with_id(const Level* level, const void* scope) const {
    for (size_t i = static_cast<size_t>(level - levels_.data()); i > 0; --i) {
      const Level& parent = levels_[i - 1];
      if (parent.has_id) return parent.scope > scope ? &parent : nullptr;
    }
    return nullptr;
  }

  // The innermost open scope below `level` whose stack a gather can splice onto, or null.
  const Level* source_below(const Level* level) const {
    for (size_t i = static_cast<size_t>(level - levels_.data()); i > 0; --i) {
      if (levels_[i - 1].has_stack) return &levels_[i - 1];
    }
    return nullptr;
  }

  // The innermost open scope whose stack id is known, or null.
  const Level* innermost_with_id() const {
    for (size_t i = depth_; i > 0; --i) {
      if (levels_[i - 1].has_id) return &levels_[i - 1];
    }
    return nullptr;
  }

  void close(const void* scope) {
    for (size_t i = depth_; i > 0; --i) {
      if (levels_[i - 1].scope == scope) {
        depth_ = i - 1;
        return;
      }
    }
  }

 private:
  std::vector<Level> levels_;
  size_t depth_ = 0;
};

// The stacks this thread's scoped events gathered, by the place that decided them (see
// set_stack_reuse), allocated on the thread's first scoped event and fixed in size. Entries lie in
// the order their places were first seen, and each lookup tries the entry after the one found last
// before the index: a training step meets its ops in the same order every time, so the next entry is
// usually the one wanted, in a cache line the previous lookup brought in. Entries count only in the
// generation they were made in (a new session, other stack parts, a change of modules); a full table
// starts afresh.
class ReusedStacks {
 public:
  static constexpr size_t kSlots = 32;  // a candidate's innermost frames compared

  struct Entry {
    uint64_t key;
    uint64_t stack_id;
    uint64_t limit_key;     // with `limited`
    uint8_t limited;        // limit_key was computed (a per-stack limit applied when it was made)
    uint8_t ambiguous;      // a check found another stack at this place: its candidates decide
    uint16_t first_checks;  // reuses left that are checked before reuses are checked at random
    uint32_t candidates;    // with `ambiguous`: its group of candidates + 1 (0: none left to give it)
  };

  // A stack of an ambiguous place with the words its innermost frames' return addresses were read
  // from, by their slots' offsets from the event's scope: an event at this place whose slots hold
  // the same words took the same path (the return addresses are the native frames' PCs), and takes
  // this stack. Slots are read only in the live part of the thread's stack (above the reader's frame).
  struct Candidate {
    uint64_t stack_id;
    uint64_t limit_key;
    uint8_t limited;
    uint8_t slots;  // 0: an unused candidate
    struct Slot {
      int64_t offset;  // from the scope
      uintptr_t word;
    } slot[kSlots];
  };

  // The candidate of an ambiguous place whose slots hold their words now, or null.
  Candidate* matching(const Entry& entry, uintptr_t scope, uintptr_t live_lo, uintptr_t live_hi) {
    if (entry.candidates == 0) return nullptr;
    Group& group = groups_[entry.candidates - 1];
    for (Candidate& candidate : group.candidates) {
      if (candidate.slots == 0) continue;
      size_t i = 0;
      for (; i < candidate.slots; ++i) {
        const uintptr_t slot = scope + static_cast<uintptr_t>(candidate.slot[i].offset);
        if (slot < live_lo || slot + sizeof(uintptr_t) > live_hi ||
            *reinterpret_cast<const uintptr_t*>(slot) != candidate.slot[i].word) {
          break;
        }
      }
      if (i == candidate.slots) return &candidate;
    }
    return nullptr;
  }

  // Adds a stack just gathered at an ambiguous place (its frames' walk states in `states`) as a
  // candidate, replacing the oldest when the place has as many as it keeps; nothing when the stack
  // has no native frame read from a slot (a Python-only stack needs none), or no group is left.
  void add_candidate(Entry& entry, uint64_t stack_id, uint64_t limit_key, bool limited, const RawStack& stack,
                     const NativeFrameState* states, uintptr_t scope, uintptr_t live_lo, uintptr_t live_hi) {
    if (entry.candidates == 0) {
      if (!groups_) groups_.reset(new Group[kGroups]());
      if (groups_used_ == kGroups) return;
      entry.candidates = ++groups_used_;
      groups_[entry.candidates - 1] = Group{};
    }
    Candidate candidate{stack_id, limit_key, static_cast<uint8_t>(limited), 0, {}};
    for (size_t k = 0; k < stack.native_count && candidate.slots < kSlots; ++k) {
      const NativeFrame& frame = stack.native[k];
      if (frame.flags & kFrameMarker) break;
      if (frame.flags & kFrameExactPc) return;                  // a signal frame's PC lies in no slot
      const uintptr_t slot = states[k].sp - sizeof(uintptr_t);  // where the walk read it from
      if (slot < live_lo || slot + sizeof(uintptr_t) > live_hi || (slot & (sizeof(uintptr_t) - 1))) return;
      const uintptr_t word = *reinterpret_cast<const uintptr_t*>(slot);
#if defined(__x86_64__)
      if (word != frame.pc) return;  // a return address read from elsewhere (an unusual CFI rule)
#endif
      candidate.slot[candidate.slots++] = Candidate::Slot{static_cast<int64_t>(slot - scope), word};
    }
    if (candidate.slots == 0) return;
    Group& group = groups_[entry.candidates - 1];
    group.candidates[group.next] = candidate;
    group.next = static_cast<uint8_t>((group.next + 1) % kCandidates);
  }

  // Forgets a candidate a check found to hold another stack (its slots did not tell them apart).
  static void drop(Candidate* candidate) { candidate->slots = 0; }

  // The entry for `key` in this generation, or null.
  Entry* find(uint64_t key, uint32_t generation) {
    if (generation != generation_) {
      clear();
      generation_ = generation;
      return nullptr;
    }
    const uint32_t next = last_ + 1;
    if (next < size_ && entries_[next].key == key) {
      last_ = next;
      return &entries_[next];
    }
    for (uint32_t slot = slot_of(key);; slot = (slot + 1) & (kIndexSize - 1)) {
      const uint32_t index = index_[slot];
      if (index == 0) return nullptr;
      if (entries_[index - 1].key == key) {
        last_ = index - 1;
        return &entries_[index - 1];
      }
    }
  }

  // Whether a place that find() did not know is to be remembered now: from its second time on.
  // Below a sample rate of 1 most places (an op under each of the enclosing ops drawn with it) come
  // once in many steps; remembered at once they would fill the table, which then starts afresh and
  // walks again where the common places were. A bit per place hash says it came before; the bits
  // start afresh once half of them were set.
  bool admit(uint64_t key) {
    uint64_t& word = seen_once_[(key >> 6) & (kSeenWords - 1)];
    const uint64_t bit = uint64_t{1} << (key & 63);
    if (word & bit) return true;
    word |= bit;
    if (++seen_once_count_ > kSeenWords * 32) {
      std::fill(seen_once_, seen_once_ + kSeenWords, uint64_t{0});
      seen_once_count_ = 0;
    }
    return false;
  }

  // Remembers a place first seen (find() returned null for it in this generation).
  void put(uint64_t key, uint64_t stack_id, uint64_t limit_key, bool limited) {
    if (size_ == kCapacity) clear();
    uint32_t slot = slot_of(key);
    while (index_[slot] != 0) slot = (slot + 1) & (kIndexSize - 1);
    entries_[size_] = Entry{key, stack_id, limit_key, static_cast<uint8_t>(limited), 0, kFirstChecks, 0};
    index_[slot] = ++size_;
    last_ = size_ - 1;
  }

 private:
  // A place's first reuse is checked: where an op's code takes another path by its inputs' shapes (a
  // place holding two stacks), it mostly shows then.
  static constexpr uint16_t kFirstChecks = 1;
  static constexpr uint32_t kCapacity = 8192;       // places (256 KiB)
  static constexpr uint32_t kIndexSize = 2 * 8192;  // slots: entry index + 1, 0 when free (64 KiB)
  static constexpr size_t kSeenWords = 1024;        // admit()'s bits (8 KiB)
  // Ambiguous places: each keeps up to kCandidates stacks (a group, 4 KiB); groups for kGroups
  // places are allocated when the first place turns out ambiguous.
  static constexpr size_t kCandidates = 8;
  static constexpr uint32_t kGroups = 128;

  struct Group {
    Candidate candidates[kCandidates];
    uint8_t next;  // the candidate to replace next
  };

  static uint32_t slot_of(uint64_t key) { return static_cast<uint32_t>(key >> 32) & (kIndexSize - 1); }
  void clear() {
    std::fill(index_, index_ + kIndexSize, 0u);
    size_ = 0;
    last_ = 0;
    groups_used_ = 0;
  }

  uint32_t generation_ = 0;
  uint32_t size_ = 0;
  uint32_t last_ = 0;  // the entry found or added last
  uint32_t groups_used_ = 0;
  uint32_t index_[kIndexSize] = {};
  uint64_t seen_once_[kSeenWords] = {};
  size_t seen_once_count_ = 0;
  Entry entries_[kCapacity];
  std::unique_ptr<Group[]> groups_;
};

struct Recorder::ThreadBuffer {
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  int64_t thread_id = 0;
  uintptr_t stack_lo = 0, stack_hi = 0;  // the thread's stack (this_thread_stack), kept here: no TLS per event
  // Per-thread counters (written by the owner only): a shared atomic would
  // bounce one cache line between every recording thread.
  std::atomic<uint64_t> recorded{0};
  std::atomic<uint64_t> dropped{0};
  std::atomic<uint64_t> sampled_out{0};
  std::atomic<uint64_t> rate_limited{0};
  std::atomic<uint64_t> stacks_reused{0};
  std::atomic<uint64_t> reuse_checked{0};
  std::atomic<uint64_t> reuse_mismatched{0};
  std::atomic<bool> exited{false};
  // Overhead limits, touched by the owner thread only.
  uint64_t random_state = 0;
  uint32_t windows_generation = 0;
  std::unique_ptr<StackWindows> windows;  // created on the first limited event
  OpenScopes scopes;                      // owner thread only
  std::unique_ptr<ReusedStacks> reused;   // owner thread only; created on the first scoped event
  uint32_t reuses_until_check = 1;        // owner thread only: reuses left before the next check
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
  uint64_t exited_sampled_out = 0;
  uint64_t exited_rate_limited = 0;
  uint64_t exited_stacks_reused = 0;
  uint64_t exited_reuse_checked = 0;
  uint64_t exited_reuse_mismatched = 0;
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
// The same buffer and generation for the hot path, as initial-exec thread-locals (a load off %fs):
// in a library loaded with dlopen, this_thread_slot (a thread_local with a destructor) costs a
// __tls_get_addr call or two at every access. Set beside the slot, cleared by its destructor.
thread_local Recorder::ThreadBuffer* t_buffer __attribute__((tls_model("initial-exec"))) = nullptr;
thread_local uint64_t t_buffer_generation __attribute__((tls_model("initial-exec"))) = 0;

ThreadSlot::~ThreadSlot() {
  if (buffer != nullptr && live_generation != nullptr &&
      live_generation->load(std::memory_order_relaxed) == generation) {
    buffer->exited.store(true, std::memory_order_release);
  }
  buffer = nullptr;
  t_buffer = nullptr;
}

void child_after_fork() { Recorder::instance().after_fork_in_child(); }

}  // namespace

Recorder::Recorder() : impl_(new Impl) { pthread_atfork(nullptr, nullptr, child_after_fork); }

Recorder& Recorder::instance() {
  static Recorder* recorder = new Recorder();  // never destroyed: threads may record until exit
  return *recorder;
}

Recorder::ThreadBuffer* Recorder::this_thread_buffer() {
  const uint64_t generation = impl_->fork_generation.load(std::memory_order_relaxed);
  if (t_buffer != nullptr && t_buffer_generation == generation) return t_buffer;
  ThreadSlot& slot = this_thread_slot;
  // First event of this thread (or first since a fork): register a buffer.
  auto* buffer = new ThreadBuffer();
  buffer->thread_id = static_cast<int64_t>(syscall(SYS_gettid));
  this_thread_stack(&buffer->stack_lo, &buffer->stack_hi);
  buffer->random_state = splitmix64(static_cast<uint64_t>(buffer->thread_id) ^ static_cast<uint64_t>(now_ns()) ^
                                    reinterpret_cast<uintptr_t>(buffer)) |
                         1;  // xorshift never leaves 0
  {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    impl_->buffers.push_back(buffer);
  }
  slot.buffer = buffer;
  slot.generation = generation;
  slot.live_generation = &impl_->fork_generation;
  t_buffer = buffer;
  t_buffer_generation = generation;
  return buffer;
}

bool Recorder::insert_seen(uint64_t stack_id) { return impl_->seen.insert(stack_id); }

void Recorder::start(bool python, bool native, uint64_t max_buffered_events) {
  Drained discarded;
  drain(&discarded);
  for (const auto& [event, attrs] : discarded.attr_objects) Py_XDECREF(attrs);
  impl_->seen.reset();
  set_stack_parts(python, native);
  max_buffered_events_ = max_buffered_events;
  {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    impl_->exited_recorded = impl_->exited_dropped = 0;
    impl_->exited_sampled_out = impl_->exited_rate_limited = 0;
    impl_->exited_stacks_reused = impl_->exited_reuse_checked = impl_->exited_reuse_mismatched = 0;
    for (ThreadBuffer* buffer : impl_->buffers) {
      buffer->recorded.store(0, std::memory_order_relaxed);
      buffer->dropped.store(0, std::memory_order_relaxed);
      buffer->sampled_out.store(0, std::memory_order_relaxed);
      buffer->rate_limited.store(0, std::memory_order_relaxed);
      buffer->stacks_reused.store(0, std::memory_order_relaxed);
      buffer->reuse_checked.store(0, std::memory_order_relaxed);
      buffer->reuse_mismatched.store(0, std::memory_order_relaxed);
    }
  }
  reuse_generation_.fetch_add(1, std::memory_order_relaxed);   // the seen set is new: so are the reusable stacks
  limits_generation_.fetch_add(1, std::memory_order_relaxed);  // every stack starts a fresh window
  stacks_.store(0);
  active_.store(true, std::memory_order_release);
}

void Recorder::stop() { active_.store(false, std::memory_order_release); }

void Recorder::set_stack_parts(bool python, bool native) {
  const bool changed = want_python_.exchange(python, std::memory_order_relaxed) != python;
  if (want_native_.exchange(native, std::memory_order_relaxed) != native || changed) {
    // Stacks kept for reuse have the other parts: forget them. The same parts again keep them (a
    // thread's table is refilled at a gather per op it meets, and checked once per place).
    reuse_generation_.fetch_add(1, std::memory_order_relaxed);
  }
}

void Recorder::set_stack_reuse(bool enabled, uint32_t check_every) {
  reuse_check_every_.store(check_every > 0 ? check_every : 1, std::memory_order_relaxed);
  reuse_.store(enabled, std::memory_order_relaxed);
}

void Recorder::set_overhead_limits(const OverheadLimits& limits) {
  uint64_t threshold = UINT64_MAX;
  if (limits.sample_rate < 1.0) {
    const double rate = limits.sample_rate > 0.0 ? limits.sample_rate : 0.0;
    threshold = static_cast<uint64_t>(rate * 18446744073709551616.0);  // rate * 2^64
  }
  sample_threshold_.store(threshold, std::memory_order_relaxed);
  max_per_stack_per_s_.store(limits.max_per_stack_per_s, std::memory_order_relaxed);
  limits_generation_.fetch_add(1, std::memory_order_relaxed);
}

double Recorder::sample_rate() const {
  const uint64_t threshold = sample_threshold_.load(std::memory_order_relaxed);
  return threshold == UINT64_MAX ? 1.0 : static_cast<double>(threshold) / 18446744073709551616.0;
}

bool Recorder::record(uint32_t kind_id, uint32_t name_id, PyObject* attrs, const UnwindOptions& options) {
  return record_event(kind_id, name_id, attrs, nullptr, 0, options, nullptr, 0);
}

bool Recorder::record_native(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_json_size,
                             const UnwindOptions& options, uint32_t correlation_id) {
  return record_event(kind_id, name_id, nullptr, attrs_json, attrs_json_size, options, nullptr, 0, correlation_id);
}

bool Recorder::record_native_scoped(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_json_size,
                                    const UnwindOptions& options, const void* scope, uint32_t flags) {
  return record_event(kind_id, name_id, nullptr, attrs_json, attrs_json_size, options, scope, flags);
}

bool Recorder::record_native_op(uint32_t kind_id, uint32_t name_id, const TbpipeOpAttrs& op,
                                const UnwindOptions& options, const void* scope, uint32_t flags) {
  return record_event(kind_id, name_id, nullptr, nullptr, 0, options, scope, flags, 0, &op);
}

void Recorder::end_scope(const void* scope) {
  // A thread that never recorded (or only before a fork) has nothing open.
  if (t_buffer == nullptr || t_buffer_generation != impl_->fork_generation.load(std::memory_order_relaxed)) return;
  t_buffer->scopes.close(scope);
}

uint64_t Recorder::next_random(ThreadBuffer* buffer) {
  // xorshift64*: a few cycles, and per thread, so no shared state.
  uint64_t x = buffer->random_state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  buffer->random_state = x;
  return x * 0x2545F4914F6CDD1DULL;
}

bool Recorder::sample(ThreadBuffer* buffer) {
  const uint64_t threshold = sample_threshold_.load(std::memory_order_relaxed);
  if (threshold == UINT64_MAX) return true;
  if (next_random(buffer) < threshold) return true;
  buffer->sampled_out.store(buffer->sampled_out.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  return false;
}

bool Recorder::sample_next() { return sample(this_thread_buffer()); }

namespace {

// Whether `address` lies on the stack of the thread that owns `buffer` (address_on_this_stack, from
// the bounds the buffer keeps).
inline bool on_stack(const Recorder::ThreadBuffer& buffer, const void* address) {
  const uintptr_t value = reinterpret_cast<uintptr_t>(address);
  return value >= buffer.stack_lo && value < buffer.stack_hi;
}

// Bump a per-thread counter that only its owner writes.
inline void count(std::atomic<uint64_t>& counter) {
  counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

// The place of a scoped event (`level` just opened) whose stack may be reused: see set_stack_reuse.
// `ordered`: whether the scope's place among those opened in its parent so far counts (see
// record_event); without it, two calls of one op from one scope at the same depth share a place,
// which a check finds ambiguous and its candidates' return addresses then tell apart.
uint64_t reuse_place(const OpenScopes::Level& level, uint32_t kind_id, uint32_t name_id,
                     const OpenScopes::Level* parent, bool ordered, const void** python_top) {
  uint64_t key = mix64((static_cast<uint64_t>(kind_id) << 32) | name_id);
  const uintptr_t scope = reinterpret_cast<uintptr_t>(level.scope);
  if (parent != nullptr) {
    // Inside an open scope: its stack and name (ops of other names may share a stack: autograd
    // calls every backward node from one place), how much deeper this scope lies and its place
    // among the scopes opened in it decide the frames in between; the Python frames are the
    // parent's while its innermost one still runs the call it ran then.
    key = mix64(key ^ parent->stack_id ^ (static_cast<uint64_t>(parent->name_id) << 32));
    const uint64_t place = ordered ? level.place : 0;
    key = mix64(key ^ (reinterpret_cast<uintptr_t>(parent->scope) - scope) ^ (place << 48));
    *python_top = innermost_python_frame();
    if (*python_top == parent->python_top) return key | 1;
  } else {
    key = mix64(key ^ scope);
  }
  const PythonStackKey python = python_stack_key();
  *python_top = python.innermost;
  return mix64(key ^ python.hash) | 1;
}

// A stack to write: its frames as the buffer's columns keep them (module index and offset from the
// module's load bias per native frame). Off the hot path, which reuses stacks written before.
__attribute__((noinline)) void append_stack(BufferData* data, const RawStack& stack, uint64_t stack_id) {
  data->stack_ids.push_back(stack_id);
  data->stack_status.push_back(stack.status);
  const ModuleRegistry& modules = ModuleRegistry::instance();
  for (size_t i = 0; i < stack.native_count; ++i) {
    const NativeFrame& frame = stack.native[i];
    const Module* module = frame.module >= 0 ? modules.module(frame.module) : nullptr;
    data->native_module.push_back(module ? frame.module : -1);
    data->native_offset.push_back(module ? frame.pc - module->load_bias : frame.pc);
    data->native_flags.push_back(frame.flags);
  }
  data->native_ends.push_back(static_cast<uint32_t>(data->native_module.size()));
  for (size_t i = 0; i < stack.python_count; ++i) {
    const PythonFrame& frame = stack.python[i];
    data->python_code.push_back(frame.code_id);
    data->python_offset.push_back(frame.instr_offset);
    data->python_flags.push_back(frame.flags);
  }
  data->python_ends.push_back(static_cast<uint32_t>(data->python_code.size()));
}

// What gather_event_stack needs to know of the event and the session.
struct GatherRequest {
  bool python, native, splicing;
  bool scope_on_stack;  // the event's scope lies on this thread's stack (its level says which frames stay)
  bool limited;         // a per-stack limit applies: the stack's limit_key is wanted
  bool checking;        // a reuse gathered anyway: compare with the entry's (or candidate's) stack
  const void* python_top;
  uintptr_t scope;
  uintptr_t live_lo;
};

struct GatheredStack {
  uint64_t stack_id;
  const RawStack* frames;
  uint64_t limit;
  bool limited;
};

// The event's stack gathered (spliced onto the enclosing scope's where there is one), with what the
// reuse of stacks learns from it: a check's outcome, a candidate of an ambiguous place. Off the hot
// path: most events reuse a stack.
__attribute__((noinline)) GatheredStack gather_event_stack(Recorder::ThreadBuffer* buffer, OpenScopes::Level* level,
                                                           const GatherRequest& request, const UnwindOptions& options,
                                                           ReusedStacks::Entry* entry,
                                                           ReusedStacks::Candidate* candidate) {
  RawStack* gathered = level != nullptr ? level->stack.get() : &thread_scratch_stack();
  if (level == nullptr) {
    gather_stack(gathered, request.python, request.native, options);
  } else {
    // Inside an open scope, the outer frames are that scope's: splice onto its stack.
    const OpenScopes::Level* source = request.splicing ? buffer->scopes.source_below(level) : nullptr;
    StackSplice splice;
    if (source != nullptr) {
      splice = StackSplice{source->stack.get(), source->states.get(), source->python_top, source->scope};
    }
    gather_stack_spliced(gathered, request.python, request.native, options, level->states.get(), &level->python_top,
                         source != nullptr ? &splice : nullptr);
    level->has_stack = request.scope_on_stack;
    level->has_id = request.scope_on_stack;
    if (request.python_top != nullptr) level->python_top = request.python_top;  // known without the Python half too
  }
  GatheredStack result{hash_stack(*gathered), gathered, 0, false};
  if (request.limited) {
    result.limit = limit_key(*gathered, result.stack_id);
    result.limited = true;
  }
  if (level != nullptr) {
    level->stack_id = result.stack_id;
    level->limit_key = result.limit;
  }
  bool confirmed = false;  // a check found the candidate's stack again
  if (request.checking) {
    count(buffer->reuse_checked);
    const uint64_t kept = candidate != nullptr ? candidate->stack_id : entry->stack_id;
    if (kept != result.stack_id) {
      count(buffer->reuse_mismatched);
      // The place holds more than one stack: from now on its candidates' slots decide.
      if (candidate != nullptr) ReusedStacks::drop(candidate);
      entry->ambiguous = 1;
    } else {
      confirmed = candidate != nullptr;
      if (result.limited) {
        (candidate != nullptr ? candidate->limit_key : entry->limit_key) = result.limit;
        (candidate != nullptr ? candidate->limited : entry->limited) = 1;
      }
    }
  }
  if (entry != nullptr && entry->ambiguous && level != nullptr && !confirmed) {
    buffer->reused->add_candidate(*entry, result.stack_id, result.limit, result.limited, *gathered, level->states.get(),
                                  request.scope, request.live_lo, buffer->stack_hi);
  }
  return result;
}

}  // namespace

bool Recorder::record_event(uint32_t kind_id, uint32_t name_id, PyObject* attrs, const char* attrs_json,
                            size_t attrs_json_size, const UnwindOptions& options, const void* scope,
                            uint32_t scoped_flags, uint32_t correlation_id, const TbpipeOpAttrs* op) {
  ThreadBuffer* buffer = this_thread_buffer();
  if (!(scoped_flags & kScopedSampled) && !sample(buffer)) {
    Py_XDECREF(attrs);
    return false;
  }
  const bool python = want_python_.load(std::memory_order_relaxed);
  const bool native = want_native_.load(std::memory_order_relaxed);
  const uint32_t per_stack_limit = max_per_stack_per_s_.load(std::memory_order_relaxed);
  // The enclosing scope's stack, when the event may take it and it still holds: its scope is a live
  // frame of this stack (a scope left open by a missed end is not) and no Python frame came since
  // (which only a stack with its Python half can tell).
  const OpenScopes::Level* enclosing = nullptr;
  if ((scoped_flags & kScopedNested) && python && nested_enclosing_.load(std::memory_order_relaxed)) {
    enclosing = buffer->scopes.innermost_with_id();
    if (enclosing != nullptr &&
        (!on_stack(*buffer, enclosing->scope) || innermost_python_frame() != enclosing->python_top)) {
      enclosing = nullptr;
    }
  }
  OpenScopes::Level* level = scope != nullptr && enclosing == nullptr ? buffer->scopes.open(scope) : nullptr;
  if (level != nullptr) level->name_id = name_id;
  // The event's stack: its id, its frames when this event has them at hand (to write if new; a
  // reused stack was written when it was first gathered), its key for the per-stack limit.
  uint64_t stack_id = 0;
  const RawStack* frames = nullptr;
  uint64_t limit = 0;
  bool limited = false;
  bool reused = false;
  uint64_t place = 0;                            // where a gathered stack is remembered for reuse (0: nowhere)
  ReusedStacks::Entry* entry = nullptr;          // the place's entry, when it has one
  ReusedStacks::Candidate* candidate = nullptr;  // at an ambiguous place, the one whose slots match
  bool checking = false;                         // a reuse gathered anyway, to compare
  const uint32_t generation = reuse_generation_.load(std::memory_order_relaxed) +
                              static_cast<uint32_t>(ModuleRegistry::instance().generation());
  // The live part of this thread's stack: above this frame (a candidate's slots are read there).
  const uintptr_t live_lo = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  const uintptr_t scope_address = reinterpret_cast<uintptr_t>(scope);
  if (enclosing != nullptr) {
    stack_id = enclosing->stack_id;
    frames = enclosing->has_stack ? enclosing->stack.get() : nullptr;
    limit = enclosing->limit_key;
    limited = limit != 0;
  } else if (python || native) {
    // Only a scope in a frame of this stack says which frames stay unchanged inside it (an op
    // object on the heap, such as a Python `record_function`'s, says nothing).
    const bool scope_on_stack = level != nullptr && on_stack(*buffer, scope);
    const void* python_top = nullptr;
    if (scope_on_stack && reuse_.load(std::memory_order_relaxed)) {
      if (!buffer->reused) buffer->reused.reset(new ReusedStacks());
      // Where the source draws the events it records (TBPIPE_RECORD_SAMPLED below a rate of 1), the
      // scopes recorded inside a scope are a random few of those opened there: their order says
      // nothing, and a place keyed by it would be new almost every time.
      const bool ordered =
          !(scoped_flags & kScopedSampled) || sample_threshold_.load(std::memory_order_relaxed) == UINT64_MAX;
      place = reuse_place(*level, kind_id, name_id, buffer->scopes.parent_with_id(level, scope), ordered, &python_top);
      entry = buffer->reused->find(place, generation);
      if (entry != nullptr && entry->ambiguous) {
        candidate = buffer->reused->matching(*entry, scope_address, live_lo, buffer->stack_hi);
      }
      // The stack reusable here: the entry's, or at an ambiguous place the matching candidate's.
      const uint64_t* known = candidate != nullptr                    ? &candidate->stack_id
                              : entry != nullptr && !entry->ambiguous ? &entry->stack_id
                                                                      : nullptr;
      const bool knows_limit = candidate != nullptr ? candidate->limited != 0 : entry != nullptr && entry->limited;
      if (known != nullptr) {
        if (entry->first_checks > 0 || (per_stack_limit != 0 && !knows_limit)) {
          // Checked (and the limit's key learned, where a limit came on since the stack was kept).
          if (entry->first_checks > 0) --entry->first_checks;
          checking = true;
        } else if (--buffer->reuses_until_check > 0) {
          reused = true;
          stack_id = *known;
          limit = candidate != nullptr ? candidate->limit_key : entry->limit_key;
          limited = knows_limit;
          count(buffer->stacks_reused);
        } else {
          checking = true;
          // Every `check_every` reuses on average, at random (a step's ops repeat in a fixed order).
          const uint32_t every = reuse_check_every_.load(std::memory_order_relaxed);
          buffer->reuses_until_check =
              every == 1 ? 1 : 1 + static_cast<uint32_t>(next_random(buffer) % (2 * every - 1));
        }
      }
    }
    if (reused) {
      level->has_id = true;
      level->stack_id = stack_id;
      level->limit_key = limit;
      level->python_top = python_top;
    } else {
      const GatheredStack gathered =
          gather_event_stack(buffer, level,
                             GatherRequest{python, native, splicing_.load(std::memory_order_relaxed), scope_on_stack,
                                           per_stack_limit != 0, checking, python_top, scope_address, live_lo},
                             options, entry, candidate);
      stack_id = gathered.stack_id;
      frames = gathered.frames;
      limit = gathered.limit;
      limited = gathered.limited;
    }
  }
  if (per_stack_limit != 0 && stack_id != 0) {
    // Checked before the seen-set insert: a stack must never be marked written
    // by an event that is then left out.
    const uint32_t limits = limits_generation_.load(std::memory_order_relaxed);
    if (!buffer->windows || buffer->windows_generation != limits) {
      buffer->windows.reset(new StackWindows());
      buffer->windows_generation = limits;
    }
    if (!buffer->windows->admit(limited ? limit : stack_id, per_stack_limit, coarse_now_ms())) {
      count(buffer->rate_limited);
      Py_XDECREF(attrs);
      return false;
    }
  }
  // A reused stack is in the seen set: it was remembered only once its first event was admitted.
  const bool new_stack = !reused && frames != nullptr && stack_id != 0 && insert_seen(stack_id);
  // A place not known yet is remembered (from its second time on: admit) once its stack is in the seen set.
  if (place != 0 && entry == nullptr && stack_id != 0 && buffer->reused->admit(place)) {
    buffer->reused->put(place, stack_id, limit, limited);
  }
  const int64_t ts = now_ns();

  SpinGuard guard(buffer->busy);
  BufferData& data = buffer->front;
  // A new stack is written even when its event is dropped below: it is now in
  // the seen-set, so later events will refer to it without writing it again.
  if (new_stack) {
    stacks_.fetch_add(1, std::memory_order_relaxed);
    append_stack(&data, *frames, stack_id);
  }
  if (data.events.size() >= max_buffered_events_) {
    // The flusher is not keeping up: drop rather than grow without bound.
    count(buffer->dropped);
    Py_XDECREF(attrs);
    return false;
  }
  int32_t attrs_index = -1;
  if (attrs != nullptr) {
    attrs_index = static_cast<int32_t>(data.attrs.size());
    data.attrs.push_back(BufferData::Attr{attrs, 0, 0});
  } else if (attrs_json != nullptr && attrs_json_size > 0) {
    attrs_index = static_cast<int32_t>(data.attrs.size());
    const uint32_t begin = static_cast<uint32_t>(data.attr_text.size());
    data.attr_text.append(attrs_json, attrs_json_size);
    data.attrs.push_back(BufferData::Attr{nullptr, begin, static_cast<uint32_t>(data.attr_text.size())});
  }
  if (op != nullptr) data.ops.push_back(BufferData::Op{*op, static_cast<uint32_t>(data.events.size())});
  data.events.push_back(EventRecord{ts, stack_id, kind_id, name_id, attrs_index, correlation_id});
  count(buffer->recorded);
  return true;
}

namespace {

// The drained op columns, as long as `events` (a value for each event, none where op_present is 0).
void size_op_columns(Drained* out, size_t events) {
  out->op_present.resize(events, 0);
  for (std::vector<int64_t>* column :
       {&out->op_id, &out->op_parent, &out->op_seq, &out->op_seq_thread, &out->op_bwd_seq, &out->op_fwd_thread}) {
    column->resize(events, 0);
  }
  out->op_depth.resize(events, 0);
  out->op_bwd_node.resize(events, 0);
  out->op_scope.resize(events, 0);
}

// A buffer's op attributes into the drained columns: its events are out's [first, end).
void drain_ops(const BufferData& data, size_t first, size_t end, Drained* out) {
  size_op_columns(out, end);
  for (const BufferData::Op& op : data.ops) {
    const size_t i = first + op.event;
    out->op_present[i] = static_cast<uint8_t>(op.attrs.present);
    out->op_id[i] = static_cast<int64_t>(op.attrs.id);
    out->op_parent[i] = static_cast<int64_t>(op.attrs.parent);
    out->op_seq[i] = op.attrs.seq;
    out->op_seq_thread[i] = static_cast<int64_t>(op.attrs.seq_thread);
    out->op_bwd_seq[i] = op.attrs.bwd_seq;
    out->op_fwd_thread[i] = static_cast<int64_t>(op.attrs.fwd_thread);
    out->op_depth[i] = static_cast<int32_t>(op.attrs.depth);
    out->op_bwd_node[i] = op.attrs.bwd_node;
    out->op_scope[i] = op.attrs.scope;
  }
}

}  // namespace

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
    // JSON texts are copied into one buffer, no object per event: a busy source records hundreds
    // of thousands of events per flush.
    out->attr_text.reserve(out->attr_text.size() + data.attr_text.size());
    const size_t events = out->ts_ns.size() + data.events.size();
    grow_to(out->ts_ns, events);
    grow_to(out->thread_id, events);
    grow_to(out->stack_id, events);
    grow_to(out->kind_id, events);
    grow_to(out->name_id, events);
    grow_to(out->correlation_id, events);
    grow_to(out->attr_offsets, events + 1);
    for (const EventRecord& event : data.events) {
      out->ts_ns.push_back(event.ts_ns);
      out->thread_id.push_back(buffer->thread_id);
      out->stack_id.push_back(event.stack_id);
      out->kind_id.push_back(event.kind_id);
      out->name_id.push_back(event.name_id);
      out->correlation_id.push_back(event.correlation_id);
      if (event.attrs_index >= 0) {
        const BufferData::Attr& attr = data.attrs[static_cast<size_t>(event.attrs_index)];
        if (attr.object != nullptr) {
          out->attr_objects.emplace_back(static_cast<int64_t>(out->ts_ns.size() - 1), attr.object);
        } else {
          out->attr_text.append(data.attr_text, attr.text_begin, attr.text_end - attr.text_begin);
        }
      }
      out->attr_offsets.push_back(static_cast<int64_t>(out->attr_text.size()));
    }
    if (!data.ops.empty()) drain_ops(data, events - data.events.size(), events, out);
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
      impl_->exited_sampled_out += buffer->sampled_out.load(std::memory_order_relaxed);
      impl_->exited_rate_limited += buffer->rate_limited.load(std::memory_order_relaxed);
      impl_->exited_stacks_reused += buffer->stacks_reused.load(std::memory_order_relaxed);
      impl_->exited_reuse_checked += buffer->reuse_checked.load(std::memory_order_relaxed);
      impl_->exited_reuse_mismatched += buffer->reuse_mismatched.load(std::memory_order_relaxed);
      delete buffer;
    } else {
      keep.push_back(buffer);
    }
  }
  impl_->buffers.swap(keep);
  if (!out->op_present.empty()) size_op_columns(out, out->ts_ns.size());
  out->dropped = impl_->exited_dropped;
  for (ThreadBuffer* buffer : impl_->buffers) out->dropped += buffer->dropped.load(std::memory_order_relaxed);
}

RecorderCounters Recorder::counters() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  RecorderCounters counters;
  counters.recorded = impl_->exited_recorded;
  counters.dropped = impl_->exited_dropped;
  counters.sampled_out = impl_->exited_sampled_out;
  counters.rate_limited = impl_->exited_rate_limited;
  counters.stacks_reused = impl_->exited_stacks_reused;
  counters.reuse_checked = impl_->exited_reuse_checked;
  counters.reuse_mismatched = impl_->exited_reuse_mismatched;
  for (ThreadBuffer* buffer : impl_->buffers) {
    counters.recorded += buffer->recorded.load(std::memory_order_relaxed);
    counters.dropped += buffer->dropped.load(std::memory_order_relaxed);
    counters.sampled_out += buffer->sampled_out.load(std::memory_order_relaxed);
    counters.rate_limited += buffer->rate_limited.load(std::memory_order_relaxed);
    counters.stacks_reused += buffer->stacks_reused.load(std::memory_order_relaxed);
    counters.reuse_checked += buffer->reuse_checked.load(std::memory_order_relaxed);
    counters.reuse_mismatched += buffer->reuse_mismatched.load(std::memory_order_relaxed);
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
