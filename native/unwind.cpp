// unwind_native: the calling thread's native stack, innermost first.
//
// Per thread we keep the stack bounds (looked up once) and a recipe cache keyed
// by lookup PC. A warm frame is one probe of a 2-way set (one cache line), the
// stores of the frame, and the two or three stack loads its recipe names; the
// module index and the eval-loop flag come from the cache entry too, so the
// registry is consulted only on a miss. A miss compiles the recipe from CFI
// (cfi.cpp) and may refresh the module registry once per walk when the PC is in
// no known module.

#include "unwind.h"

#include <pthread.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cfi.h"
#include "modules.h"
#include "stack_bounds.h"

namespace tbpipe {

#if defined(__x86_64__) || defined(__aarch64__)
namespace {

constexpr unsigned kCacheSetBits = 11;
constexpr size_t kCacheSets = size_t{1} << kCacheSetBits;
constexpr size_t kCacheWays = 2;  // 4096 entries, 128 KiB per walking thread

// Walks may skip a few of our own frames before writing; bound the total so a
// loop of bad frames cannot spin even if every check passed.
constexpr size_t kMaxSteps = kMaxNativeFrames * 2;

struct CacheEntry {
  uintptr_t key;  // lookup PC; 0 = empty
  cfi::Recipe recipe;
  int32_t module;
  uint32_t frame_flags;  // kFrameEvalLoop when the lookup PC is in the eval loop
};
static_assert(sizeof(CacheEntry) == 32, "two ways share one 64-byte line");

// Constant-initialized and trivially destructible, so access needs no TLS guard.
struct ThreadState {
  CacheEntry* cache;
  uintptr_t stack_lo;
  uintptr_t stack_hi;
  uint64_t generation;
  bool initialized;
};
thread_local ThreadState t_state;
thread_local uint64_t t_spliced_walks = 0;

pthread_key_t g_cache_key;
std::once_flag g_cache_key_once;

// Runs at thread exit; the thread's TLS is still valid here.
void release_thread_cache(void* cache) {
  if (t_state.cache == cache) {
    t_state.cache = nullptr;
    t_state.initialized = false;
  }
  free(cache);
}

void clear_cache(ThreadState& ts) {
  // All-zero bytes are a valid empty entry (key 0).
  if (ts.cache) memset(static_cast<void*>(ts.cache), 0, kCacheSets * kCacheWays * sizeof(CacheEntry));
}

// First walk on this thread: stack bounds and the cache. Not on the warm path.
void init_thread(ThreadState& ts) {
  ts.initialized = true;
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* addr = nullptr;
    size_t size = 0;
    if (pthread_attr_getstack(&attr, &addr, &size) == 0 && addr != nullptr) {
      ts.stack_lo = reinterpret_cast<uintptr_t>(addr);
      ts.stack_hi = ts.stack_lo + size;
    }
    pthread_attr_destroy(&attr);
  }
  std::call_once(g_cache_key_once, [] { pthread_key_create(&g_cache_key, release_thread_cache); });
  void* mem = aligned_alloc(64, kCacheSets * kCacheWays * sizeof(CacheEntry));
  if (mem) {
    ts.cache = static_cast<CacheEntry*>(mem);
    clear_cache(ts);
    pthread_setspecific(g_cache_key, mem);
  }
  ts.generation = ModuleRegistry::instance().generation();
}

inline CacheEntry* cache_set(CacheEntry* cache, uintptr_t key) {
  // Two cheap ops: the index computation is on the walk's critical path.
  uintptr_t h = key ^ (key >> kCacheSetBits) ^ (key >> (2 * kCacheSetBits));
  return cache + (h & (kCacheSets - 1)) * kCacheWays;
}

// `cache` is passed in rather than read from t_state: in a shared object every
// TLS access may be a __tls_get_addr call, which must stay out of the loop.
inline const CacheEntry* cache_probe(CacheEntry* cache, uintptr_t key) {
  if (!cache || key == 0) return nullptr;
  const CacheEntry* set = cache_set(cache, key);
  if (set[0].key == key) return &set[0];
  if (set[1].key == key) return &set[1];
  return nullptr;
}

// The module containing our own extension, for skip_own_module.
int32_t own_module_index() {
  static const int32_t index = [] {
    ModuleRegistry& reg = ModuleRegistry::instance();
    const uintptr_t self = reinterpret_cast<uintptr_t>(&own_module_index);
    int32_t i = reg.lookup(self);
    if (i < 0 && reg.refresh()) i = reg.lookup(self);
    return i;
  }();
  return index;
}

// Slow path of a cache miss: find the module (refreshing at most once per
// walk), compile the recipe and insert it. Returns null for a PC outside every
// module; such misses are not cached, so a library loaded later is found.
const CacheEntry* cache_fill(ThreadState& ts, uintptr_t key, bool* refreshed, CacheEntry* scratch) {
  ModuleRegistry& reg = ModuleRegistry::instance();
  int32_t mod = reg.lookup(key);
  if (mod < 0 && !*refreshed) {
    *refreshed = true;
    reg.refresh();
    mod = reg.lookup(key);
    uint64_t gen = reg.generation();
    if (gen != ts.generation) {
      // Indices are stable, but an address may now belong to another object.
      clear_cache(ts);
      ts.generation = gen;
    }
  }
  const Module* m = reg.module(mod);
  if (!m) return nullptr;

  CacheEntry e;
  e.key = key;
#if defined(__x86_64__)
  e.recipe = cfi::compile_recipe(*m, key);
#else
  e.recipe = cfi::Recipe{};
#endif
  e.module = mod;
  e.frame_flags = reg.is_eval_pc(mod, key) ? uint32_t{kFrameEvalLoop} : 0u;
  if (!ts.cache) {
    *scratch = e;
    return scratch;
  }
  CacheEntry* set = cache_set(ts.cache, key);
  set[1] = set[0];  // newest in way 0, the previous one survives in way 1
  set[0] = e;
  return &set[0];
}

// Writes frames into the caller's buffer, applying the skip options. The last
// slot is kept for a marker so that a truncated walk always says so.
class FrameSink {
 public:
  FrameSink(NativeFrame* out, NativeFrameState* states, size_t max, const UnwindOptions& opt)
      : out_(out),
        states_(states),
        cap_(max < kMaxNativeFrames ? max : kMaxNativeFrames),
        skip_until_eval_(opt.skip_until_eval),
        skipping_own_(opt.skip_own_module),
        skip_caller_(opt.skip_caller_module),
        own_(opt.skip_own_module ? own_module_index() : -1) {}

  // False once the buffer is full (a kDepthLimit marker has been written).
  bool frame(uintptr_t pc, int32_t module, uint32_t flags, const NativeFrameState& state) {
    if (skipping_own_) {
      if (module == own_ && own_ >= 0) return true;
      skipping_own_ = false;
      if (skip_caller_ && module != own_) caller_ = module;
    }
    if (caller_ >= 0) {
      if (module == caller_ && !(flags & kFrameEvalLoop)) return true;
      caller_ = -1;
    }
    if (n_ + 1 >= cap_) {
      marker(StopReason::kDepthLimit);
      return false;
    }
    if (states_ != nullptr) states_[n_] = state;
    out_[n_++] = NativeFrame{pc, module, flags};
    if (skip_until_eval_ && (flags & kFrameEvalLoop)) {
      // Drop the interpreter's call machinery written so far; only now do we
      // know that an eval-loop frame exists to keep instead.
      out_[0] = out_[n_ - 1];
      if (states_ != nullptr) states_[0] = states_[n_ - 1];
      n_ = 1;
      skip_until_eval_ = false;
    }
    return true;
  }

  void marker(StopReason reason) {
    if (n_ < cap_) {
      if (states_ != nullptr) states_[n_] = NativeFrameState{0, 0, 0};
      out_[n_++] = NativeFrame{static_cast<uintptr_t>(reason), -1, kFrameMarker};
    }
  }

  // Whether the skip options are done with (a splice copies frames as they are).
  bool skipping() const { return skipping_own_ || caller_ >= 0 || skip_until_eval_; }

  // Copies frames [from, count) of an earlier walk, markers included, as far as they fit.
  void copy_from(const NativeSplice& splice, size_t from) {
    for (size_t i = from; i < splice.count; ++i) {
      const NativeFrame& f = splice.frames[i];
      if (f.flags & kFrameMarker) {
        marker(static_cast<StopReason>(f.pc));
        return;
      }
      if (n_ + 1 >= cap_) {
        marker(StopReason::kDepthLimit);
        return;
      }
      if (states_ != nullptr) states_[n_] = splice.states[i];
      out_[n_++] = f;
    }
  }

  bool room_for_frame_and_marker() const { return n_ + 2 <= cap_; }
  size_t count() const { return n_; }

 private:
  NativeFrame* out_;
  NativeFrameState* states_;
  size_t cap_;
  size_t n_ = 0;
  bool skip_until_eval_;
  bool skipping_own_;
  bool skip_caller_;
  int32_t own_;
  int32_t caller_ = -1;  // module being skipped after our own (skip_caller_module)
};

// The splice usable for a walk of this thread, or null: its anchor must lie on this stack.
const NativeSplice* usable_splice(const NativeSplice* splice, const ThreadState& ts) {
  if (splice == nullptr || splice->count == 0 || splice->anchor < ts.stack_lo || splice->anchor >= ts.stack_hi) {
    return nullptr;
  }
  return splice;
}

// Index of the earlier walk's frame in exactly this state, or -1. Only frames above the anchor
// qualify: they belong to functions that have not returned since, so their saved registers and
// return addresses, all the walk reads from there on, are what the earlier walk read.
ptrdiff_t splice_point(const NativeSplice& splice, uintptr_t pc, const NativeFrameState& state, uint32_t flags) {
  if (state.sp <= splice.anchor) return -1;
  size_t lo = 0, hi = splice.count;  // states' sp increase outward (markers, last, have sp 0)
  while (hi > lo && splice.frames[hi - 1].flags & kFrameMarker) --hi;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (splice.states[mid].sp < state.sp) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo >= splice.count) return -1;
  const NativeFrameState& old = splice.states[lo];
  const NativeFrame& frame = splice.frames[lo];
  if (old.sp != state.sp || old.bp != state.bp || old.bp_valid != state.bp_valid || frame.pc != pc ||
      (frame.flags & (kFrameExactPc | kFrameByFramePointer)) != (flags & (kFrameExactPc | kFrameByFramePointer))) {
    return -1;
  }
  return static_cast<ptrdiff_t>(lo);
}

// Common prologue of a walk: thread setup, cache generation, stack check.
// Returns false when the walk cannot start (a marker has been written).
bool begin_walk(ThreadState& ts, FrameSink& sink, uintptr_t sp, StackBounds* bounds) {
  if (!ts.initialized) init_thread(ts);
  uint64_t gen = ModuleRegistry::instance().generation();
  if (gen != ts.generation) {
    clear_cache(ts);
    ts.generation = gen;
  }
  // On another stack (sigaltstack, a fiber) we cannot bound the reads.
  if (sp < ts.stack_lo || sp >= ts.stack_hi) {
    sink.marker(StopReason::kBadStackRead);
    return false;
  }
  *bounds = StackBounds{sp, ts.stack_hi};
  return true;
}

#if defined(__x86_64__)

__attribute__((noinline)) size_t walk_x86_64(NativeFrame* out, NativeFrameState* states, size_t max,
                                             const UnwindOptions& options, const NativeSplice* splice_in, uintptr_t pc,
                                             uintptr_t sp, uintptr_t bp) {
  using cfi::CfaRule;
  using cfi::RaRule;
  using cfi::RbpRule;
  ThreadState& ts = t_state;
  FrameSink sink(out, states, max, options);
  StackBounds stack;
  if (!begin_walk(ts, sink, sp, &stack)) return sink.count();
  CacheEntry* const cache = ts.cache;
  const NativeSplice* splice = usable_splice(splice_in, ts);

  bool exact = true;  // the first PC is where unwind_native is executing
  bool bp_valid = true;
  bool refreshed = false;
  uint32_t next_flags = kFrameExactPc;
  CacheEntry scratch;

  for (size_t step = 0;; ++step) {
    if (step == kMaxSteps) {
      sink.marker(StopReason::kDepthLimit);
      break;
    }
    const NativeFrameState state{sp, bp, bp_valid};
    if (splice != nullptr && !sink.skipping()) {
      const ptrdiff_t from = splice_point(*splice, pc, state, next_flags);
      if (from >= 0) {
        sink.copy_from(*splice, static_cast<size_t>(from));
        ++t_spliced_walks;
        break;
      }
    }
    const uintptr_t key = exact ? pc : pc - 1;
    const CacheEntry* e = cache_probe(cache, key);
    if (__builtin_expect(e == nullptr, 0)) {
      e = cache_fill(ts, key, &refreshed, &scratch);
      if (!e) {
        if (sink.room_for_frame_and_marker()) sink.frame(pc, -1, next_flags, state);
        sink.marker(StopReason::kUnknownPc);
        break;
      }
    }
    if (!sink.frame(pc, e->module, next_flags | e->frame_flags, state)) break;
    const cfi::Recipe r = e->recipe;
    next_flags = 0;

    if (__builtin_expect((r.flags & cfi::kRecipeSimple) != 0, 1)) {
      // CFA = rsp|rbp + k, ra at CFA + k, rbp kept or at CFA + k: nearly every
      // frame of compiled code, handled without the general switches below.
      const bool from_bp = r.cfa_rule == CfaRule::kRbpOffset;
      if (from_bp && !bp_valid) {
        sink.marker(StopReason::kUnsupportedRule);
        break;
      }
      const uintptr_t cfa = (from_bp ? bp : sp) + r.cfa_off;
      uintptr_t ra;
      if (cfa <= sp || cfa > stack.hi || !stack.load(cfa + r.ra_off, &ra)) {
        sink.marker(StopReason::kBadStackRead);
        break;
      }
      if (r.rbp_rule == RbpRule::kAtCfa) {
        if (!stack.load(cfa + r.rbp_off, &bp)) {
          sink.marker(StopReason::kBadStackRead);
          break;
        }
        bp_valid = true;
      }
      if (ra == 0) break;
      pc = ra;
      sp = cfa;
      exact = false;
      continue;
    }

    uintptr_t cfa = 0;
    switch (r.cfa_rule) {
      case CfaRule::kRspOffset:
        cfa = sp + r.cfa_off;
        break;
      case CfaRule::kRbpOffset:
        if (!bp_valid) {
          sink.marker(StopReason::kUnsupportedRule);
          return sink.count();
        }
        cfa = bp + r.cfa_off;
        break;
      case CfaRule::kDerefRsp:
        if (!stack.load(sp + r.cfa_off, &cfa)) {
          sink.marker(StopReason::kBadStackRead);
          return sink.count();
        }
        break;
      case CfaRule::kDerefRbp:
        if (!bp_valid) {
          sink.marker(StopReason::kUnsupportedRule);
          return sink.count();
        }
        if (!stack.load(bp + r.cfa_off, &cfa)) {
          sink.marker(StopReason::kBadStackRead);
          return sink.count();
        }
        break;
      case CfaRule::kPlt:
        cfa = sp + r.cfa_off + ((pc & 15) >= r.plt_threshold ? 8 : 0);
        break;
      case CfaRule::kNoInfo: {
        // Frame-pointer fallback: [rbp] = caller's rbp, [rbp + 8] = return address.
        uintptr_t ra, nbp;
        if (!bp_valid || bp < sp || !stack.load(bp + 8, &ra) || !stack.load(bp, &nbp)) {
          sink.marker(StopReason::kNoUnwindInfo);
          return sink.count();
        }
        if (ra == 0) return sink.count();
        pc = ra;
        sp = bp + 16;
        bp = nbp;
        exact = false;
        next_flags = kFrameByFramePointer;
        continue;
      }
      case CfaRule::kUnsupported:
        sink.marker(StopReason::kUnsupportedRule);
        return sink.count();
    }

    uintptr_t ra = 0;
    bool ra_ok = true;
    switch (r.ra_rule) {
      case RaRule::kUndefined:
        return sink.count();  // outermost frame
      case RaRule::kAtCfa:
        ra_ok = stack.load(cfa + r.ra_off, &ra);
        break;
      case RaRule::kAtRsp:
        ra_ok = stack.load(sp + r.ra_off, &ra);
        break;
      case RaRule::kAtRbp:
        ra_ok = bp_valid && stack.load(bp + r.ra_off, &ra);
        break;
    }
    if (!ra_ok) {
      sink.marker(StopReason::kBadStackRead);
      return sink.count();
    }

    uintptr_t nbp = bp;
    bool nbp_valid = bp_valid;
    bool bp_ok = true;
    switch (r.rbp_rule) {
      case RbpRule::kSame:
        break;
      case RbpRule::kAtCfa:
        bp_ok = stack.load(cfa + r.rbp_off, &nbp);
        break;
      case RbpRule::kAtRsp:
        bp_ok = stack.load(sp + r.rbp_off, &nbp);
        break;
      case RbpRule::kAtRbp:
        bp_ok = bp_valid && stack.load(bp + r.rbp_off, &nbp);
        break;
      case RbpRule::kValCfa:
        nbp = cfa + r.rbp_off;
        break;
      case RbpRule::kLost:
        nbp_valid = false;
        break;
    }
    if (!bp_ok) {
      sink.marker(StopReason::kBadStackRead);
      return sink.count();
    }
    // The CFA is the caller's rsp; it must move up or the stack is corrupt.
    if (cfa <= sp || cfa > stack.hi) {
      sink.marker(StopReason::kBadStackRead);
      return sink.count();
    }
    if (ra == 0) return sink.count();
    pc = ra;
    sp = cfa;
    bp = nbp;
    bp_valid = nbp_valid;
    exact = (r.flags & cfi::kRecipeSignalFrame) != 0;
    if (exact) next_flags = kFrameExactPc;
  }
  return sink.count();
}

#elif defined(__aarch64__)

// Removes a pointer-authentication code from a return address (XPACLRI, which
// is in the hint space and so a no-op on cores without PAC).
inline uintptr_t strip_pac(uintptr_t lr) {
  register uintptr_t x30 asm("x30") = lr;
  asm("hint #7" : "+r"(x30));
  return x30;
}

__attribute__((noinline)) size_t walk_aarch64(NativeFrame* out, NativeFrameState* states, size_t max,
                                              const UnwindOptions& options, const NativeSplice* splice_in, uintptr_t pc,
                                              uintptr_t sp, uintptr_t fp) {
  ThreadState& ts = t_state;
  FrameSink sink(out, states, max, options);
  StackBounds stack;
  if (!begin_walk(ts, sink, sp, &stack)) return sink.count();
  CacheEntry* const cache = ts.cache;
  const NativeSplice* splice = usable_splice(splice_in, ts);

  bool exact = true;
  bool refreshed = false;
  uint32_t next_flags = kFrameExactPc;
  CacheEntry scratch;
  for (size_t step = 0;; ++step) {
    if (step == kMaxSteps) {
      sink.marker(StopReason::kDepthLimit);
      break;
    }
    const NativeFrameState state{sp, fp, 1};
    if (splice != nullptr && !sink.skipping()) {
      const ptrdiff_t from = splice_point(*splice, pc, state, next_flags);
      if (from >= 0) {
        sink.copy_from(*splice, static_cast<size_t>(from));
        ++t_spliced_walks;
        break;
      }
    }
    const uintptr_t key = exact ? pc : pc - 1;
    const CacheEntry* e = cache_probe(cache, key);
    if (!e) {
      e = cache_fill(ts, key, &refreshed, &scratch);
      if (!e) {
        if (sink.room_for_frame_and_marker()) sink.frame(pc, -1, next_flags, state);
        sink.marker(StopReason::kUnknownPc);
        break;
      }
    }
    if (!sink.frame(pc, e->module, next_flags | e->frame_flags, state)) break;
    if (fp == 0) break;  // outermost: the entry code clears x29
    // Frame record: [fp] = caller's fp, [fp + 8] = return address.
    uintptr_t next_fp, lr;
    if (fp < sp || !stack.load(fp, &next_fp) || !stack.load(fp + 8, &lr)) {
      sink.marker(StopReason::kBadStackRead);
      break;
    }
    const uintptr_t ra = strip_pac(lr);
    if (ra == 0) break;
    if (next_fp != 0 && next_fp <= fp) {
      sink.marker(StopReason::kBadStackRead);
      break;
    }
    pc = ra;
    sp = fp + 16;
    fp = next_fp;
    exact = false;
    next_flags = kFrameByFramePointer;
  }
  return sink.count();
}

#endif

}  // namespace
#endif  // x86-64 or aarch64

#if defined(__x86_64__) || defined(__aarch64__)

bool address_on_this_stack(const void* address) {
  ThreadState& ts = t_state;
  if (!ts.initialized) init_thread(ts);
  const uintptr_t value = reinterpret_cast<uintptr_t>(address);
  return value >= ts.stack_lo && value < ts.stack_hi;
}

uint64_t spliced_walks_on_this_thread() { return t_spliced_walks; }

void this_thread_stack(uintptr_t* lo, uintptr_t* hi) {
  ThreadState& ts = t_state;
  if (!ts.initialized) init_thread(ts);
  *lo = ts.stack_lo;
  *hi = ts.stack_hi;
}

#else

bool address_on_this_stack(const void*) { return false; }

void this_thread_stack(uintptr_t* lo, uintptr_t* hi) { *lo = *hi = 0; }

uint64_t spliced_walks_on_this_thread() { return 0; }

#endif

#if defined(__x86_64__)

__attribute__((noinline)) size_t unwind_native_spliced(NativeFrame* out, NativeFrameState* states, size_t max,
                                                       const UnwindOptions& options, const NativeSplice* splice) {
  if (!out || max == 0) return 0;
  uintptr_t pc, sp, bp;
  // One asm block, so the three values describe the same instruction and the
  // CFI row for `pc` applies to this `sp`.
  asm volatile(
      "leaq 0(%%rip), %0\n\t"
      "movq %%rsp, %1\n\t"
      "movq %%rbp, %2"
      : "=r"(pc), "=r"(sp), "=r"(bp));
  size_t n = walk_x86_64(out, states, max, options, splice, pc, sp, bp);
  // Not a tail call: the walk reads this frame, which must stay in place.
  asm volatile("" : "+r"(n));
  return n;
}

__attribute__((noinline)) size_t unwind_native(NativeFrame* out, size_t max, const UnwindOptions& options) {
  size_t n = unwind_native_spliced(out, nullptr, max, options, nullptr);
  asm volatile("" : "+r"(n));  // not a tail call: callers count on this frame (skip_own_module)
  return n;
}

#elif defined(__aarch64__)

__attribute__((noinline)) size_t unwind_native_spliced(NativeFrame* out, NativeFrameState* states, size_t max,
                                                       const UnwindOptions& options, const NativeSplice* splice) {
  if (!out || max == 0) return 0;
  uintptr_t pc, sp;
  asm volatile(
      "adr %0, .\n\t"
      "mov %1, sp"
      : "=r"(pc), "=r"(sp));
  // Taking the frame address makes GCC/Clang build this function's frame
  // record, [fp] = caller's fp, [fp + 8] = return address into the caller.
  const uintptr_t fp = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  size_t n = walk_aarch64(out, states, max, options, splice, pc, sp, fp);
  // Not a tail call: the walk reads this frame record, which must stay in place.
  asm volatile("" : "+r"(n));
  return n;
}

__attribute__((noinline)) size_t unwind_native(NativeFrame* out, size_t max, const UnwindOptions& options) {
  size_t n = unwind_native_spliced(out, nullptr, max, options, nullptr);
  asm volatile("" : "+r"(n));
  return n;
}

#else

size_t unwind_native(NativeFrame* out, size_t max, const UnwindOptions&) {
  if (!out || max == 0) return 0;
  out[0] = NativeFrame{static_cast<uintptr_t>(StopReason::kNotSupported), -1, kFrameMarker};
  return 1;
}

size_t unwind_native_spliced(NativeFrame* out, NativeFrameState* states, size_t max, const UnwindOptions& options,
                             const NativeSplice*) {
  size_t n = unwind_native(out, max, options);
  if (states != nullptr && n > 0) states[0] = NativeFrameState{0, 0, 0};
  return n;
}

#endif

}  // namespace tbpipe
