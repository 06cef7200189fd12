// The slice of the CUPTI ABI the `cuda` source uses, declared here because CI
// has no CUDA headers. Values from cupti_result.h, cupti_callbacks.h,
// cupti_activity.h, cupti_runtime_cbid.h, cupti_driver_cbid.h and the
// generated_*_meta.h parameter structs; tests/test_sources_cuda.py compiles a
// check against the real headers wherever they are installed
// (cupti_declared_abi() lists what it compares).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tbpipe {
namespace cupti_abi {

using CUptiResult = int;
using CallbackDomain = int;
using CallbackId = uint32_t;
using SubscriberHandle = void*;
using CallbackFunc = void (*)(void* userdata, CallbackDomain domain, CallbackId cbid, const void* cbdata);

constexpr CUptiResult kSuccess = 0;
constexpr CUptiResult kErrorMultipleSubscribers = 39;  // CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED

constexpr CallbackDomain kDomainDriver = 1;   // CUPTI_CB_DOMAIN_DRIVER_API
constexpr CallbackDomain kDomainRuntime = 2;  // CUPTI_CB_DOMAIN_RUNTIME_API
constexpr int kApiEnter = 0;                  // CUPTI_API_ENTER
constexpr int kApiExit = 1;                   // CUPTI_API_EXIT

// CUpti_CallbackData
struct CallbackData {
  int callback_site;
  const char* function_name;
  const void* function_params;
  void* function_return_value;
  const char* symbol_name;
  void* context;
  uint32_t context_uid;
  uint64_t* correlation_data;
  uint32_t correlation_id;
};

// CUpti_SubscriberParams (cuptiSubscribe_v2, CUDA 13+)
struct SubscriberParams {
  size_t struct_size;
  const char* subscriber_name;
  char* old_subscriber_name;
  size_t old_subscriber_size;
};
constexpr size_t kOldSubscriberNameSize = 64;  // CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN

struct Dim3 {
  unsigned x, y, z;
};

// cudaLaunchKernel_v7000_params and the _ptsz, cooperative and CUDA 13
// __cudaLaunchKernel variants: the same layout.
struct RuntimeLaunchParams {
  const void* func;
  Dim3 grid;
  Dim3 block;
  void** args;
  size_t shared_mem;
  void* stream;
};

// cudaLaunchConfig_t, and cudaLaunchKernelExC_v11060_params (+ _ptsz).
struct RuntimeLaunchConfig {
  Dim3 grid;
  Dim3 block;
  size_t dynamic_shared_mem;
  void* stream;
  void* attrs;
  unsigned num_attrs;
};
struct RuntimeLaunchExParams {
  const RuntimeLaunchConfig* config;
  const void* func;
  void** args;
};

// cudaGraphLaunch_v10000_params and cuGraphLaunch_params (+ _ptsz).
struct GraphLaunchParams {
  void* graph_exec;
  void* stream;
};

// cuLaunchKernel_params (+ _ptsz); cuLaunchCooperativeKernel_params shares
// this prefix (it has no `extra`, which is never read).
struct DriverLaunchParams {
  void* function;
  unsigned grid_x, grid_y, grid_z;
  unsigned block_x, block_y, block_z;
  unsigned shared_mem;
  void* stream;
};

// CUlaunchConfig, and cuLaunchKernelEx_params (+ _ptsz).
struct DriverLaunchConfig {
  unsigned grid_x, grid_y, grid_z;
  unsigned block_x, block_y, block_z;
  unsigned shared_mem;
  void* stream;
  void* attrs;
  unsigned num_attrs;
};
struct DriverLaunchExParams {
  const DriverLaunchConfig* config;
  void* function;
  void** kernel_params;
  void** extra;
};

// ---- resource callbacks (cupti_callbacks.h): graph nodes as they are made and cloned

constexpr CallbackDomain kDomainResource = 3;  // CUPTI_CB_DOMAIN_RESOURCE
constexpr CallbackId kGraphNodeCreated = 13;   // CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED
constexpr CallbackId kGraphNodeCloned = 20;    // CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED

// CUpti_ResourceData: what a resource callback receives.
struct ResourceData {
  void* context;
  void* stream;  // union resourceHandle
  void* resource_descriptor;
};

// CUpti_GraphData: the resource descriptor of the graph callbacks.
struct GraphData {
  void* graph;
  void* original_graph;
  void* node;
  void* original_node;
  int node_type;  // CUgraphNodeType
  void* dependency;
  void* graph_exec;
};

// ---- the activity API (cupti_activity.h)

constexpr CUptiResult kErrorMaxLimitReached = 12;  // CUPTI_ERROR_MAX_LIMIT_REACHED: no more records
constexpr uint32_t kFlushForced = 1;               // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED

// CUpti_ActivityKind values this source enables or reads.
constexpr int kActivityMemcpy = 1;             // CUPTI_ACTIVITY_KIND_MEMCPY
constexpr int kActivityMemset = 2;             // CUPTI_ACTIVITY_KIND_MEMSET
constexpr int kActivityKernel = 3;             // CUPTI_ACTIVITY_KIND_KERNEL (serializing; never enabled)
constexpr int kActivityConcurrentKernel = 10;  // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
constexpr int kActivitySynchronization = 38;   // CUPTI_ACTIVITY_KIND_SYNCHRONIZATION

// The records are read through prefixes of their layouts: a newer CUPTI
// appends fields to a record (CUpti_ActivityKernel9, 10, 11, ...), it does not
// move the ones before. A record shorter than the prefix is not read.
#pragma pack(push, 1)
// CUpti_ActivityKernel9 up to graphId.
struct KernelRecord {
  int32_t kind;
  uint8_t cache_config;
  uint8_t shared_memory_config;
  uint16_t registers_per_thread;
  int32_t partitioned_global_cache_requested;
  int32_t partitioned_global_cache_executed;
  uint64_t start;
  uint64_t end;
  uint64_t completed;
  uint32_t device_id;
  uint32_t context_id;
  uint32_t stream_id;
  int32_t grid_x, grid_y, grid_z;
  int32_t block_x, block_y, block_z;
  int32_t static_shared_memory;
  int32_t dynamic_shared_memory;
  uint32_t local_memory_per_thread;
  uint32_t local_memory_total;
  uint32_t correlation_id;
  int64_t grid_id;
  const char* name;
  void* reserved0;
  uint64_t queued;
  uint64_t submitted;
  uint8_t launch_type;
  uint8_t shared_memory_carveout_requested_flag;
  uint8_t shared_memory_carveout_requested;
  uint8_t padding;
  uint32_t shared_memory_executed;
  uint64_t graph_node_id;
  int32_t shmem_limit_config;
  uint32_t graph_id;
};

// CUpti_ActivityMemcpy5 up to graphId (64-bit layout).
struct MemcpyRecord {
  int32_t kind;
  uint8_t copy_kind;
  uint8_t src_kind;
  uint8_t dst_kind;
  uint8_t flags;
  uint64_t bytes;
  uint64_t start;
  uint64_t end;
  uint32_t device_id;
  uint32_t context_id;
  uint32_t stream_id;
  uint32_t correlation_id;
  uint32_t runtime_correlation_id;
  uint32_t pad;
  void* reserved0;
  uint64_t graph_node_id;
  uint32_t graph_id;
};

// CUpti_ActivityMemset4 up to graphId (64-bit layout).
struct MemsetRecord {
  int32_t kind;
  uint32_t value;
  uint64_t bytes;
  uint64_t start;
  uint64_t end;
  uint32_t device_id;
  uint32_t context_id;
  uint32_t stream_id;
  uint32_t correlation_id;
  uint16_t flags;
  uint16_t memory_kind;
  uint32_t pad;
  void* reserved0;
  uint64_t graph_node_id;
  uint32_t graph_id;
};

// CUpti_ActivitySynchronization.
struct SynchronizationRecord {
  int32_t kind;
  int32_t type;  // CUpti_ActivitySynchronizationType
  uint64_t start;
  uint64_t end;
  uint32_t correlation_id;
  uint32_t context_id;
  uint32_t stream_id;
  uint32_t cuda_event_id;
};
#pragma pack(pop)

using SubscribeFn = CUptiResult (*)(SubscriberHandle*, CallbackFunc, void*);
using SubscribeV2Fn = CUptiResult (*)(SubscriberHandle*, CallbackFunc, void*, SubscriberParams*);
using UnsubscribeFn = CUptiResult (*)(SubscriberHandle);
using EnableCallbackFn = CUptiResult (*)(uint32_t, SubscriberHandle, CallbackDomain, CallbackId);
using GetResultStringFn = CUptiResult (*)(CUptiResult, const char**);
using GetDeviceIdFn = CUptiResult (*)(void* context, uint32_t* device);
using GetStreamIdExFn = CUptiResult (*)(void* context, void* stream, uint8_t per_thread, uint32_t* id);
using FuncGetNameFn = int (*)(const char** name, void* function);  // libcuda's cuFuncGetName (12.3+)
// Activity buffers: CUPTI asks for an empty buffer and hands it back full.
using BufferRequestFn = void (*)(uint8_t** buffer, size_t* size, size_t* max_records);
using BufferCompleteFn = void (*)(void* context, uint32_t stream_id, uint8_t* buffer, size_t size, size_t valid_size);
using ActivityRegisterCallbacksFn = CUptiResult (*)(BufferRequestFn, BufferCompleteFn);
using ActivityEnableFn = CUptiResult (*)(int kind);
using ActivityGetNextRecordFn = CUptiResult (*)(uint8_t* buffer, size_t valid_size, void** record);
using ActivityFlushAllFn = CUptiResult (*)(uint32_t flag);
using ActivityGetNumDroppedRecordsFn = CUptiResult (*)(void* context, uint32_t stream_id, size_t* dropped);
using GetTimestampFn = CUptiResult (*)(uint64_t* timestamp);
using GetGraphNodeIdFn = CUptiResult (*)(void* node, uint64_t* id);
using GetGraphIdFn = CUptiResult (*)(void* graph, uint32_t* id);

}  // namespace cupti_abi
}  // namespace tbpipe
