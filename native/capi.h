// The C interface through which native code outside tbpipe._native records into a tbpipe session.
//
// An event source compiled separately (an observer built against torch's headers, a test
// extension) takes this table from the capsule `tbpipe._native._C_API` with
// PyCapsule_GetPointer(capsule, "tbpipe._native._C_API") and calls it from any thread. It is plain
// C so that no C++ ABI has to match between the two builds; `abi_version` changes whenever a
// field's meaning does, and `size` lets a newer caller see which fields an older tbpipe has.
#ifndef TBPIPE_CAPI_H_
#define TBPIPE_CAPI_H_

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TBPIPE_CAPI_CAPSULE "tbpipe._native._C_API"
#define TBPIPE_CAPI_VERSION 1u

// The attributes of an op event (record_op). `present` says which fields hold a value.
typedef struct TbpipeOpAttrs {
  uint32_t present;     // TBPIPE_OP_* bits
  uint32_t depth;       // TBPIPE_OP_DEPTH: how many recorded ops enclose it on its thread
  uint64_t id;          // TBPIPE_OP_ID: its number on its thread
  uint64_t parent;      // TBPIPE_OP_PARENT: the id of the innermost enclosing op
  int64_t seq;          // TBPIPE_OP_SEQ: autograd's sequence number of a forward op...
  uint64_t seq_thread;  // ... and the number of the thread that ran it
  int64_t bwd_seq;      // TBPIPE_OP_BACKWARD: the sequence number of the backward node it runs in...
  uint64_t fwd_thread;  // ... and the number of the thread that ran that node's forward op
  uint32_t bwd_node;    // the backward node's name (an `intern` id), 0: none
  uint32_t scope;       // what it is when not a plain op ("backward", "user", ...: an `intern` id), 0: a plain op
} TbpipeOpAttrs;

#define TBPIPE_OP_ID 1u
#define TBPIPE_OP_DEPTH 2u
#define TBPIPE_OP_PARENT 4u
#define TBPIPE_OP_SEQ 8u
#define TBPIPE_OP_BACKWARD 16u

typedef struct TbpipeCApi {
  uint32_t abi_version;  // TBPIPE_CAPI_VERSION
  uint32_t size;         // sizeof(TbpipeCApi) of the tbpipe that filled it

  // Records one event with the calling thread's combined stack, as the built-in native sources do:
  // any thread, the GIL not needed, a no-op when no session is active. Texts are UTF-8 with their
  // lengths; `attrs_json` is a JSON object's text, or empty for none.
  void (*record)(const char* kind, size_t kind_len, const char* name, size_t name_len, const char* attrs_json,
                 size_t attrs_len);

  // Gathers the calling thread's combined stack (any thread, the GIL not needed) into a new opaque
  // handle; NULL only when memory ran out. Hand it to `traceback_object` or `free_traceback`.
  void* (*gather)(int python, int native);

  // The handle as a `tbpipe._native.RawTraceback` (a new reference; NULL with an exception set).
  // Takes the handle over. Needs the GIL.
  PyObject* (*traceback_object)(void* traceback);

  // Frees a handle that will not become an object.
  void (*free_traceback)(void* traceback);

  // Fields below were added after the first release: a caller reads one only when `size` covers it
  // (TBPIPE_CAPI_HAS(api, field)).

  // Whether a session is recording (any thread, no GIL): a source can skip describing an event
  // nobody will keep. `record` checks it too.
  int (*active)(void);

  // The id of a kind or name text, for `record_interned` (any thread, no GIL). An id stays valid for
  // the life of the process, forked children included, so a source looks each text up once.
  uint32_t (*intern)(const char* text, size_t len);

  // `record` with interned kind and name: a busy source saves two lookups under a shared lock per
  // event. The stack leaves out the innermost frames of the calling module (the source's own
  // callback), as it leaves out tbpipe's.
  void (*record_interned)(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_len);

  // `record_interned` for an event that opens a scope on the calling thread, such as an op that
  // will end on it: `scope` is an address in a stack frame of this thread that stays alive until
  // `end_scope(scope)` (the op's RecordFunction object, a local of its caller). Events that open
  // scopes inside it take the outer part of their stack from this one's instead of walking it
  // again: the same stacks, gathered for less. Every scope opened must be ended on the same
  // thread, innermost first (ending an outer one ends those left open inside it). A NULL scope
  // opens none (an op that may end on another thread).
  void (*record_scoped)(uint32_t kind_id, uint32_t name_id, const char* attrs_json, size_t attrs_len, const void* scope,
                        uint32_t flags);
  void (*end_scope)(const void* scope);

  // The session's sample-rate draw for the calling thread's next event (1: keep it; 0: it is left
  // out, and counted so). A source that draws first describes only the events it keeps, and
  // records them with TBPIPE_RECORD_SAMPLED so that they are not drawn again.
  int (*sample)(void);

  // `record_scoped` for an op event whose attributes are `op`'s typed fields (the events table's
  // op_* columns) rather than JSON text: nothing is formatted per event, and the flusher writes
  // them as integer columns. Drawn by the session's sample rate unless `flags` has
  // TBPIPE_RECORD_SAMPLED.
  void (*record_op)(uint32_t kind_id, uint32_t name_id, const TbpipeOpAttrs* op, const void* scope, uint32_t flags);
} TbpipeCApi;

#define TBPIPE_RECORD_SAMPLED 1u  // `record_scoped` flag: drawn with `sample()` already, and kept
// `record_scoped` flag: the event happens inside the thread's innermost open scope (an op called by
// another op). Where the session records nested ops with their outermost op's stack (the Session
// option op_stacks="outermost"), such an event takes the stack of that scope's event (nothing is
// walked) and opens no scope, as long as no Python code ran in between; otherwise it is recorded as
// without the flag.
#define TBPIPE_RECORD_NESTED 2u

// Whether the table `api` points to has `field` (filled by a tbpipe at least as new as the field).
#define TBPIPE_CAPI_HAS(api, field) ((api)->size >= offsetof(TbpipeCApi, field) + sizeof(((TbpipeCApi*)0)->field))

#ifdef __cplusplus
}
#endif

#endif  // TBPIPE_CAPI_H_
