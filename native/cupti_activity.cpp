#include "cupti_activity.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

#include "string_table.h"

namespace tbpipe {
namespace {

namespace abi = cupti_abi;

constexpr size_t kBufferSize = size_t{4} << 20;     // per buffer CUPTI fills
constexpr size_t kBufferAlign = 8;                  // CUPTI's requirement for activity buffers
constexpr size_t kMaxFreeBuffers = 16;              // buffers kept for reuse instead of freed
constexpr size_t kMaxStoredRows = size_t{1} << 21;  // between two drains; past it rows are counted lost
constexpr size_t kMaxStoredNodes = size_t{1} << 20;
constexpr size_t kMaxNameLength = 4096;
// The smallest record CUPTI writes is longer than this: a bound on the records
// one buffer can hold, so a library that never says "no more" cannot loop us.
constexpr size_t kMinRecordSize = 16;

// Set once, from the first start (the process keeps its first libcupti).
GpuActivityFunctions g_fn;
std::once_flag g_fn_once;

std::mutex g_control;  // start, stop, flush: one at a time
std::atomic<bool> g_active{false};
std::atomic<bool> g_ever_started{false};
std::atomic<bool> g_forked_child{false};  // CUPTI is never called in a forked child
unsigned g_kinds = 0;                     // under g_control
std::atomic<int64_t> g_clock_offset_ns{0};

std::mutex g_buffers_mutex;
std::vector<uint8_t*> g_free_buffers;

// The store: rows appended by completion callbacks, swapped out by the drain.
// Only CUPTI's completion callbacks, graph resource callbacks and the drain
// take this mutex; a kernel launch never does.
std::mutex g_store_mutex;
GpuActivityDrained g_store;
struct KnownName {
  uint32_t id;
  std::string text;
};
std::unordered_map<const char*, KnownName> g_kernel_names;  // CUPTI's name pointer -> interned id

std::atomic<uint64_t> g_records{0};
std::atomic<uint64_t> g_dropped{0};
std::atomic<uint64_t> g_lost{0};
std::atomic<uint64_t> g_malformed{0};
std::atomic<uint64_t> g_buffers{0};
std::atomic<uint64_t> g_graph_nodes{0};

// CUpti_ActivityMemcpyKind and CUpti_ActivitySynchronizationType, as row names.
constexpr const char* kCopyKinds[] = {"unknown", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA",
                                      "AtoD",    "DtoA", "DtoD", "HtoH", "PtoP"};
constexpr const char* kSyncTypes[] = {"unknown", "event_synchronize", "stream_wait_event", "stream_synchronize",
                                      "context_synchronize"};
uint32_t g_copy_kind_ids[sizeof(kCopyKinds) / sizeof(kCopyKinds[0])] = {};
uint32_t g_sync_type_ids[sizeof(kSyncTypes) / sizeof(kSyncTypes[0])] = {};
uint32_t g_memset_id = 0;
uint32_t g_unknown_kernel_id = 0;

int64_t realtime_ns() {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

uint32_t intern(const char* text) { return StringTable::instance().intern_utf8(text, std::strlen(text)); }

void intern_constant_names() {
  for (size_t i = 0; i < sizeof(kCopyKinds) / sizeof(kCopyKinds[0]); ++i) g_copy_kind_ids[i] = intern(kCopyKinds[i]);
  for (size_t i = 0; i < sizeof(kSyncTypes) / sizeof(kSyncTypes[0]); ++i) g_sync_type_ids[i] = intern(kSyncTypes[i]);
  g_memset_id = intern("memset");
  g_unknown_kernel_id = intern("<unknown kernel>");
}

// The interned id of a kernel name CUPTI points at (g_store_mutex held). The
// pointer is CUPTI's and stays valid while the kernel's module is loaded; the
// text is compared as well, in case a pointer is ever reused for another name.
uint32_t kernel_name_id(const char* name) {
  if (name == nullptr) return g_unknown_kernel_id;
  const size_t length = strnlen(name, kMaxNameLength);
  if (length == 0) return g_unknown_kernel_id;
  auto hit = g_kernel_names.find(name);
  if (hit != g_kernel_names.end() && hit->second.text.size() == length &&
      std::memcmp(hit->second.text.data(), name, length) == 0) {
    return hit->second.id;
  }
  const uint32_t id = StringTable::instance().intern_utf8(name, length);
  if (g_kernel_names.size() < 65536) g_kernel_names[name] = KnownName{id, std::string(name, length)};
  return id;
}

struct Row {
  uint8_t kind = 0;
  uint32_t name_id = 0;               // set when stored; kernels: from `kernel_name`
  const char* kernel_name = nullptr;  // CUPTI's pointer, kernels only
  uint64_t start = 0, end = 0;
  uint32_t device = 0, context = 0, stream = 0, correlation_id = 0, graph_id = 0;
  uint64_t graph_node_id = 0, bytes = 0;
  int32_t grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};
  int32_t registers = -1, static_shared = -1, dynamic_shared = -1;
};

void append(const Row& row) {
  GpuActivityDrained& s = g_store;
  s.kind.push_back(row.kind);
  s.name_id.push_back(row.name_id);
  s.start_ns.push_back(static_cast<int64_t>(row.start));
  s.end_ns.push_back(static_cast<int64_t>(row.end));
  s.device.push_back(row.device);
  s.context.push_back(row.context);
  s.stream.push_back(row.stream);
  s.correlation_id.push_back(row.correlation_id);
  s.graph_id.push_back(row.graph_id);
  s.graph_node_id.push_back(row.graph_node_id);
  s.bytes.push_back(row.bytes);
  s.grid_x.push_back(row.grid[0]);
  s.grid_y.push_back(row.grid[1]);
  s.grid_z.push_back(row.grid[2]);
  s.block_x.push_back(row.block[0]);
  s.block_y.push_back(row.block[1]);
  s.block_z.push_back(row.block[2]);
  s.registers.push_back(row.registers);
  s.static_shared.push_back(row.static_shared);
  s.dynamic_shared.push_back(row.dynamic_shared);
  g_records.fetch_add(1, std::memory_order_relaxed);
}

// Copies a record's prefix out of the buffer when the buffer holds all of it.
template <typename Record>
bool read_record(const uint8_t* record, size_t available, Record* out) {
  if (available < sizeof(Record)) {
    g_malformed.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  std::memcpy(out, record, sizeof(Record));
  return true;
}

// The fields kernel, copy and set records share: when and where it ran, and what caused it.
template <typename Record>
void copy_placement(const Record& r, Row* row) {
  row->start = r.start;
  row->end = r.end;
  row->device = r.device_id;
  row->context = r.context_id;
  row->stream = r.stream_id;
  row->correlation_id = r.correlation_id;
  row->graph_id = r.graph_id;
  row->graph_node_id = r.graph_node_id;
}

// Reads one record into `row`; false when it is not one this source stores.
bool read_row(const uint8_t* record, size_t available, int32_t kind, Row* out) {
  Row& row = *out;
  switch (kind) {
    case abi::kActivityConcurrentKernel:
    case abi::kActivityKernel: {
      abi::KernelRecord r;
      if (!read_record(record, available, &r)) return false;
      row.kind = kGpuKernel;
      row.kernel_name = r.name;
      copy_placement(r, &row);
      row.grid[0] = r.grid_x;
      row.grid[1] = r.grid_y;
      row.grid[2] = r.grid_z;
      row.block[0] = r.block_x;
      row.block[1] = r.block_y;
      row.block[2] = r.block_z;
      row.registers = r.registers_per_thread;
      row.static_shared = r.static_shared_memory;
      row.dynamic_shared = r.dynamic_shared_memory;
      break;
    }
    case abi::kActivityMemcpy: {
      abi::MemcpyRecord r;
      if (!read_record(record, available, &r)) return false;
      row.kind = kGpuMemcpy;
      row.name_id = g_copy_kind_ids[r.copy_kind < sizeof(kCopyKinds) / sizeof(kCopyKinds[0]) ? r.copy_kind : 0];
      copy_placement(r, &row);
      row.bytes = r.bytes;
      break;
    }
    case abi::kActivityMemset: {
      abi::MemsetRecord r;
      if (!read_record(record, available, &r)) return false;
      row.kind = kGpuMemset;
      row.name_id = g_memset_id;
      copy_placement(r, &row);
      row.bytes = r.bytes;
      break;
    }
    case abi::kActivitySynchronization: {
      abi::SynchronizationRecord r;
      if (!read_record(record, available, &r)) return false;
      const size_t types = sizeof(kSyncTypes) / sizeof(kSyncTypes[0]);
      row.kind = kGpuSync;
      row.name_id = g_sync_type_ids[r.type >= 0 && static_cast<size_t>(r.type) < types ? r.type : 0];
      row.start = r.start;
      row.end = r.end;
      row.context = r.context_id;
      row.stream = r.stream_id;
      row.correlation_id = r.correlation_id;
      row.device = UINT32_MAX;  // a synchronization record names no device
      break;
    }
    default:
      return false;  // a kind this source never asks for (another client of the activity API may)
  }
  return true;
}

// Rows of the buffer being parsed, reused by each thread CUPTI completes buffers on.
thread_local std::vector<Row> t_rows;

// Reads every record of a buffer (CUPTI calls, no lock of ours held), then
// stores the rows under the store mutex.
void parse_buffer(uint8_t* buffer, size_t valid_size) {
  std::vector<Row>& rows = t_rows;
  rows.clear();
  void* record = nullptr;
  const uint8_t* end = buffer + valid_size;
  for (size_t count = 0; count <= valid_size / kMinRecordSize; ++count) {
    if (g_fn.next_record(buffer, valid_size, &record) != abi::kSuccess || record == nullptr) break;
    const auto* at = static_cast<const uint8_t*>(record);
    if (at < buffer || at >= end || static_cast<size_t>(end - at) < sizeof(int32_t)) {
      g_malformed.fetch_add(1, std::memory_order_relaxed);
      break;  // CUPTI pointed outside the valid bytes: trust nothing after it
    }
    int32_t kind = 0;
    std::memcpy(&kind, at, sizeof kind);
    Row row;
    if (read_row(at, static_cast<size_t>(end - at), kind, &row)) rows.push_back(row);
  }
  if (rows.empty()) return;
  std::lock_guard<std::mutex> guard(g_store_mutex);
  for (Row& row : rows) {
    if (g_store.kind.size() >= kMaxStoredRows) {
      g_lost.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    if (row.kind == kGpuKernel) row.name_id = kernel_name_id(row.kernel_name);
    append(row);
  }
}

void recycle(uint8_t* buffer) {
  {
    std::lock_guard<std::mutex> guard(g_buffers_mutex);
    if (g_free_buffers.size() < kMaxFreeBuffers) {
      g_free_buffers.push_back(buffer);
      return;
    }
  }
  std::free(buffer);
}

// CUPTI asks for an empty buffer: on the thread whose activity filled the last
// one (a launching thread, once per few thousand records) or its own.
void on_buffer_request(uint8_t** buffer, size_t* size, size_t* max_records) {
  if (buffer == nullptr || size == nullptr) return;
  if (max_records != nullptr) *max_records = 0;  // as many as fit
  uint8_t* out = nullptr;
  {
    std::lock_guard<std::mutex> guard(g_buffers_mutex);
    if (!g_free_buffers.empty()) {
      out = g_free_buffers.back();
      g_free_buffers.pop_back();
    }
  }
  if (out == nullptr) out = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferSize));
  *buffer = out;
  *size = out != nullptr ? kBufferSize : 0;  // no memory: CUPTI drops records, and counts them
}

// CUPTI hands a buffer back; `valid_size` bytes of it hold records.
void on_buffer_complete(void* context, uint32_t stream_id, uint8_t* buffer, size_t size, size_t valid_size) {
  if (buffer == nullptr) return;
  g_buffers.fetch_add(1, std::memory_order_relaxed);
  if (valid_size > size) valid_size = size;
  if (valid_size > 0 && g_fn.next_record != nullptr) parse_buffer(buffer, valid_size);
  size_t dropped = 0;
  if (g_fn.dropped_records != nullptr && g_fn.dropped_records(context, stream_id, &dropped) == abi::kSuccess) {
    g_dropped.fetch_add(dropped, std::memory_order_relaxed);
  }
  recycle(buffer);
}

int64_t measure_clock_offset() {
  if (g_fn.timestamp == nullptr) return 0;
  int64_t best_window = INT64_MAX;
  int64_t offset = 0;
  for (int i = 0; i < 8; ++i) {
    const int64_t before = realtime_ns();
    uint64_t cupti = 0;
    if (g_fn.timestamp(&cupti) != abi::kSuccess) break;
    const int64_t after = realtime_ns();
    if (after - before < best_window) {
      best_window = after - before;
      offset = before + (after - before) / 2 - static_cast<int64_t>(cupti);
    }
  }
  return offset;
}

struct KindRequest {
  unsigned bit;
  int cupti_kind;
  const char* name;
};
constexpr KindRequest kKinds[] = {
    {kGpuKernel, abi::kActivityConcurrentKernel, "kernel"},
    {kGpuMemcpy, abi::kActivityMemcpy, "memcpy"},
    {kGpuMemset, abi::kActivityMemset, "memset"},
    {kGpuSync, abi::kActivitySynchronization, "sync"},
};

void clear_store() {
  GpuActivityDrained empty;
  std::swap(g_store, empty);
}

void after_fork_in_child() {
  new (&g_store_mutex) std::mutex();
  new (&g_buffers_mutex) std::mutex();
  new (&g_control) std::mutex();
  g_forked_child.store(true, std::memory_order_relaxed);
  clear_store();  // the parent's rows: the parent writes them
}

}  // namespace

GpuActivityStartResult gpu_activity_start(const GpuActivityFunctions& functions, unsigned kinds) {
  static const int registered = pthread_atfork(nullptr, nullptr, after_fork_in_child);
  (void)registered;
  std::call_once(g_fn_once, [&functions]() { g_fn = functions; });
  std::lock_guard<std::mutex> guard(g_control);
  GpuActivityStartResult result;
  result.clock_offset_ns = g_clock_offset_ns.load(std::memory_order_relaxed);
  if (g_active.load(std::memory_order_acquire)) {
    result.started = true;
    result.kinds = g_kinds;
    return result;
  }
  if (g_forked_child.load(std::memory_order_relaxed)) {
    result.message = "GPU activity is not recorded in a forked child";
    return result;
  }
  if (g_fn.register_callbacks == nullptr || g_fn.enable == nullptr || g_fn.next_record == nullptr ||
      g_fn.flush_all == nullptr) {
    result.message = "this libcupti has no activity API (cuptiActivityRegisterCallbacks/Enable/GetNextRecord/FlushAll)";
    return result;
  }
  intern_constant_names();
  {
    std::lock_guard<std::mutex> store_guard(g_store_mutex);
    clear_store();  // rows of an earlier session that its last drain did not take
  }
  const abi::CUptiResult registered_callbacks = g_fn.register_callbacks(on_buffer_request, on_buffer_complete);
  if (registered_callbacks != abi::kSuccess) {
    result.message = "cuptiActivityRegisterCallbacks failed (" + std::to_string(registered_callbacks) + ")";
    return result;
  }
  g_clock_offset_ns.store(measure_clock_offset(), std::memory_order_relaxed);
  result.clock_offset_ns = g_clock_offset_ns.load(std::memory_order_relaxed);
  std::string refused;
  for (const KindRequest& kind : kKinds) {
    if ((kinds & kind.bit) == 0) continue;
    if (g_fn.enable(kind.cupti_kind) == abi::kSuccess) {
      result.kinds |= kind.bit;
    } else {
      refused += refused.empty() ? kind.name : std::string(", ") + kind.name;
    }
  }
  if (!refused.empty()) result.message = "CUPTI refused the activity kinds " + refused;
  if (result.kinds == 0) return result;
  g_kinds = result.kinds;
  g_ever_started.store(true, std::memory_order_relaxed);
  g_active.store(true, std::memory_order_release);
  result.started = true;
  return result;
}

void gpu_activity_stop() {
  std::lock_guard<std::mutex> guard(g_control);
  if (!g_active.load(std::memory_order_acquire)) return;
  g_active.store(false, std::memory_order_release);
  if (g_forked_child.load(std::memory_order_relaxed)) return;
  if (g_fn.disable != nullptr) {
    for (const KindRequest& kind : kKinds) {
      if ((g_kinds & kind.bit) != 0) g_fn.disable(kind.cupti_kind);
    }
  }
  // Completed buffers first; then the rest, whose last records may lack an
  // end time if the device is still running them (stored with no duration).
  g_fn.flush_all(0);
  g_fn.flush_all(abi::kFlushForced);
  g_kinds = 0;
}

void gpu_activity_flush() {
  if (!g_active.load(std::memory_order_acquire) || g_forked_child.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> guard(g_control);
  if (g_active.load(std::memory_order_acquire)) g_fn.flush_all(0);
}

bool gpu_activity_active() { return g_active.load(std::memory_order_acquire); }

void gpu_activity_graph_node(void* graph, void* node, void* original, int node_type, uint32_t correlation_id) {
  if (!g_active.load(std::memory_order_acquire) || node == nullptr || g_fn.graph_node_id == nullptr) return;
  uint64_t node_id = 0;
  if (g_fn.graph_node_id(node, &node_id) != abi::kSuccess) return;
  uint64_t original_id = 0;
  if (original != nullptr && g_fn.graph_node_id(original, &original_id) != abi::kSuccess) original_id = 0;
  uint32_t graph_id = 0;
  if (graph != nullptr && g_fn.graph_id != nullptr && g_fn.graph_id(graph, &graph_id) != abi::kSuccess) graph_id = 0;
  const int64_t thread_id = static_cast<int64_t>(syscall(SYS_gettid));
  const int64_t now = realtime_ns();
  std::lock_guard<std::mutex> guard(g_store_mutex);
  GpuActivityDrained& s = g_store;
  if (s.node_id.size() >= kMaxStoredNodes) {
    g_lost.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  s.node_id.push_back(node_id);
  s.original_node_id.push_back(original_id);
  s.node_graph_id.push_back(graph_id);
  s.node_correlation_id.push_back(correlation_id);
  s.node_type.push_back(node_type);
  s.node_thread_id.push_back(thread_id);
  s.node_ts_ns.push_back(now);
  g_graph_nodes.fetch_add(1, std::memory_order_relaxed);
}

void gpu_activity_drain(GpuActivityDrained* out) {
  {
    std::lock_guard<std::mutex> guard(g_store_mutex);
    std::swap(*out, g_store);
    clear_store();
  }
  const int64_t offset = g_clock_offset_ns.load(std::memory_order_relaxed);
  for (int64_t& t : out->start_ns) t = t == 0 ? 0 : t + offset;
  for (int64_t& t : out->end_ns) t = t == 0 ? 0 : t + offset;
  out->counters = gpu_activity_counters();
  out->active = g_ever_started.load(std::memory_order_relaxed);
  out->clock_offset_ns = offset;
}

GpuActivityCounters gpu_activity_counters() {
  GpuActivityCounters c;
  c.records = g_records.load(std::memory_order_relaxed);
  c.dropped = g_dropped.load(std::memory_order_relaxed);
  c.lost = g_lost.load(std::memory_order_relaxed);
  c.malformed = g_malformed.load(std::memory_order_relaxed);
  c.buffers = g_buffers.load(std::memory_order_relaxed);
  c.graph_nodes = g_graph_nodes.load(std::memory_order_relaxed);
  return c;
}

void gpu_activity_declared_abi(std::vector<std::pair<std::string, uint64_t>>* out) {
  using namespace abi;
  const std::pair<std::string, uint64_t> entries[] = {
      {"CUPTI_CB_DOMAIN_RESOURCE", kDomainResource},
      {"CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED", kGraphNodeCreated},
      {"CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED", kGraphNodeCloned},
      {"CUPTI_API_EXIT", static_cast<uint64_t>(kApiExit)},
      {"offsetof(CUpti_ResourceData, resourceDescriptor)", offsetof(ResourceData, resource_descriptor)},
      {"offsetof(CUpti_GraphData, graph)", offsetof(GraphData, graph)},
      {"offsetof(CUpti_GraphData, node)", offsetof(GraphData, node)},
      {"offsetof(CUpti_GraphData, originalNode)", offsetof(GraphData, original_node)},
      {"offsetof(CUpti_GraphData, nodeType)", offsetof(GraphData, node_type)},
      {"CUPTI_ERROR_MAX_LIMIT_REACHED", static_cast<uint64_t>(kErrorMaxLimitReached)},
      {"CUPTI_ACTIVITY_FLAG_FLUSH_FORCED", kFlushForced},
      {"CUPTI_ACTIVITY_KIND_MEMCPY", kActivityMemcpy},
      {"CUPTI_ACTIVITY_KIND_MEMSET", kActivityMemset},
      {"CUPTI_ACTIVITY_KIND_KERNEL", kActivityKernel},
      {"CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL", kActivityConcurrentKernel},
      {"CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", kActivitySynchronization},
      {"offsetof(CUpti_ActivityKernel9, registersPerThread)", offsetof(KernelRecord, registers_per_thread)},
      {"offsetof(CUpti_ActivityKernel9, start)", offsetof(KernelRecord, start)},
      {"offsetof(CUpti_ActivityKernel9, end)", offsetof(KernelRecord, end)},
      {"offsetof(CUpti_ActivityKernel9, deviceId)", offsetof(KernelRecord, device_id)},
      {"offsetof(CUpti_ActivityKernel9, contextId)", offsetof(KernelRecord, context_id)},
      {"offsetof(CUpti_ActivityKernel9, streamId)", offsetof(KernelRecord, stream_id)},
      {"offsetof(CUpti_ActivityKernel9, gridX)", offsetof(KernelRecord, grid_x)},
      {"offsetof(CUpti_ActivityKernel9, blockZ)", offsetof(KernelRecord, block_z)},
      {"offsetof(CUpti_ActivityKernel9, staticSharedMemory)", offsetof(KernelRecord, static_shared_memory)},
      {"offsetof(CUpti_ActivityKernel9, dynamicSharedMemory)", offsetof(KernelRecord, dynamic_shared_memory)},
      {"offsetof(CUpti_ActivityKernel9, correlationId)", offsetof(KernelRecord, correlation_id)},
      {"offsetof(CUpti_ActivityKernel9, name)", offsetof(KernelRecord, name)},
      {"offsetof(CUpti_ActivityKernel9, graphNodeId)", offsetof(KernelRecord, graph_node_id)},
      {"offsetof(CUpti_ActivityKernel9, graphId)", offsetof(KernelRecord, graph_id)},
      {"offsetof(CUpti_ActivityMemcpy5, copyKind)", offsetof(MemcpyRecord, copy_kind)},
      {"offsetof(CUpti_ActivityMemcpy5, bytes)", offsetof(MemcpyRecord, bytes)},
      {"offsetof(CUpti_ActivityMemcpy5, start)", offsetof(MemcpyRecord, start)},
      {"offsetof(CUpti_ActivityMemcpy5, end)", offsetof(MemcpyRecord, end)},
      {"offsetof(CUpti_ActivityMemcpy5, deviceId)", offsetof(MemcpyRecord, device_id)},
      {"offsetof(CUpti_ActivityMemcpy5, streamId)", offsetof(MemcpyRecord, stream_id)},
      {"offsetof(CUpti_ActivityMemcpy5, correlationId)", offsetof(MemcpyRecord, correlation_id)},
      {"offsetof(CUpti_ActivityMemcpy5, graphNodeId)", offsetof(MemcpyRecord, graph_node_id)},
      {"offsetof(CUpti_ActivityMemcpy5, graphId)", offsetof(MemcpyRecord, graph_id)},
      {"offsetof(CUpti_ActivityMemset4, bytes)", offsetof(MemsetRecord, bytes)},
      {"offsetof(CUpti_ActivityMemset4, start)", offsetof(MemsetRecord, start)},
      {"offsetof(CUpti_ActivityMemset4, end)", offsetof(MemsetRecord, end)},
      {"offsetof(CUpti_ActivityMemset4, deviceId)", offsetof(MemsetRecord, device_id)},
      {"offsetof(CUpti_ActivityMemset4, streamId)", offsetof(MemsetRecord, stream_id)},
      {"offsetof(CUpti_ActivityMemset4, correlationId)", offsetof(MemsetRecord, correlation_id)},
      {"offsetof(CUpti_ActivityMemset4, graphNodeId)", offsetof(MemsetRecord, graph_node_id)},
      {"offsetof(CUpti_ActivityMemset4, graphId)", offsetof(MemsetRecord, graph_id)},
      {"offsetof(CUpti_ActivitySynchronization, type)", offsetof(SynchronizationRecord, type)},
      {"offsetof(CUpti_ActivitySynchronization, start)", offsetof(SynchronizationRecord, start)},
      {"offsetof(CUpti_ActivitySynchronization, end)", offsetof(SynchronizationRecord, end)},
      {"offsetof(CUpti_ActivitySynchronization, correlationId)", offsetof(SynchronizationRecord, correlation_id)},
      {"offsetof(CUpti_ActivitySynchronization, streamId)", offsetof(SynchronizationRecord, stream_id)},
  };
  for (const auto& entry : entries) out->push_back(entry);
}

}  // namespace tbpipe
