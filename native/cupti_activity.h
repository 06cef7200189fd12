// GPU activity through the CUPTI activity API (the `cuda` source's durations).
//
// CUPTI fills buffers that this module hands out with activity records:
// kernel executions, memory copies and sets, synchronizations, each with GPU
// start and end times and the correlation id of the API call that caused it
// (the id the launch callbacks record as an event attribute: the ingest joins
// the two). Buffers come back full, or when flushed, usually on a thread of
// CUPTI's own; the records are copied out into a columnar store under a mutex
// no launching thread ever takes, and the buffer is reused. The flush thread
// drains the store about once a second, after asking CUPTI for every buffer
// whose records are complete, so a killed process loses at most what its last
// flush interval held.
//
// CUDA graphs: every graph node CUPTI reports created or cloned is kept with
// the correlation id of the launch that was being recorded on that thread
// when the node appeared (a launch captured into the graph), so a replayed
// kernel's graphNodeId leads back through its clones to the captured launch.
//
// Nothing here throws into CUPTI or reads a record past the valid bytes of
// its buffer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cupti_abi.h"

namespace tbpipe {

// The CUPTI functions this module calls (null when the library lacks one).
struct GpuActivityFunctions {
  cupti_abi::ActivityRegisterCallbacksFn register_callbacks = nullptr;
  cupti_abi::ActivityEnableFn enable = nullptr;
  cupti_abi::ActivityEnableFn disable = nullptr;
  cupti_abi::ActivityGetNextRecordFn next_record = nullptr;
  cupti_abi::ActivityFlushAllFn flush_all = nullptr;
  cupti_abi::ActivityGetNumDroppedRecordsFn dropped_records = nullptr;
  cupti_abi::GetTimestampFn timestamp = nullptr;
  cupti_abi::GetGraphNodeIdFn graph_node_id = nullptr;
  cupti_abi::GetGraphIdFn graph_id = nullptr;
};

// Kinds of activity, as bits of a request and as the `kind` of a stored row.
enum GpuActivityKind : uint8_t {
  kGpuKernel = 1,
  kGpuMemcpy = 2,
  kGpuMemset = 4,
  kGpuSync = 8,
};

struct GpuActivityStartResult {
  bool started = false;
  unsigned kinds = 0;           // GpuActivityKind bits enabled
  std::string message;          // why not started, or which kinds CUPTI refused
  int64_t clock_offset_ns = 0;  // CLOCK_REALTIME minus CUPTI's clock at start
};

struct GpuActivityCounters {
  uint64_t records = 0;      // records stored (all kinds)
  uint64_t dropped = 0;      // records CUPTI reported dropped (no buffer in time)
  uint64_t lost = 0;         // records not stored: the store was full between two drains
  uint64_t malformed = 0;    // records shorter than their layout, or of a kind not asked for
  uint64_t buffers = 0;      // buffers completed
  uint64_t graph_nodes = 0;  // graph node rows stored
};

// Everything drained at once, one vector per column. Times are CLOCK_REALTIME
// nanoseconds (CUPTI's clock moved by the offset measured at start), 0 when
// CUPTI could not time the activity.
struct GpuActivityDrained {
  std::vector<uint8_t> kind;      // GpuActivityKind
  std::vector<uint32_t> name_id;  // StringTable id: kernel name, copy kind, "memset", sync type
  std::vector<int64_t> start_ns, end_ns;
  std::vector<uint32_t> device, context, stream, correlation_id, graph_id;
  std::vector<uint64_t> graph_node_id, bytes;
  std::vector<int32_t> grid_x, grid_y, grid_z, block_x, block_y, block_z;
  std::vector<int32_t> registers, static_shared, dynamic_shared;
  // graph nodes
  std::vector<uint64_t> node_id, original_node_id;
  std::vector<uint32_t> node_graph_id, node_correlation_id;
  std::vector<int32_t> node_type;
  std::vector<int64_t> node_thread_id, node_ts_ns;
  GpuActivityCounters counters;  // totals since the process started
  bool active = false;           // activity was started in this process
  int64_t clock_offset_ns = 0;
};

// Registers the buffer callbacks and enables `kinds` (GpuActivityKind bits).
GpuActivityStartResult gpu_activity_start(const GpuActivityFunctions& functions, unsigned kinds);
// Hands every completed buffer over (cuptiActivityFlushAll), then forced
// (incomplete records too), and disables the kinds. Records stay in the store
// for the last drain.
void gpu_activity_stop();
// Asks CUPTI for every buffer whose records are complete (a no-op when
// activity is not on); the flush thread calls it before each drain.
void gpu_activity_flush();
bool gpu_activity_active();
void gpu_activity_drain(GpuActivityDrained* out);
GpuActivityCounters gpu_activity_counters();

// A resource callback: graph node `node` was created (original null) or
// cloned from `original`, while the launch with `correlation_id` (0: none)
// was being recorded on this thread.
void gpu_activity_graph_node(void* graph, void* node, void* original, int node_type, uint32_t correlation_id);

// The declared record layouts, for the header check (cupti_declared_abi()).
void gpu_activity_declared_abi(std::vector<std::pair<std::string, uint64_t>>* out);

}  // namespace tbpipe
