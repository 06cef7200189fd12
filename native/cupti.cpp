#include "cupti.h"

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <mutex>
#include <utility>

#include "cupti_abi.h"
#include "cupti_activity.h"
#include "recorder.h"
#include "string_table.h"
#include "unwind.h"

namespace tbpipe {
namespace {

namespace abi = cupti_abi;

enum class Layout : uint8_t {
  kRuntimeLaunch,
  kRuntimeLaunchEx,
  kDriverLaunch,
  kDriverLaunchEx,
  kGraph,
  kNoParams,  // legacy launches whose parameters carry no grid
  kMemcpy,    // memory copies and sets: no parameters read, the API names the event
  kMemset,
};

struct LaunchCallback {
  abi::CallbackDomain domain;
  abi::CallbackId cbid;
  Layout layout;
  bool per_thread_stream;
  const char* api;
  const char* cbid_name;  // the enumerator in NVIDIA's header, for the layout test
};

// Every launch entry point of the runtime and driver APIs. cbids that an older
// CUPTI does not know are refused by cuptiEnableCallback and skipped.
constexpr LaunchCallback kLaunchCallbacks[] = {
    {abi::kDomainRuntime, 211, Layout::kRuntimeLaunch, false, "cudaLaunchKernel",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000"},
    {abi::kDomainRuntime, 214, Layout::kRuntimeLaunch, true, "cudaLaunchKernel_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000"},
    {abi::kDomainRuntime, 269, Layout::kRuntimeLaunch, false, "cudaLaunchCooperativeKernel",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000"},
    {abi::kDomainRuntime, 270, Layout::kRuntimeLaunch, true, "cudaLaunchCooperativeKernel_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000"},
    {abi::kDomainRuntime, 430, Layout::kRuntimeLaunchEx, false, "cudaLaunchKernelExC",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060"},
    {abi::kDomainRuntime, 431, Layout::kRuntimeLaunchEx, true, "cudaLaunchKernelExC_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060"},
    {abi::kDomainRuntime, 505, Layout::kRuntimeLaunch, false, "__cudaLaunchKernel",  // <<<>>> in CUDA 13
     "CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000"},
    {abi::kDomainRuntime, 506, Layout::kRuntimeLaunch, true, "__cudaLaunchKernel_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000"},
    {abi::kDomainRuntime, 13, Layout::kNoParams, false, "cudaLaunch", "CUPTI_RUNTIME_TRACE_CBID_cudaLaunch_v3020"},
    {abi::kDomainRuntime, 213, Layout::kNoParams, true, "cudaLaunch_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaLaunch_ptsz_v7000"},
    {abi::kDomainRuntime, 311, Layout::kGraph, false, "cudaGraphLaunch",
     "CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000"},
    {abi::kDomainRuntime, 312, Layout::kGraph, true, "cudaGraphLaunch_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000"},
    {abi::kDomainDriver, 307, Layout::kDriverLaunch, false, "cuLaunchKernel", "CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel"},
    {abi::kDomainDriver, 442, Layout::kDriverLaunch, true, "cuLaunchKernel_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz"},
    {abi::kDomainDriver, 477, Layout::kDriverLaunch, false, "cuLaunchCooperativeKernel",
     "CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel"},
    {abi::kDomainDriver, 478, Layout::kDriverLaunch, true, "cuLaunchCooperativeKernel_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz"},
    {abi::kDomainDriver, 652, Layout::kDriverLaunchEx, false, "cuLaunchKernelEx",
     "CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx"},
    {abi::kDomainDriver, 653, Layout::kDriverLaunchEx, true, "cuLaunchKernelEx_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz"},
    {abi::kDomainDriver, 115, Layout::kNoParams, false, "cuLaunch", "CUPTI_DRIVER_TRACE_CBID_cuLaunch"},
    {abi::kDomainDriver, 116, Layout::kNoParams, false, "cuLaunchGrid", "CUPTI_DRIVER_TRACE_CBID_cuLaunchGrid"},
    {abi::kDomainDriver, 117, Layout::kNoParams, false, "cuLaunchGridAsync",
     "CUPTI_DRIVER_TRACE_CBID_cuLaunchGridAsync"},
    {abi::kDomainDriver, 514, Layout::kGraph, false, "cuGraphLaunch", "CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch"},
    {abi::kDomainDriver, 515, Layout::kGraph, true, "cuGraphLaunch_ptsz", "CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz"},
};

// Memory copies and sets, recorded (as `memcpy` / `memset` events) only while
// GPU activity is recorded: their activity records need a site to join.
constexpr LaunchCallback kTransferCallbacks[] = {
    {abi::kDomainRuntime, 31, Layout::kMemcpy, false, "cudaMemcpy", "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020"},
    {abi::kDomainRuntime, 32, Layout::kMemcpy, false, "cudaMemcpy2D", "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_v3020"},
    {abi::kDomainRuntime, 39, Layout::kMemcpy, false, "cudaMemcpyToSymbol",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_v3020"},
    {abi::kDomainRuntime, 40, Layout::kMemcpy, false, "cudaMemcpyFromSymbol",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_v3020"},
    {abi::kDomainRuntime, 41, Layout::kMemcpy, false, "cudaMemcpyAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020"},
    {abi::kDomainRuntime, 44, Layout::kMemcpy, false, "cudaMemcpy2DAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_v3020"},
    {abi::kDomainRuntime, 47, Layout::kMemcpy, false, "cudaMemcpyToSymbolAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_v3020"},
    {abi::kDomainRuntime, 48, Layout::kMemcpy, false, "cudaMemcpyFromSymbolAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_v3020"},
    {abi::kDomainRuntime, 144, Layout::kMemcpy, false, "cudaMemcpy3D", "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_v3020"},
    {abi::kDomainRuntime, 145, Layout::kMemcpy, false, "cudaMemcpy3DAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_v3020"},
    {abi::kDomainRuntime, 160, Layout::kMemcpy, false, "cudaMemcpyPeer",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeer_v4000"},
    {abi::kDomainRuntime, 161, Layout::kMemcpy, false, "cudaMemcpyPeerAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeerAsync_v4000"},
    {abi::kDomainRuntime, 215, Layout::kMemcpy, true, "cudaMemcpy_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_ptds_v7000"},
    {abi::kDomainRuntime, 216, Layout::kMemcpy, true, "cudaMemcpy2D_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_ptds_v7000"},
    {abi::kDomainRuntime, 223, Layout::kMemcpy, true, "cudaMemcpyToSymbol_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_ptds_v7000"},
    {abi::kDomainRuntime, 224, Layout::kMemcpy, true, "cudaMemcpyFromSymbol_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_ptds_v7000"},
    {abi::kDomainRuntime, 225, Layout::kMemcpy, true, "cudaMemcpyAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 228, Layout::kMemcpy, true, "cudaMemcpy2DAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 231, Layout::kMemcpy, true, "cudaMemcpyToSymbolAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 232, Layout::kMemcpy, true, "cudaMemcpyFromSymbolAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 245, Layout::kMemcpy, true, "cudaMemcpy3D_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_ptds_v7000"},
    {abi::kDomainRuntime, 246, Layout::kMemcpy, true, "cudaMemcpy3DAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 49, Layout::kMemset, false, "cudaMemset", "CUPTI_RUNTIME_TRACE_CBID_cudaMemset_v3020"},
    {abi::kDomainRuntime, 50, Layout::kMemset, false, "cudaMemset2D", "CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_v3020"},
    {abi::kDomainRuntime, 51, Layout::kMemset, false, "cudaMemsetAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020"},
    {abi::kDomainRuntime, 52, Layout::kMemset, false, "cudaMemset2DAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_v3020"},
    {abi::kDomainRuntime, 142, Layout::kMemset, false, "cudaMemset3D", "CUPTI_RUNTIME_TRACE_CBID_cudaMemset3D_v3020"},
    {abi::kDomainRuntime, 143, Layout::kMemset, false, "cudaMemset3DAsync",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset3DAsync_v3020"},
    {abi::kDomainRuntime, 233, Layout::kMemset, true, "cudaMemset_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset_ptds_v7000"},
    {abi::kDomainRuntime, 234, Layout::kMemset, true, "cudaMemset2D_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_ptds_v7000"},
    {abi::kDomainRuntime, 235, Layout::kMemset, true, "cudaMemsetAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 236, Layout::kMemset, true, "cudaMemset2DAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_ptsz_v7000"},
    {abi::kDomainRuntime, 243, Layout::kMemset, true, "cudaMemset3D_ptds",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset3D_ptds_v7000"},
    {abi::kDomainRuntime, 244, Layout::kMemset, true, "cudaMemset3DAsync_ptsz",
     "CUPTI_RUNTIME_TRACE_CBID_cudaMemset3DAsync_ptsz_v7000"},
    {abi::kDomainDriver, 305, Layout::kMemcpy, false, "cuMemcpy", "CUPTI_DRIVER_TRACE_CBID_cuMemcpy"},
    {abi::kDomainDriver, 306, Layout::kMemcpy, false, "cuMemcpyAsync", "CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync"},
    {abi::kDomainDriver, 276, Layout::kMemcpy, false, "cuMemcpyHtoD", "CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2"},
    {abi::kDomainDriver, 277, Layout::kMemcpy, false, "cuMemcpyHtoDAsync",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2"},
    {abi::kDomainDriver, 278, Layout::kMemcpy, false, "cuMemcpyDtoH", "CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2"},
    {abi::kDomainDriver, 279, Layout::kMemcpy, false, "cuMemcpyDtoHAsync",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2"},
    {abi::kDomainDriver, 280, Layout::kMemcpy, false, "cuMemcpyDtoD", "CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2"},
    {abi::kDomainDriver, 281, Layout::kMemcpy, false, "cuMemcpyDtoDAsync",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2"},
    {abi::kDomainDriver, 318, Layout::kMemcpy, false, "cuMemcpyPeer", "CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeer"},
    {abi::kDomainDriver, 319, Layout::kMemcpy, false, "cuMemcpyPeerAsync", "CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeerAsync"},
    {abi::kDomainDriver, 408, Layout::kMemcpy, true, "cuMemcpy_ptds", "CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds"},
    {abi::kDomainDriver, 418, Layout::kMemcpy, true, "cuMemcpyAsync_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz"},
    {abi::kDomainDriver, 421, Layout::kMemcpy, true, "cuMemcpyHtoDAsync_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz"},
    {abi::kDomainDriver, 422, Layout::kMemcpy, true, "cuMemcpyDtoHAsync_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz"},
    {abi::kDomainDriver, 423, Layout::kMemcpy, true, "cuMemcpyDtoDAsync_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz"},
    {abi::kDomainDriver, 249, Layout::kMemset, false, "cuMemsetD8", "CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2"},
    {abi::kDomainDriver, 250, Layout::kMemset, false, "cuMemsetD16", "CUPTI_DRIVER_TRACE_CBID_cuMemsetD16_v2"},
    {abi::kDomainDriver, 251, Layout::kMemset, false, "cuMemsetD32", "CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2"},
    {abi::kDomainDriver, 216, Layout::kMemset, false, "cuMemsetD8Async", "CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async"},
    {abi::kDomainDriver, 218, Layout::kMemset, false, "cuMemsetD16Async", "CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async"},
    {abi::kDomainDriver, 220, Layout::kMemset, false, "cuMemsetD32Async", "CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async"},
    {abi::kDomainDriver, 428, Layout::kMemset, true, "cuMemsetD8Async_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz"},
    {abi::kDomainDriver, 429, Layout::kMemset, true, "cuMemsetD16Async_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async_ptsz"},
    {abi::kDomainDriver, 430, Layout::kMemset, true, "cuMemsetD32Async_ptsz",
     "CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz"},
};

// Callbacks by (domain, cbid), for a lookup that costs the same for any entry
// (filled once, before the first subscription; read-only afterwards).
constexpr uint32_t kMaxIndexedCbid = 1024;
const LaunchCallback* g_callback_index[3][kMaxIndexedCbid] = {};
std::once_flag g_callback_index_once;

void build_callback_index() {
  for (const LaunchCallback& launch : kLaunchCallbacks) g_callback_index[launch.domain][launch.cbid] = &launch;
  for (const LaunchCallback& transfer : kTransferCallbacks)
    g_callback_index[transfer.domain][transfer.cbid] = &transfer;
}

const LaunchCallback* find_launch_callback(abi::CallbackDomain domain, abi::CallbackId cbid) {
  if (domain < 0 || domain > 2 || cbid >= kMaxIndexedCbid) return nullptr;
  return g_callback_index[domain][cbid];
}

bool is_transfer(Layout layout) { return layout == Layout::kMemcpy || layout == Layout::kMemset; }

struct Library {
  void* handle = nullptr;
  std::string path;
  abi::SubscribeFn subscribe = nullptr;
  abi::SubscribeV2Fn subscribe_v2 = nullptr;
  abi::UnsubscribeFn unsubscribe = nullptr;
  abi::EnableCallbackFn enable_callback = nullptr;
  abi::GetResultStringFn result_string = nullptr;
  abi::GetDeviceIdFn device_id = nullptr;
  abi::GetStreamIdExFn stream_id = nullptr;
  abi::FuncGetNameFn func_get_name = nullptr;
  GpuActivityFunctions activity;
};

// Written under g_mutex before g_recording is set; read by callbacks after
// they see g_recording (acquire), never freed: callbacks may outlive a stop.
std::mutex g_mutex;
Library g_library;
abi::SubscriberHandle g_subscriber = nullptr;
std::atomic<bool> g_recording{false};
std::atomic<uint32_t> g_kernel_kind{0};
std::atomic<uint32_t> g_graph_kind{0};
std::atomic<uint32_t> g_memcpy_kind{0};
std::atomic<uint32_t> g_memset_kind{0};

std::atomic<uint64_t> g_kernel_launches{0};
std::atomic<uint64_t> g_graph_launches{0};
std::atomic<uint64_t> g_nested_skipped{0};
std::atomic<uint64_t> g_not_recorded{0};
std::atomic<uint64_t> g_transfers{0};

// Runtime launches in progress on this thread: the runtime may reach the
// driver's launch entry points itself, and one launch is one event.
thread_local int t_runtime_launch_depth = 0;
// Correlation id of the outermost launch (or copy) in progress on this thread,
// 0 when none: a graph node created meanwhile was captured from it.
thread_local uint32_t t_open_correlation = 0;

// The device of the last context seen on this thread (launches rarely switch).
thread_local void* t_last_context = nullptr;
thread_local uint32_t t_last_device = 0;
thread_local bool t_last_device_known = false;

void add_device(JsonAttrs& attrs, void* context) {
  if (context == nullptr || g_library.device_id == nullptr) return;
  if (context != t_last_context) {
    uint32_t device = 0;
    t_last_device_known = g_library.device_id(context, &device) == abi::kSuccess;
    t_last_device = device;
    t_last_context = context;
  }
  if (t_last_device_known) attrs.field_uint("device", t_last_device);
}

void add_stream(JsonAttrs& attrs, void* context, void* stream, bool per_thread) {
  attrs.field_uint("stream", reinterpret_cast<uintptr_t>(stream));
  if (context == nullptr || g_library.stream_id == nullptr) return;
  uint32_t id = 0;
  if (g_library.stream_id(context, stream, per_thread ? 1 : 0, &id) == abi::kSuccess) {
    attrs.field_uint("stream_id", id);  // the id CUPTI activity records and profilers show
  }
}

// Reads the launch configuration from the parameter struct of `launch`.
// Returns the driver function handle when the layout has one (for naming).
void* add_launch_config(JsonAttrs& attrs, const LaunchCallback& launch, const abi::CallbackData& data) {
  const void* params = data.function_params;
  if (params == nullptr) return nullptr;
  switch (launch.layout) {
    case Layout::kRuntimeLaunch: {
      const auto* p = static_cast<const abi::RuntimeLaunchParams*>(params);
      attrs.field_dims("grid", p->grid.x, p->grid.y, p->grid.z);
      attrs.field_dims("block", p->block.x, p->block.y, p->block.z);
      attrs.field_uint("shared_mem", p->shared_mem);
      add_stream(attrs, data.context, p->stream, launch.per_thread_stream);
      return nullptr;
    }
    case Layout::kRuntimeLaunchEx: {
      const auto* p = static_cast<const abi::RuntimeLaunchExParams*>(params);
      if (p->config == nullptr) return nullptr;
      const abi::RuntimeLaunchConfig& c = *p->config;
      attrs.field_dims("grid", c.grid.x, c.grid.y, c.grid.z);
      attrs.field_dims("block", c.block.x, c.block.y, c.block.z);
      attrs.field_uint("shared_mem", c.dynamic_shared_mem);
      add_stream(attrs, data.context, c.stream, launch.per_thread_stream);
      return nullptr;
    }
    case Layout::kDriverLaunch: {
      const auto* p = static_cast<const abi::DriverLaunchParams*>(params);
      attrs.field_dims("grid", p->grid_x, p->grid_y, p->grid_z);
      attrs.field_dims("block", p->block_x, p->block_y, p->block_z);
      attrs.field_uint("shared_mem", p->shared_mem);
      add_stream(attrs, data.context, p->stream, launch.per_thread_stream);
      attrs.field_uint("function", reinterpret_cast<uintptr_t>(p->function));  // = a Triton launch's `function`
      return p->function;
    }
    case Layout::kDriverLaunchEx: {
      const auto* p = static_cast<const abi::DriverLaunchExParams*>(params);
      if (p->config != nullptr) {
        const abi::DriverLaunchConfig& c = *p->config;
        attrs.field_dims("grid", c.grid_x, c.grid_y, c.grid_z);
        attrs.field_dims("block", c.block_x, c.block_y, c.block_z);
        attrs.field_uint("shared_mem", c.shared_mem);
        add_stream(attrs, data.context, c.stream, launch.per_thread_stream);
      }
      attrs.field_uint("function", reinterpret_cast<uintptr_t>(p->function));
      return p->function;
    }
    case Layout::kGraph: {
      const auto* p = static_cast<const abi::GraphLaunchParams*>(params);
      attrs.field_uint("graph_exec", reinterpret_cast<uintptr_t>(p->graph_exec));
      add_stream(attrs, data.context, p->stream, launch.per_thread_stream);
      return nullptr;
    }
    case Layout::kNoParams:
    case Layout::kMemcpy:
    case Layout::kMemset:
      return nullptr;
  }
  return nullptr;
}

const char* kernel_name(const abi::CallbackData& data, void* function) {
  if (data.symbol_name != nullptr && data.symbol_name[0] != '\0') return data.symbol_name;
  const char* name = nullptr;
  if (function != nullptr && g_library.func_get_name != nullptr && g_library.func_get_name(&name, function) == 0 &&
      name != nullptr && name[0] != '\0') {
    return name;
  }
  return "<unknown kernel>";
}

uint32_t event_kind_id(Layout layout) {
  switch (layout) {
    case Layout::kGraph:
      return g_graph_kind.load(std::memory_order_relaxed);
    case Layout::kMemcpy:
      return g_memcpy_kind.load(std::memory_order_relaxed);
    case Layout::kMemset:
      return g_memset_kind.load(std::memory_order_relaxed);
    default:
      return g_kernel_kind.load(std::memory_order_relaxed);
  }
}

void record_launch(const LaunchCallback& launch, const abi::CallbackData& data) {
  JsonAttrs attrs;
  attrs.field_string("api", launch.api);
  attrs.field_uint("cbid", launch.cbid);
  void* function = add_launch_config(attrs, launch, data);
  add_device(attrs, data.context);
  attrs.field_uint("context", data.context_uid);
  size_t attrs_size = 0;
  const char* attrs_text = attrs.finish(&attrs_size);

  const bool graph = launch.layout == Layout::kGraph;
  const bool transfer = is_transfer(launch.layout);
  const char* name = graph || transfer ? launch.api : kernel_name(data, function);
  StringTable& strings = StringTable::instance();
  const uint32_t name_id = strings.intern_utf8(name, std::strlen(name));
  UnwindOptions options;
  options.skip_own_module = true;  // this callback; libcupti and libcuda frames stay, they are real
  options.skip_until_eval = false;
  if (Recorder::instance().record_native(event_kind_id(launch.layout), name_id, attrs_text, attrs_size, options,
                                         data.correlation_id)) {
    (transfer ? g_transfers : graph ? g_graph_launches : g_kernel_launches).fetch_add(1, std::memory_order_relaxed);
  } else {
    g_not_recorded.fetch_add(1, std::memory_order_relaxed);
  }
}

// A graph node made or cloned: on the thread that made it, inside the API
// call that made it (a launch captured into a graph: t_open_correlation).
void on_resource(abi::CallbackId cbid, const void* raw) {
  if (cbid != abi::kGraphNodeCreated && cbid != abi::kGraphNodeCloned) return;
  if (!g_recording.load(std::memory_order_acquire)) return;
  const auto* resource = static_cast<const abi::ResourceData*>(raw);
  const auto* graph = static_cast<const abi::GraphData*>(resource->resource_descriptor);
  if (graph == nullptr) return;
  if (cbid == abi::kGraphNodeCreated) {
    gpu_activity_graph_node(graph->graph, graph->node, nullptr, graph->node_type, t_open_correlation);
  } else {
    gpu_activity_graph_node(graph->graph, graph->node, graph->original_node, graph->node_type, 0);
  }
}

// Runs on the launching thread, with or without the GIL; must never take it.
void on_callback(void*, abi::CallbackDomain domain, abi::CallbackId cbid, const void* raw) {
  if (raw == nullptr) return;
  if (domain == abi::kDomainResource) {
    on_resource(cbid, raw);
    return;
  }
  const LaunchCallback* launch = find_launch_callback(domain, cbid);
  if (launch == nullptr) return;
  const auto* data = static_cast<const abi::CallbackData*>(raw);
  if (data->callback_site != abi::kApiEnter) {
    if (domain == abi::kDomainRuntime) {
      if (t_runtime_launch_depth > 0 && --t_runtime_launch_depth == 0) t_open_correlation = 0;
    } else if (t_runtime_launch_depth == 0) {
      t_open_correlation = 0;
    }
    return;
  }
  if (domain == abi::kDomainRuntime) {
    if (t_runtime_launch_depth++ == 0) t_open_correlation = data->correlation_id;
  } else if (t_runtime_launch_depth > 0) {
    g_nested_skipped.fetch_add(1, std::memory_order_relaxed);
    return;
  } else {
    t_open_correlation = data->correlation_id;
  }
  if (!g_recording.load(std::memory_order_acquire) || !Recorder::instance().active()) {
    g_not_recorded.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  record_launch(*launch, *data);
}

std::string result_text(abi::CUptiResult result) {
  const char* text = nullptr;
  if (g_library.result_string != nullptr && g_library.result_string(result, &text) == abi::kSuccess &&
      text != nullptr) {
    return std::string(text) + " (" + std::to_string(result) + ")";
  }
  return "CUPTI error " + std::to_string(result);
}

bool cuda_driver_loadable() {
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
  if (driver == nullptr) driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) return false;
  dlclose(driver);
  return true;
}

template <typename T>
T symbol(void* handle, const char* name) {
  return reinterpret_cast<T>(dlsym(handle, name));
}

// Loads the first candidate that dlopen accepts. Already-loaded copies win
// (RTLD_NOLOAD first), so the process never holds two CUPTIs when it can help it.
bool load_library(const std::vector<std::string>& candidates, std::string* errors) {
  if (g_library.handle != nullptr) return true;
  for (int pass = 0; pass < 2 && g_library.handle == nullptr; ++pass) {
    for (const std::string& candidate : candidates) {
      void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
      if (handle == nullptr) {
        if (pass == 1) {
          const char* error = dlerror();
          if (!errors->empty()) *errors += "; ";
          *errors += error != nullptr ? error : candidate;
        }
        continue;
      }
      g_library.handle = handle;
      g_library.path = candidate;
      break;
    }
  }
  if (g_library.handle == nullptr) return false;
  void* handle = g_library.handle;
  g_library.subscribe = symbol<abi::SubscribeFn>(handle, "cuptiSubscribe");
  g_library.subscribe_v2 = symbol<abi::SubscribeV2Fn>(handle, "cuptiSubscribe_v2");
  g_library.unsubscribe = symbol<abi::UnsubscribeFn>(handle, "cuptiUnsubscribe");
  g_library.enable_callback = symbol<abi::EnableCallbackFn>(handle, "cuptiEnableCallback");
  g_library.result_string = symbol<abi::GetResultStringFn>(handle, "cuptiGetResultString");
  g_library.device_id = symbol<abi::GetDeviceIdFn>(handle, "cuptiGetDeviceId");
  g_library.stream_id = symbol<abi::GetStreamIdExFn>(handle, "cuptiGetStreamIdEx");
  GpuActivityFunctions& activity = g_library.activity;
  activity.register_callbacks = symbol<abi::ActivityRegisterCallbacksFn>(handle, "cuptiActivityRegisterCallbacks");
  activity.enable = symbol<abi::ActivityEnableFn>(handle, "cuptiActivityEnable");
  activity.disable = symbol<abi::ActivityEnableFn>(handle, "cuptiActivityDisable");
  activity.next_record = symbol<abi::ActivityGetNextRecordFn>(handle, "cuptiActivityGetNextRecord");
  activity.flush_all = symbol<abi::ActivityFlushAllFn>(handle, "cuptiActivityFlushAll");
  activity.dropped_records = symbol<abi::ActivityGetNumDroppedRecordsFn>(handle, "cuptiActivityGetNumDroppedRecords");
  activity.timestamp = symbol<abi::GetTimestampFn>(handle, "cuptiGetTimestamp");
  activity.graph_node_id = symbol<abi::GetGraphNodeIdFn>(handle, "cuptiGetGraphNodeId");
  activity.graph_id = symbol<abi::GetGraphIdFn>(handle, "cuptiGetGraphId");
  // Only for naming launches whose callback carries no symbol name; only if
  // the driver is already in the process (loading it here would start CUDA).
  if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD)) {
    g_library.func_get_name = symbol<abi::FuncGetNameFn>(driver, "cuFuncGetName");
  }
  return true;
}

abi::CUptiResult subscribe(std::string* holder) {
  if (g_library.subscribe_v2 != nullptr) {
    // _v2 names who holds CUPTI when the subscription is refused.
    char old_name[abi::kOldSubscriberNameSize + 1] = {};
    abi::SubscriberParams params{sizeof(abi::SubscriberParams), "tbpipe", old_name, abi::kOldSubscriberNameSize};
    const abi::CUptiResult result = g_library.subscribe_v2(&g_subscriber, on_callback, nullptr, &params);
    old_name[abi::kOldSubscriberNameSize] = '\0';
    if (old_name[0] != '\0') *holder = old_name;
    return result;
  }
  return g_library.subscribe(&g_subscriber, on_callback, nullptr);
}

}  // namespace

std::vector<CuptiCallbackInfo> cupti_launch_callbacks() {
  std::vector<CuptiCallbackInfo> out;
  for (const LaunchCallback& launch : kLaunchCallbacks) {
    out.push_back(
        CuptiCallbackInfo{launch.domain, launch.cbid, launch.api, launch.cbid_name, launch.layout == Layout::kGraph});
  }
  for (const LaunchCallback& transfer : kTransferCallbacks) {
    out.push_back(CuptiCallbackInfo{transfer.domain, transfer.cbid, transfer.api, transfer.cbid_name, false});
  }
  return out;
}

std::vector<std::pair<std::string, uint64_t>> cupti_declared_abi() {
  using namespace abi;
  return {
      {"CUPTI_SUCCESS", kSuccess},
      {"CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", kErrorMultipleSubscribers},
      {"CUPTI_CB_DOMAIN_DRIVER_API", kDomainDriver},
      {"CUPTI_CB_DOMAIN_RUNTIME_API", kDomainRuntime},
      {"CUPTI_API_ENTER", kApiEnter},
      {"CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN", kOldSubscriberNameSize},
      {"sizeof(CUpti_CallbackData)", sizeof(CallbackData)},
      {"offsetof(CUpti_CallbackData, functionName)", offsetof(CallbackData, function_name)},
      {"offsetof(CUpti_CallbackData, functionParams)", offsetof(CallbackData, function_params)},
      {"offsetof(CUpti_CallbackData, symbolName)", offsetof(CallbackData, symbol_name)},
      {"offsetof(CUpti_CallbackData, context)", offsetof(CallbackData, context)},
      {"offsetof(CUpti_CallbackData, contextUid)", offsetof(CallbackData, context_uid)},
      {"offsetof(CUpti_CallbackData, correlationId)", offsetof(CallbackData, correlation_id)},
      {"sizeof(CUpti_SubscriberParams)", sizeof(SubscriberParams)},
      {"offsetof(cudaLaunchKernel_v7000_params, gridDim)", offsetof(RuntimeLaunchParams, grid)},
      {"offsetof(cudaLaunchKernel_v7000_params, blockDim)", offsetof(RuntimeLaunchParams, block)},
      {"offsetof(cudaLaunchKernel_v7000_params, sharedMem)", offsetof(RuntimeLaunchParams, shared_mem)},
      {"offsetof(cudaLaunchKernel_v7000_params, stream)", offsetof(RuntimeLaunchParams, stream)},
      {"offsetof(cudaLaunchCooperativeKernel_v9000_params, stream)", offsetof(RuntimeLaunchParams, stream)},
      {"offsetof(cudaLaunchKernelExC_v11060_params, func)", offsetof(RuntimeLaunchExParams, func)},
      {"offsetof(cudaLaunchConfig_t, dynamicSmemBytes)", offsetof(RuntimeLaunchConfig, dynamic_shared_mem)},
      {"offsetof(cudaLaunchConfig_t, stream)", offsetof(RuntimeLaunchConfig, stream)},
      {"offsetof(cudaGraphLaunch_v10000_params, stream)", offsetof(GraphLaunchParams, stream)},
      {"offsetof(cuGraphLaunch_params, hStream)", offsetof(GraphLaunchParams, stream)},
      {"offsetof(cuLaunchKernel_params, sharedMemBytes)", offsetof(DriverLaunchParams, shared_mem)},
      {"offsetof(cuLaunchKernel_params, hStream)", offsetof(DriverLaunchParams, stream)},
      {"offsetof(cuLaunchCooperativeKernel_params, hStream)", offsetof(DriverLaunchParams, stream)},
      {"offsetof(CUlaunchConfig, sharedMemBytes)", offsetof(DriverLaunchConfig, shared_mem)},
      {"offsetof(CUlaunchConfig, hStream)", offsetof(DriverLaunchConfig, stream)},
      {"offsetof(cuLaunchKernelEx_params, f)", offsetof(DriverLaunchExParams, function)},
  };
}

std::vector<std::pair<std::string, uint64_t>> cupti_declared_abi_all() {
  std::vector<std::pair<std::string, uint64_t>> out = cupti_declared_abi();
  gpu_activity_declared_abi(&out);
  return out;
}

CuptiStartResult cupti_start(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> guard(g_mutex);
  CuptiStartResult result;
  StringTable& strings = StringTable::instance();
  g_kernel_kind.store(strings.intern_utf8("kernel_launch", 13), std::memory_order_relaxed);
  g_graph_kind.store(strings.intern_utf8("graph_launch", 12), std::memory_order_relaxed);
  g_memcpy_kind.store(strings.intern_utf8("memcpy", 6), std::memory_order_relaxed);
  g_memset_kind.store(strings.intern_utf8("memset", 6), std::memory_order_relaxed);
  std::call_once(g_callback_index_once, build_callback_index);
  if (g_subscriber != nullptr) {
    g_recording.store(true, std::memory_order_release);
    result.status = CuptiStartStatus::kStarted;
    result.library = g_library.path;
    return result;
  }
  std::string errors;
  if (!load_library(candidates, &errors)) {
    result.status = CuptiStartStatus::kNoLibrary;
    result.message = "no CUPTI library found (" + (errors.empty() ? std::string("no candidates") : errors) + ")";
    return result;
  }
  result.library = g_library.path;
  if (g_library.subscribe == nullptr || g_library.unsubscribe == nullptr || g_library.enable_callback == nullptr) {
    result.status = CuptiStartStatus::kMissingSymbols;
    result.message = g_library.path + " has no CUPTI callback API (cuptiSubscribe/cuptiEnableCallback missing)";
    return result;
  }
  std::string holder;
  const abi::CUptiResult subscribed = subscribe(&holder);
  if (subscribed != abi::kSuccess) {
    g_subscriber = nullptr;
    if (subscribed == abi::kErrorMultipleSubscribers) {
      result.status = CuptiStartStatus::kOtherSubscriber;
      result.message = "another CUPTI client already holds this process" +
                       (holder.empty() ? std::string() : " (" + holder + ")") +
                       "; CUPTI allows one subscriber per process: torch.profiler/Kineto, Nsight Systems, "
                       "Nsight Compute, cuda-gdb and compute-sanitizer each take it";
    } else {
      result.status = CuptiStartStatus::kSubscribeFailed;
      result.message = "cuptiSubscribe failed: " + result_text(subscribed);
      if (!cuda_driver_loadable()) result.message += "; no CUDA driver (libcuda.so.1) on this machine";
    }
    return result;
  }
  for (const LaunchCallback& launch : kLaunchCallbacks) {
    if (g_library.enable_callback(1, g_subscriber, launch.domain, launch.cbid) == abi::kSuccess) {
      ++result.enabled_callbacks;
    }
  }
  if (result.enabled_callbacks == 0) {
    g_library.unsubscribe(g_subscriber);
    g_subscriber = nullptr;
    result.status = CuptiStartStatus::kSubscribeFailed;
    result.message = g_library.path + " accepted none of the kernel launch callbacks";
    return result;
  }
  g_recording.store(true, std::memory_order_release);
  result.status = CuptiStartStatus::kStarted;
  return result;
}

CuptiActivityStartResult cupti_activity_start(unsigned kinds) {
  std::lock_guard<std::mutex> guard(g_mutex);
  CuptiActivityStartResult result;
  if (g_subscriber == nullptr) {
    result.message = "the launch callbacks are not subscribed";
    return result;
  }
  const GpuActivityStartResult started = gpu_activity_start(g_library.activity, kinds);
  result.started = started.started;
  result.kinds = started.kinds;
  result.message = started.message;
  result.clock_offset_ns = started.clock_offset_ns;
  if (!started.started) return result;
  // Copies and sets become events of their own, so their records have a site;
  // graph nodes are followed so a replayed kernel has its captured launch.
  for (const LaunchCallback& transfer : kTransferCallbacks) {
    const unsigned needed = transfer.layout == Layout::kMemcpy ? kGpuMemcpy : kGpuMemset;
    if ((started.kinds & needed) != 0) g_library.enable_callback(1, g_subscriber, transfer.domain, transfer.cbid);
  }
  if (g_library.activity.graph_node_id != nullptr) {
    result.graph_nodes =
        g_library.enable_callback(1, g_subscriber, abi::kDomainResource, abi::kGraphNodeCreated) == abi::kSuccess &&
        g_library.enable_callback(1, g_subscriber, abi::kDomainResource, abi::kGraphNodeCloned) == abi::kSuccess;
  }
  return result;
}

void cupti_stop() {
  std::lock_guard<std::mutex> guard(g_mutex);
  g_recording.store(false, std::memory_order_release);
  gpu_activity_stop();  // what CUPTI still holds goes into the store, for the session's last write
  if (g_subscriber != nullptr && g_library.unsubscribe != nullptr) {
    g_library.unsubscribe(g_subscriber);
  }
  g_subscriber = nullptr;
}

bool cupti_subscribed() {
  std::lock_guard<std::mutex> guard(g_mutex);
  return g_subscriber != nullptr;
}

CuptiCounters cupti_counters() {
  CuptiCounters counters;
  counters.kernel_launches = g_kernel_launches.load(std::memory_order_relaxed);
  counters.graph_launches = g_graph_launches.load(std::memory_order_relaxed);
  counters.nested_skipped = g_nested_skipped.load(std::memory_order_relaxed);
  counters.not_recorded = g_not_recorded.load(std::memory_order_relaxed);
  counters.transfers = g_transfers.load(std::memory_order_relaxed);
  return counters;
}

}  // namespace tbpipe
