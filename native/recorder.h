// The event recorder: per-thread event buffers, native stack deduplication,
// and the drain that hands everything recorded so far to the flusher thread.
//
// Hot path (record): gather the stack, hash it, insert the hash into the
// global seen-set (lock-free), append the stack only if it is new, append the
// event - all into the calling thread's own buffer, guarded by an uncontended
// per-thread spin flag that only the flusher ever competes for.
#pragma once

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "capi.h"
#include "frames.h"
#include "gather.h"

namespace tbpipe {

struct EventRecord {
  int64_t ts_ns;            // CLOCK_REALTIME, nanoseconds
  uint64_t stack_id;        // hash_stack(), 0 when no stack was taken
  uint32_t kind_id;         // StringTable id
  uint32_t name_id;         // StringTable id
  int32_t attrs_index;      // index into the buffer's attribute list, -1 when none
  uint32_t correlation_id;  // CUPTI's, of a CUDA API call; 0 for other events
};

// Everything drained from all threads, in columnar form for Arrow.
struct Drained {
  // events
  std::vector<int64_t> ts_ns, thread_id;
  std::vector<uint64_t> stack_id;
  std::vector<uint32_t> kind_id, name_id;
  std::vector<uint32_t> correlation_id;  // 0 = none
  // Attributes as Arrow lays out a string column: event i's JSON text is
  // attr_text[attr_offsets[i]:attr_offsets[i + 1]], empty when it has none or
  // when it has a dict (record() from Python), listed in attr_objects as
  // (event index, new reference) for the writer to serialize.
  std::string attr_text;
  std::vector<int64_t> attr_offsets{0};
  std::vector<std::pair<int64_t, PyObject*>> attr_objects;
  // Attributes of op events (record_native_op), one per event, each holding a value where
  // op_present has its TBPIPE_OP_* bit (none for events that are not ops); all empty when no event
  // drained is an op.
  std::vector<uint8_t> op_present;
  std::vector<int64_t> op_id, op_parent, op_seq, op_seq_thread, op_bwd_seq, op_fwd_thread;
  std::vector<int32_t> op_depth;
  std::vector<uint32_t> op_bwd_node, op_scope;  // StringTable ids, 0: none
  // stacks, flattened: stack i owns native[native_ends[i-1]:native_ends[i]]
  std::vector<uint64_t> stack_ids;
  std::vector<uint32_t> stack_status;
  std::vector<int64_t> stack_thread;
  std::vector<uint32_t> native_ends, python_ends;
  std::vector<int32_t> native_module;
  std::vector<uint64_t> native_offset;  // pc - load bias (marker: StopReason)
  std::vector<uint32_t> native_flags;
  std::vector<uint64_t> python_code;
  std::vector<int32_t> python_offset;
  std::vector<uint32_t> python_flags;
  uint64_t dropped = 0;
};

struct RecorderCounters {
  uint64_t recorded = 0;
  uint64_t dropped = 0;
  uint64_t stacks = 0;
  uint64_t sampled_out = 0;   // left out by OverheadLimits::sample_rate
  uint64_t rate_limited = 0;  // left out by OverheadLimits::max_per_stack_per_s
  // Stack reuse (set_stack_reuse): events that took an earlier event's stack without gathering one,
  // reused stacks gathered anyway to check them, and checks that found another stack.
  uint64_t stacks_reused = 0;
  uint64_t reuse_checked = 0;
  uint64_t reuse_mismatched = 0;
};

// Overhead control for busy event sources. Sampling is decided before the
// stack is gathered (so it saves the gather); the per-stack limit needs the
// stack id and so is checked after the gather, before anything is buffered.
struct OverheadLimits {
  double sample_rate = 1.0;  // probability that an event is recorded, in (0, 1]
  // Per thread and call path (a stack's Python frames; its native frames when
  // it has no Python frames); 0 = unlimited.
  uint32_t max_per_stack_per_s = 0;
};

class Recorder {
 public:
  static Recorder& instance();

  bool active() const { return active_.load(std::memory_order_acquire); }
  // Starts recording afresh: forgets which stacks were seen and discards
  // anything buffered from an earlier session.
  void start(bool python, bool native, uint64_t max_buffered_events);
  void stop();
  // Takes effect for events recorded after the call; start() keeps them.
  void set_overhead_limits(const OverheadLimits& limits);
  // The sample rate set last (1.0: every event).
  double sample_rate() const;
  // Which halves of the stack events recorded from now on get, without starting afresh (benchmarks
  // compare them inside one session; a session sets them in start()).
  void set_stack_parts(bool python, bool native);

  // Records one event on the calling thread. `attrs` is a new reference (or
  // null) that the buffer takes over. Returns false when dropped.
  bool record(uint32_t kind_id, uint32_t name_id, PyObject* attrs, const UnwindOptions& options);
  // The same for native event sources, with or without the GIL: attributes
  // come as a JSON object's text (or null / size 0 for none). A CUDA API call's
  // correlation id goes in its own column (0: none), not in the JSON.
  bool record_native(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_json_size,
                     const UnwindOptions& options, uint32_t correlation_id = 0);
  // record_native for an event that opens a scope on the calling thread (an op that starts and will
  // end on it): `scope` is an address in a stack frame of this thread that lives until
  // end_scope(scope), such as the op's RecordFunction. Until then, events of this thread that
  // open scopes inside it take the outer part of their stack from this event's instead of walking
  // it (the frames there are the same running ones). Scopes nest; the stacks are what full
  // gathers give.
  // `flags`: kScopedSampled, the caller already drew with sample_next() and the event is kept;
  // kScopedNested, the event happens inside the thread's open scopes (an op called by an op): with
  // nested events taking enclosing stacks (set_nested_stacks), it takes the stack of the innermost
  // open scope's event instead of gathering one, as long as the thread's Python stack is the one
  // that event saw (no Python code ran in between; a session without Python frames cannot tell,
  // and always gathers), and opens no scope of its own.
  bool record_native_scoped(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_json_size,
                            const UnwindOptions& options, const void* scope, uint32_t flags);
  // record_native_scoped for an op event with typed attributes instead of JSON text.
  bool record_native_op(uint32_t kind_id, uint32_t name_id, const TbpipeOpAttrs& op, const UnwindOptions& options,
                        const void* scope, uint32_t flags);
  static constexpr uint32_t kScopedSampled = 1;
  static constexpr uint32_t kScopedNested = 2;
  // The sample-rate draw for the calling thread's next event, counted as sampled out when it is
  // left out: a busy source asks first and describes only the events that will be kept.
  bool sample_next();
  // Closes `scope` (and any scope left open inside it); unknown scopes are ignored.
  void end_scope(const void* scope);
  // Whether scoped events splice their stacks (on by default; tests compare both ways).
  void set_splicing(bool enabled) { splicing_.store(enabled, std::memory_order_relaxed); }
  // Whether nested scoped events take their enclosing scope's stack (off by default: each gathers
  // its own): the session's op_stacks.
  void set_nested_stacks_enclosing(bool enabled) { nested_enclosing_.store(enabled, std::memory_order_relaxed); }
  // Whether a scoped event may take the stack an earlier event of its thread gathered in the same
  // place (on by default), instead of gathering its own. The place is what decides a stack without
  // walking it: the thread's Python frames (python_stack_key), the event's kind and name, its
  // scope's depth on the C stack, and, inside an open scope, that scope's stack and the event's
  // place among the events opened in it (two calls of one op from one function are told apart by
  // their order). A place's first reuse, and then one in about `check_every` (1: every one), gathers
  // the stack anyway and compares: a place found to hold another stack (the same op called from
  // two lines of one C++ function, as its inputs decide) keeps each stack it meets with the return
  // addresses of its innermost native frames as they lie on the thread's stack, and an event there
  // takes the stack whose return addresses it finds in the same slots. The counters count both.
  void set_stack_reuse(bool enabled, uint32_t check_every);

  // Moves everything buffered out of every thread's buffer (the GIL must be
  // held: attribute objects change hands).
  void drain(Drained* out);
  RecorderCounters counters() const;

  void after_fork_in_child();

  struct ThreadBuffer;  // opaque; public so the thread-exit hook can mark it

 private:
  Recorder();
  ThreadBuffer* this_thread_buffer();
  bool record_event(uint32_t kind_id, uint32_t name_id, PyObject* attrs, const char* attrs_json, size_t attrs_json_size,
                    const UnwindOptions& options, const void* scope, uint32_t scoped_flags, uint32_t correlation_id = 0,
                    const TbpipeOpAttrs* op = nullptr);
  bool sample(ThreadBuffer* buffer);
  static uint64_t next_random(ThreadBuffer* buffer);
  bool insert_seen(uint64_t stack_id);

  std::atomic<bool> active_{false};
  std::atomic<bool> want_python_{true};
  std::atomic<bool> want_native_{true};
  std::atomic<bool> splicing_{true};
  std::atomic<bool> nested_enclosing_{false};
  std::atomic<bool> reuse_{true};
  std::atomic<uint32_t> reuse_check_every_{256};
  // Bumped whenever a stack reused from before would no longer be right: a new session (its seen
  // set is new), other stack parts.
  std::atomic<uint32_t> reuse_generation_{1};
  uint64_t max_buffered_events_ = 1u << 22;
  // sample_rate as a threshold on a 64-bit random draw; UINT64_MAX = keep all.
  std::atomic<uint64_t> sample_threshold_{UINT64_MAX};
  std::atomic<uint32_t> max_per_stack_per_s_{0};
  std::atomic<uint32_t> limits_generation_{0};  // bumped to reset per-thread windows
  std::atomic<uint64_t> stacks_{0};
  struct Impl;
  Impl* impl_;
};

}  // namespace tbpipe
