/*
 * TEST DOUBLE of libcupti -- NOT NVIDIA's CUPTI, and no GPU is involved.
 *
 * tests/test_sources_cuda.py builds this file into a shared library and points
 * the `cuda` source at it, to test tbpipe's CUPTI path end to end on machines
 * without CUDA. It implements the few entry points tbpipe calls
 * (cuptiSubscribe[_v2], cuptiUnsubscribe, cuptiEnableCallback,
 * cuptiEnableDomain, cuptiGetResultString, cuptiGetDeviceId,
 * cuptiGetStreamIdEx) with CUPTI's documented behaviour: one subscriber per
 * process, callbacks only for enabled (domain, cbid) pairs, an ENTER and an
 * EXIT callback per API call.
 *
 * The tbpipe_double_* functions play the CUDA runtime and driver: each one
 * "launches" a kernel by invoking the registered callback with the callback
 * data CUPTI would pass -- CUpti_CallbackData with functionName, symbolName,
 * context, correlation id, and functionParams pointing at the API's parameter
 * struct (cudaLaunchKernel_v7000_params, cuLaunchKernelEx_params, ...), laid
 * out as in NVIDIA's generated_*_meta.h headers. Python calls them through
 * ctypes, which releases the GIL for the call: the callback then runs, as it
 * does under real CUDA, on the launching thread without the GIL.
 *
 * The activity API (cuptiActivityRegisterCallbacks, Enable/Disable,
 * GetNextRecord, FlushAll, GetNumDroppedRecords, cuptiGetTimestamp) plays the
 * GPU: tests queue activity records (tbpipe_double_*_activity) with the
 * correlation ids of launches they made; the double packs them into buffers
 * the client handed out, as CUpti_ActivityKernel9 / Memcpy5 / Memset4 /
 * Synchronization records 8-byte aligned, and returns each full buffer
 * through the completion callback -- in the order the test chooses, on a
 * thread of its own (as CUPTI's worker does) or, from cuptiActivityFlushAll,
 * on the flushing thread. Records without an end time are incomplete: only a
 * forced flush delivers them. Its clock (cuptiGetTimestamp) is
 * CLOCK_MONOTONIC, not the wall clock, as CUPTI's need not be either. Graph
 * resource callbacks (GRAPHNODE_CREATED during a captured launch, _CLONED at
 * instantiation) come with fake CUgraph/CUgraphNode handles whose ids
 * cuptiGetGraphNodeId/cuptiGetGraphId report.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUptiResult;
typedef void (*CUpti_CallbackFunc)(void* userdata, int domain, uint32_t cbid, const void* cbdata);
typedef struct CUpti_Subscriber_st* CUpti_SubscriberHandle;

enum {
  CUPTI_SUCCESS = 0,
  CUPTI_ERROR_INVALID_PARAMETER = 1,
  CUPTI_ERROR_MAX_LIMIT_REACHED = 12,
  CUPTI_ERROR_NOT_INITIALIZED = 15,
  CUPTI_ERROR_INVALID_KIND = 21,
  CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39,
  CUPTI_ERROR_UNKNOWN = 999,
};
enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 };
enum { CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RUNTIME_API = 2, CUPTI_CB_DOMAIN_RESOURCE = 3 };
enum { CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED = 13, CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED = 20 };

/* cbids from cupti_runtime_cbid.h / cupti_driver_cbid.h */
enum {
  RT_cudaLaunchKernel_v7000 = 211,
  RT_cudaLaunchKernelExC_v11060 = 430,
  RT_cudaGraphLaunch_v10000 = 311,
  DRV_cuLaunchKernel = 307,
  DRV_cuLaunchKernelEx = 652,
  RT_cudaMemcpyAsync_v3020 = 41,
  RT_cudaMemsetAsync_v3020 = 51,
  RT_cudaGraphAddKernelNode_v10000 = 289,
  DRV_cuMemcpyAsync = 306,
  DRV_cuMemsetD32Async = 220,
};

typedef struct {
  int callbackSite;
  const char* functionName;
  const void* functionParams;
  void* functionReturnValue;
  const char* symbolName;
  void* context;
  uint32_t contextUid;
  uint64_t* correlationData;
  uint32_t correlationId;
} CUpti_CallbackData;

typedef struct {
  size_t structSize;
  const char* subscriberName;
  char* oldSubscriberName;
  size_t oldSubscriberSize;
} CUpti_SubscriberParams;

typedef struct {
  unsigned int x, y, z;
} dim3;

typedef struct {
  const void* func;
  dim3 gridDim;
  dim3 blockDim;
  void** args;
  size_t sharedMem;
  void* stream;
} cudaLaunchKernel_v7000_params;

typedef struct {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes;
  void* stream;
  void* attrs;
  unsigned int numAttrs;
} cudaLaunchConfig_t;

typedef struct {
  const cudaLaunchConfig_t* config;
  const void* func;
  void** args;
} cudaLaunchKernelExC_v11060_params;

typedef struct {
  void* graphExec;
  void* stream;
} cudaGraphLaunch_v10000_params;

typedef struct {
  void* f;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void* hStream;
  void** kernelParams;
  void** extra;
} cuLaunchKernel_params;

typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void* hStream;
  void* attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

typedef struct {
  const CUlaunchConfig* config;
  void* f;
  void** kernelParams;
  void** extra;
} cuLaunchKernelEx_params;

/* ---- the double's state ------------------------------------------------- */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_subscriber_token; /* its address is the one subscriber handle */
static CUpti_CallbackFunc g_callback;
static void* g_userdata;
static int g_subscribed;
static int g_subscribe_result = CUPTI_SUCCESS;
static char g_holder[64];
static unsigned char g_enabled[4][1024]; /* [domain][cbid] */
static int g_fake_context_token;
static void* const g_context = &g_fake_context_token;

static void invoke(int domain, uint32_t cbid, int site, const char* api, const char* symbol, const void* params,
                   uint32_t correlation) {
  CUpti_CallbackFunc callback;
  void* userdata;
  pthread_mutex_lock(&g_lock);
  callback = g_subscribed && domain < 4 && cbid < 1024 && g_enabled[domain][cbid] ? g_callback : NULL;
  userdata = g_userdata;
  pthread_mutex_unlock(&g_lock);
  if (callback == NULL) return;
  uint64_t correlation_data = 0;
  int return_value = 0;
  CUpti_CallbackData data;
  memset(&data, 0, sizeof data);
  data.callbackSite = site;
  data.functionName = api;
  data.functionParams = params;
  data.functionReturnValue = site == CUPTI_API_EXIT ? &return_value : NULL;
  data.symbolName = symbol;
  data.context = g_context;
  data.contextUid = 1;
  data.correlationData = &correlation_data;
  data.correlationId = correlation;
  callback(userdata, domain, cbid, &data);
}

/* ---- CUPTI entry points ------------------------------------------------- */

EXPORT CUptiResult cuptiSubscribe(CUpti_SubscriberHandle* subscriber, CUpti_CallbackFunc callback, void* userdata) {
  if (subscriber == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  pthread_mutex_lock(&g_lock);
  CUptiResult result = g_subscribe_result;
  if (result == CUPTI_SUCCESS && g_subscribed) result = CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
  if (result == CUPTI_SUCCESS) {
    g_subscribed = 1;
    g_callback = callback;
    g_userdata = userdata;
    memset(g_enabled, 0, sizeof g_enabled);
    *subscriber = (CUpti_SubscriberHandle)&g_subscriber_token;
  }
  pthread_mutex_unlock(&g_lock);
  return result;
}

EXPORT CUptiResult cuptiSubscribe_v2(CUpti_SubscriberHandle* subscriber, CUpti_CallbackFunc callback, void* userdata,
                                     CUpti_SubscriberParams* params) {
  CUptiResult result = cuptiSubscribe(subscriber, callback, userdata);
  if (result == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED && params != NULL && params->oldSubscriberName != NULL &&
      params->oldSubscriberSize > 0) {
    pthread_mutex_lock(&g_lock);
    strncpy(params->oldSubscriberName, g_holder[0] ? g_holder : "CUPTI for tbpipe", params->oldSubscriberSize - 1);
    params->oldSubscriberName[params->oldSubscriberSize - 1] = '\0';
    pthread_mutex_unlock(&g_lock);
  }
  return result;
}

EXPORT CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber) {
  if (subscriber != (CUpti_SubscriberHandle)&g_subscriber_token) return CUPTI_ERROR_INVALID_PARAMETER;
  pthread_mutex_lock(&g_lock);
  g_subscribed = 0;
  g_callback = NULL;
  memset(g_enabled, 0, sizeof g_enabled);
  pthread_mutex_unlock(&g_lock);
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle subscriber, int domain, uint32_t cbid) {
  if (subscriber != (CUpti_SubscriberHandle)&g_subscriber_token || domain < 1 || domain > 3 || cbid >= 1024) {
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  /* A CUPTI older than CUDA 13 does not know the __cudaLaunchKernel cbids. */
  if (domain == CUPTI_CB_DOMAIN_RUNTIME_API && cbid >= 505) return CUPTI_ERROR_INVALID_PARAMETER;
  pthread_mutex_lock(&g_lock);
  g_enabled[domain][cbid] = enable ? 1 : 0;
  pthread_mutex_unlock(&g_lock);
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiEnableDomain(uint32_t enable, CUpti_SubscriberHandle subscriber, int domain) {
  if (subscriber != (CUpti_SubscriberHandle)&g_subscriber_token || domain < 1 || domain > 3) {
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  pthread_mutex_lock(&g_lock);
  memset(g_enabled[domain], enable ? 1 : 0, sizeof g_enabled[domain]);
  pthread_mutex_unlock(&g_lock);
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiGetResultString(CUptiResult result, const char** text) {
  if (text == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  switch (result) {
    case CUPTI_SUCCESS:
      *text = "CUPTI_SUCCESS";
      break;
    case CUPTI_ERROR_INVALID_PARAMETER:
      *text = "CUPTI_ERROR_INVALID_PARAMETER";
      break;
    case CUPTI_ERROR_NOT_INITIALIZED:
      *text = "CUPTI_ERROR_NOT_INITIALIZED";
      break;
    case CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
      *text = "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED";
      break;
    default:
      *text = "CUPTI_ERROR_UNKNOWN";
      break;
  }
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiGetDeviceId(void* context, uint32_t* device) {
  if (context != g_context || device == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  *device = 0;
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiGetStreamIdEx(void* context, void* stream, uint8_t per_thread, uint32_t* id) {
  if (context != g_context || id == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  *id = (uint32_t)((uintptr_t)stream & 0xffff) + (per_thread ? 1000u : 0u) + 7u;
  return CUPTI_SUCCESS;
}

/* ---- test control: the double's "CUDA" ---------------------------------- */

/* The next cuptiSubscribe fails with `result` (e.g. 39 while `holder` holds CUPTI). */
EXPORT void tbpipe_double_set_subscribe_result(int result, const char* holder) {
  pthread_mutex_lock(&g_lock);
  g_subscribe_result = result;
  strncpy(g_holder, holder ? holder : "", sizeof g_holder - 1);
  pthread_mutex_unlock(&g_lock);
}

EXPORT int tbpipe_double_subscribed(void) {
  pthread_mutex_lock(&g_lock);
  int subscribed = g_subscribed;
  pthread_mutex_unlock(&g_lock);
  return subscribed;
}

EXPORT int tbpipe_double_enabled(int domain, uint32_t cbid) {
  if (domain < 0 || domain > 3 || cbid >= 1024) return 0;
  pthread_mutex_lock(&g_lock);
  int enabled = g_enabled[domain][cbid];
  pthread_mutex_unlock(&g_lock);
  return enabled;
}

/* cudaLaunchKernel, as a runtime whose launch reaches the driver's
 * cuLaunchKernel entry point: runtime ENTER, driver ENTER/EXIT, runtime EXIT. */
EXPORT void tbpipe_double_cuda_launch_kernel(const char* symbol, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                             unsigned by, unsigned bz, size_t shared_mem, uintptr_t stream,
                                             uint32_t correlation) {
  static const int host_stub = 0;
  cudaLaunchKernel_v7000_params params = {&host_stub, {gx, gy, gz}, {bx, by, bz}, NULL, shared_mem, (void*)stream};
  cuLaunchKernel_params inner = {(void*)&host_stub, gx,   gy,  gz, bx, by, bz, (unsigned)shared_mem,
                                 (void*)stream,     NULL, NULL};
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaLaunchKernel_v7000, CUPTI_API_ENTER, "cudaLaunchKernel", symbol, &params,
         correlation);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuLaunchKernel, CUPTI_API_ENTER, "cuLaunchKernel", symbol, &inner,
         correlation + 100000);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuLaunchKernel, CUPTI_API_EXIT, "cuLaunchKernel", symbol, &inner,
         correlation + 100000);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaLaunchKernel_v7000, CUPTI_API_EXIT, "cudaLaunchKernel", symbol, &params,
         correlation);
}

/* cudaLaunchKernelExC with a cudaLaunchConfig_t. */
EXPORT void tbpipe_double_cuda_launch_kernel_exc(const char* symbol, unsigned gx, unsigned bx, size_t shared_mem,
                                                 uintptr_t stream, uint32_t correlation) {
  static const int host_stub = 0;
  cudaLaunchConfig_t config = {{gx, 1, 1}, {bx, 1, 1}, shared_mem, (void*)stream, NULL, 0};
  cudaLaunchKernelExC_v11060_params params = {&config, &host_stub, NULL};
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaLaunchKernelExC_v11060, CUPTI_API_ENTER, "cudaLaunchKernelExC", symbol,
         &params, correlation);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaLaunchKernelExC_v11060, CUPTI_API_EXIT, "cudaLaunchKernelExC", symbol,
         &params, correlation);
}

/* cuLaunchKernelEx called directly (a library on the driver API, e.g. Triton or cuBLAS). */
EXPORT void tbpipe_double_cu_launch_kernel_ex(const char* symbol, unsigned gx, unsigned gy, unsigned bx,
                                              unsigned shared_mem, uintptr_t stream, uint32_t correlation) {
  static int function_token;
  CUlaunchConfig config = {gx, gy, 1, bx, 1, 1, shared_mem, (void*)stream, NULL, 0};
  cuLaunchKernelEx_params params = {&config, &function_token, NULL, NULL};
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuLaunchKernelEx, CUPTI_API_ENTER, "cuLaunchKernelEx", symbol, &params,
         correlation);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuLaunchKernelEx, CUPTI_API_EXIT, "cuLaunchKernelEx", symbol, &params,
         correlation);
}

/* cudaGraphLaunch: CUPTI names no kernel for it. */
EXPORT void tbpipe_double_cuda_graph_launch(uintptr_t graph_exec, uintptr_t stream, uint32_t correlation) {
  cudaGraphLaunch_v10000_params params = {(void*)graph_exec, (void*)stream};
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaGraphLaunch_v10000, CUPTI_API_ENTER, "cudaGraphLaunch", NULL, &params,
         correlation);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaGraphLaunch_v10000, CUPTI_API_EXIT, "cudaGraphLaunch", NULL, &params,
         correlation);
}

struct thread_launch {
  const char* symbol;
  uint32_t correlation;
};

static void* launch_from_native_thread(void* arg) {
  struct thread_launch* launch = (struct thread_launch*)arg;
  static int function_token;
  cuLaunchKernel_params params = {&function_token, 8, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL};
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuLaunchKernel, CUPTI_API_ENTER, "cuLaunchKernel", launch->symbol, &params,
         launch->correlation);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuLaunchKernel, CUPTI_API_EXIT, "cuLaunchKernel", launch->symbol, &params,
         launch->correlation);
  return NULL;
}

/* cuLaunchKernel from a thread the interpreter has never seen (like a CUDA
 * backward worker or a library's own thread); joins it before returning. */
EXPORT int tbpipe_double_cu_launch_on_native_thread(const char* symbol, uint32_t correlation) {
  struct thread_launch launch = {symbol, correlation};
  pthread_t thread;
  if (pthread_create(&thread, NULL, launch_from_native_thread, &launch) != 0) return -1;
  return pthread_join(thread, NULL);
}

/* ---- the activity API: the double's "GPU" ------------------------------- */

typedef void (*CUpti_BuffersCallbackRequestFunc)(uint8_t** buffer, size_t* size, size_t* maxNumRecords);
typedef void (*CUpti_BuffersCallbackCompleteFunc)(void* context, uint32_t streamId, uint8_t* buffer, size_t size,
                                                  size_t validSize);

enum {
  CUPTI_ACTIVITY_KIND_MEMCPY = 1,
  CUPTI_ACTIVITY_KIND_MEMSET = 2,
  CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL = 10,
  CUPTI_ACTIVITY_KIND_SYNCHRONIZATION = 38,
  CUPTI_ACTIVITY_FLAG_FLUSH_FORCED = 1,
};

#define PACKED_ALIGNMENT __attribute__((__packed__)) __attribute__((aligned(8)))

/* Laid out as cupti_activity.h (64-bit) declares them. */
typedef struct PACKED_ALIGNMENT {
  int32_t kind;
  uint8_t cacheConfig;
  uint8_t sharedMemoryConfig;
  uint16_t registersPerThread;
  int32_t partitionedGlobalCacheRequested;
  int32_t partitionedGlobalCacheExecuted;
  uint64_t start;
  uint64_t end;
  uint64_t completed;
  uint32_t deviceId;
  uint32_t contextId;
  uint32_t streamId;
  int32_t gridX, gridY, gridZ;
  int32_t blockX, blockY, blockZ;
  int32_t staticSharedMemory;
  int32_t dynamicSharedMemory;
  uint32_t localMemoryPerThread;
  uint32_t localMemoryTotal;
  uint32_t correlationId;
  int64_t gridId;
  const char* name;
  void* reserved0;
  uint64_t queued;
  uint64_t submitted;
  uint8_t launchType;
  uint8_t isSharedMemoryCarveoutRequested;
  uint8_t sharedMemoryCarveoutRequested;
  uint8_t padding;
  uint32_t sharedMemoryExecuted;
  uint64_t graphNodeId;
  int32_t shmemLimitConfig;
  uint32_t graphId;
  void* pAccessPolicyWindow;
  uint32_t channelID;
  int32_t channelType;
  uint32_t clusterX, clusterY, clusterZ;
  uint32_t clusterSchedulingPolicy;
  uint64_t localMemoryTotal_v2;
  uint32_t maxPotentialClusterSize;
  uint32_t maxActiveClusters;
} CUpti_ActivityKernel9;

typedef struct PACKED_ALIGNMENT {
  int32_t kind;
  uint8_t copyKind;
  uint8_t srcKind;
  uint8_t dstKind;
  uint8_t flags;
  uint64_t bytes;
  uint64_t start;
  uint64_t end;
  uint32_t deviceId;
  uint32_t contextId;
  uint32_t streamId;
  uint32_t correlationId;
  uint32_t runtimeCorrelationId;
  uint32_t pad;
  void* reserved0;
  uint64_t graphNodeId;
  uint32_t graphId;
  uint32_t channelID;
  int32_t channelType;
  uint32_t pad2;
} CUpti_ActivityMemcpy5;

typedef struct PACKED_ALIGNMENT {
  int32_t kind;
  uint32_t value;
  uint64_t bytes;
  uint64_t start;
  uint64_t end;
  uint32_t deviceId;
  uint32_t contextId;
  uint32_t streamId;
  uint32_t correlationId;
  uint16_t flags;
  uint16_t memoryKind;
  uint32_t pad;
  void* reserved0;
  uint64_t graphNodeId;
  uint32_t graphId;
  uint32_t channelID;
  int32_t channelType;
  uint32_t pad2;
} CUpti_ActivityMemset4;

typedef struct PACKED_ALIGNMENT {
  int32_t kind;
  int32_t type;
  uint64_t start;
  uint64_t end;
  uint32_t correlationId;
  uint32_t contextId;
  uint32_t streamId;
  uint32_t cudaEventId;
} CUpti_ActivitySynchronization;

#define MAX_PENDING 65536
#define RECORD_BYTES 256

struct pending_record {
  size_t size;
  int complete; /* an end time: a default flush may deliver it */
  unsigned char bytes[RECORD_BYTES];
};

static CUpti_BuffersCallbackRequestFunc g_buffer_request;
static CUpti_BuffersCallbackCompleteFunc g_buffer_complete;
static unsigned char g_activity_enabled[64];
static struct pending_record* g_pending; /* MAX_PENDING of them, allocated on first use */
static size_t g_pending_count;
static size_t g_next_dropped;   /* reported by the next cuptiActivityGetNumDroppedRecords */
static size_t g_truncate_bytes; /* cut this many bytes off the next delivered buffer's valid size */
static unsigned g_buffers_delivered;

static pthread_mutex_t g_activity_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t monotonic_ns(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

static size_t record_size(int32_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      return sizeof(CUpti_ActivityKernel9);
    case CUPTI_ACTIVITY_KIND_MEMCPY:
      return sizeof(CUpti_ActivityMemcpy5);
    case CUPTI_ACTIVITY_KIND_MEMSET:
      return sizeof(CUpti_ActivityMemset4);
    case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION:
      return sizeof(CUpti_ActivitySynchronization);
    default:
      return 0;
  }
}

static size_t aligned8(size_t size) { return (size + 7) & ~(size_t)7; }

EXPORT CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc request,
                                                  CUpti_BuffersCallbackCompleteFunc complete) {
  if (request == NULL || complete == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  pthread_mutex_lock(&g_activity_lock);
  g_buffer_request = request;
  g_buffer_complete = complete;
  pthread_mutex_unlock(&g_activity_lock);
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityEnable(int kind) {
  if (record_size(kind) == 0) return CUPTI_ERROR_INVALID_KIND;
  pthread_mutex_lock(&g_activity_lock);
  g_activity_enabled[kind] = 1;
  pthread_mutex_unlock(&g_activity_lock);
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityDisable(int kind) {
  if (record_size(kind) == 0) return CUPTI_ERROR_INVALID_KIND;
  pthread_mutex_lock(&g_activity_lock);
  g_activity_enabled[kind] = 0;
  pthread_mutex_unlock(&g_activity_lock);
  return CUPTI_SUCCESS;
}

/* Records follow each other 8-byte aligned; a record's size follows from its
 * kind. A record whose kind field fits is returned even when the rest of it
 * lies past the valid bytes (a cut buffer): the client must check. */
EXPORT CUptiResult cuptiActivityGetNextRecord(uint8_t* buffer, size_t valid, uint8_t** record) {
  if (buffer == NULL || record == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  uint8_t* next = buffer;
  if (*record != NULL) {
    int32_t kind;
    memcpy(&kind, *record, sizeof kind);
    size_t size = record_size(kind);
    if (size == 0) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    next = *record + aligned8(size);
  }
  if (next + sizeof(int32_t) > buffer + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
  *record = next;
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityGetNumDroppedRecords(void* context, uint32_t streamId, size_t* dropped) {
  (void)context;
  (void)streamId;
  if (dropped == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  pthread_mutex_lock(&g_activity_lock);
  *dropped = g_next_dropped;
  g_next_dropped = 0;
  pthread_mutex_unlock(&g_activity_lock);
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiGetTimestamp(uint64_t* timestamp) {
  if (timestamp == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
  *timestamp = monotonic_ns();
  return CUPTI_SUCCESS;
}

/* Takes the pending records (complete ones only, unless `forced`), in the
 * order given by `order` (0 as queued, 1 reversed, 2 odd positions first),
 * into *out; returns how many. */
static size_t take_pending(struct pending_record** out, int forced, int order) {
  pthread_mutex_lock(&g_activity_lock);
  size_t count = 0;
  struct pending_record* taken = NULL;
  if (g_pending_count > 0) taken = (struct pending_record*)malloc(g_pending_count * sizeof *taken);
  size_t kept = 0;
  for (size_t i = 0; taken != NULL && i < g_pending_count; ++i) {
    if (g_pending[i].complete || forced) {
      taken[count++] = g_pending[i];
    } else {
      g_pending[kept++] = g_pending[i];
    }
  }
  if (taken != NULL) g_pending_count = kept;
  pthread_mutex_unlock(&g_activity_lock);
  if (order != 0 && count > 1) {
    struct pending_record* sorted = (struct pending_record*)malloc(count * sizeof *sorted);
    if (sorted != NULL) {
      size_t n = 0;
      if (order == 1) {
        for (size_t i = count; i-- > 0;) sorted[n++] = taken[i];
      } else {
        for (size_t i = 1; i < count; i += 2) sorted[n++] = taken[i];
        for (size_t i = 0; i < count; i += 2) sorted[n++] = taken[i];
      }
      free(taken);
      taken = sorted;
    }
  }
  *out = taken;
  return count;
}

/* Packs records into client buffers, handing each back when full or done. */
static void deliver(struct pending_record* records, size_t count) {
  CUpti_BuffersCallbackRequestFunc request;
  CUpti_BuffersCallbackCompleteFunc complete;
  pthread_mutex_lock(&g_activity_lock);
  request = g_buffer_request;
  complete = g_buffer_complete;
  pthread_mutex_unlock(&g_activity_lock);
  if (request == NULL || complete == NULL) return;
  size_t i = 0;
  while (i < count) {
    uint8_t* buffer = NULL;
    size_t size = 0, max_records = 0;
    request(&buffer, &size, &max_records);
    if (buffer == NULL || size == 0) {
      pthread_mutex_lock(&g_activity_lock);
      g_next_dropped += count - i; /* no buffer: CUPTI drops the records and counts them */
      pthread_mutex_unlock(&g_activity_lock);
      return;
    }
    size_t used = 0, in_buffer = 0;
    while (i < count && used + aligned8(records[i].size) <= size && (max_records == 0 || in_buffer < max_records)) {
      memset(buffer + used, 0, aligned8(records[i].size));
      memcpy(buffer + used, records[i].bytes, records[i].size);
      used += aligned8(records[i].size);
      ++i;
      ++in_buffer;
    }
    if (in_buffer == 0) { /* a record larger than the buffer: dropped */
      ++i;
      pthread_mutex_lock(&g_activity_lock);
      ++g_next_dropped;
      pthread_mutex_unlock(&g_activity_lock);
    }
    pthread_mutex_lock(&g_activity_lock);
    size_t cut = g_truncate_bytes < used ? g_truncate_bytes : used;
    g_truncate_bytes = 0;
    ++g_buffers_delivered;
    pthread_mutex_unlock(&g_activity_lock);
    complete(g_context, 0, buffer, size, used - cut);
  }
}

EXPORT CUptiResult cuptiActivityFlushAll(uint32_t flag) {
  struct pending_record* records = NULL;
  size_t count = take_pending(&records, (flag & CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != 0, 0);
  deliver(records, count);
  free(records);
  return CUPTI_SUCCESS;
}

static int queue(const void* record, size_t size, int complete) {
  int queued = 0;
  pthread_mutex_lock(&g_activity_lock);
  int32_t kind;
  memcpy(&kind, record, sizeof kind);
  if (g_pending == NULL) g_pending = (struct pending_record*)calloc(MAX_PENDING, sizeof *g_pending);
  if (g_pending != NULL && g_activity_enabled[kind] && g_pending_count < MAX_PENDING && size <= RECORD_BYTES) {
    struct pending_record* slot = &g_pending[g_pending_count++];
    slot->size = size;
    slot->complete = complete;
    memcpy(slot->bytes, record, size);
    queued = 1;
  }
  pthread_mutex_unlock(&g_activity_lock);
  return queued;
}

/* ---- test control: activity --------------------------------------------- */

EXPORT uint64_t tbpipe_double_timestamp(void) { return monotonic_ns(); }

EXPORT int tbpipe_double_activity_enabled(int kind) {
  if (kind < 0 || kind >= 64) return 0;
  pthread_mutex_lock(&g_activity_lock);
  int enabled = g_activity_enabled[kind];
  pthread_mutex_unlock(&g_activity_lock);
  return enabled;
}

/* A kernel execution (end 0: still running). Returns 0 when kernel activity is off. */
EXPORT int tbpipe_double_kernel_activity(const char* name, uint32_t correlation, uint64_t start, uint64_t end,
                                         uint32_t device, uint32_t stream, int gx, int gy, int gz, int bx, int by,
                                         int bz, int registers, int static_shared, int dynamic_shared,
                                         uint32_t graph_id, uint64_t graph_node_id) {
  CUpti_ActivityKernel9 record;
  memset(&record, 0, sizeof record);
  record.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  record.registersPerThread = (uint16_t)registers;
  record.start = start;
  record.end = end;
  record.completed = end;
  record.deviceId = device;
  record.contextId = 1;
  record.streamId = stream;
  record.gridX = gx;
  record.gridY = gy;
  record.gridZ = gz;
  record.blockX = bx;
  record.blockY = by;
  record.blockZ = bz;
  record.staticSharedMemory = static_shared;
  record.dynamicSharedMemory = dynamic_shared;
  record.correlationId = correlation;
  record.name = name; /* the caller keeps it alive, as CUPTI keeps its names */
  record.graphNodeId = graph_node_id;
  record.graphId = graph_id;
  record.maxActiveClusters = 0xdeadbeef; /* past the prefix tbpipe reads */
  return queue(&record, sizeof record, end != 0);
}

EXPORT int tbpipe_double_memcpy_activity(uint32_t correlation, int copy_kind, uint64_t bytes, uint64_t start,
                                         uint64_t end, uint32_t stream, uint32_t graph_id, uint64_t graph_node_id) {
  CUpti_ActivityMemcpy5 record;
  memset(&record, 0, sizeof record);
  record.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
  record.copyKind = (uint8_t)copy_kind;
  record.bytes = bytes;
  record.start = start;
  record.end = end;
  record.contextId = 1;
  record.streamId = stream;
  record.correlationId = correlation;
  record.graphNodeId = graph_node_id;
  record.graphId = graph_id;
  return queue(&record, sizeof record, end != 0);
}

EXPORT int tbpipe_double_memset_activity(uint32_t correlation, uint64_t bytes, uint64_t start, uint64_t end,
                                         uint32_t stream) {
  CUpti_ActivityMemset4 record;
  memset(&record, 0, sizeof record);
  record.kind = CUPTI_ACTIVITY_KIND_MEMSET;
  record.bytes = bytes;
  record.start = start;
  record.end = end;
  record.contextId = 1;
  record.streamId = stream;
  record.correlationId = correlation;
  return queue(&record, sizeof record, end != 0);
}

EXPORT int tbpipe_double_sync_activity(uint32_t correlation, int type, uint64_t start, uint64_t end, uint32_t stream) {
  CUpti_ActivitySynchronization record;
  memset(&record, 0, sizeof record);
  record.kind = CUPTI_ACTIVITY_KIND_SYNCHRONIZATION;
  record.type = type;
  record.start = start;
  record.end = end;
  record.correlationId = correlation;
  record.contextId = 1;
  record.streamId = stream;
  return queue(&record, sizeof record, end != 0);
}

struct delivery {
  int order;
};

static void* deliver_on_worker(void* arg) {
  struct delivery* delivery = (struct delivery*)arg;
  struct pending_record* records = NULL;
  size_t count = take_pending(&records, 0, delivery->order);
  deliver(records, count);
  free(records);
  return NULL;
}

/* CUPTI's worker thread hands the complete pending records back now, in
 * `order` (0 queued, 1 reversed, 2 interleaved); joined before returning. */
EXPORT int tbpipe_double_activity_deliver(int order) {
  struct delivery delivery = {order};
  pthread_t thread;
  if (pthread_create(&thread, NULL, deliver_on_worker, &delivery) != 0) return -1;
  return pthread_join(thread, NULL);
}

EXPORT void tbpipe_double_activity_set_dropped(size_t dropped) {
  pthread_mutex_lock(&g_activity_lock);
  g_next_dropped += dropped;
  pthread_mutex_unlock(&g_activity_lock);
}

/* The next delivered buffer's valid size is cut by `bytes` (a record then ends past it). */
EXPORT void tbpipe_double_activity_truncate_next(size_t bytes) {
  pthread_mutex_lock(&g_activity_lock);
  g_truncate_bytes = bytes;
  pthread_mutex_unlock(&g_activity_lock);
}

EXPORT size_t tbpipe_double_activity_pending(void) {
  pthread_mutex_lock(&g_activity_lock);
  size_t count = g_pending_count;
  pthread_mutex_unlock(&g_activity_lock);
  return count;
}

EXPORT unsigned tbpipe_double_buffers_delivered(void) {
  pthread_mutex_lock(&g_activity_lock);
  unsigned count = g_buffers_delivered;
  pthread_mutex_unlock(&g_activity_lock);
  return count;
}

/* ---- graphs: fake handles, resource callbacks ---------------------------- */

typedef struct {
  void* graph;
  void* originalGraph;
  void* node;
  void* originalNode;
  int nodeType;
  void* dependency;
  void* graphExec;
} CUpti_GraphData;

typedef struct {
  void* context;
  void* stream;
  void* resourceDescriptor;
} CUpti_ResourceData;

#define MAX_FAKE_HANDLES 4096
struct fake_handle {
  uint64_t id;
};
static struct fake_handle g_fake_nodes[MAX_FAKE_HANDLES];
static struct fake_handle g_fake_graphs[MAX_FAKE_HANDLES];
static size_t g_fake_node_count, g_fake_graph_count;

static struct fake_handle* fake_handle(struct fake_handle* table, size_t* count, uint64_t id) {
  struct fake_handle* found = NULL;
  pthread_mutex_lock(&g_activity_lock);
  for (size_t i = 0; i < *count && found == NULL; ++i) {
    if (table[i].id == id) found = &table[i];
  }
  if (found == NULL && *count < MAX_FAKE_HANDLES) {
    found = &table[(*count)++];
    found->id = id;
  }
  pthread_mutex_unlock(&g_activity_lock);
  return found;
}

static int is_fake(const void* handle, const struct fake_handle* table) {
  const struct fake_handle* h = (const struct fake_handle*)handle;
  return h >= table && h < table + MAX_FAKE_HANDLES;
}

EXPORT CUptiResult cuptiGetGraphNodeId(void* node, uint64_t* id) {
  if (node == NULL || id == NULL || !is_fake(node, g_fake_nodes)) return CUPTI_ERROR_INVALID_PARAMETER;
  *id = ((struct fake_handle*)node)->id;
  return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiGetGraphId(void* graph, uint32_t* id) {
  if (graph == NULL || id == NULL || !is_fake(graph, g_fake_graphs)) return CUPTI_ERROR_INVALID_PARAMETER;
  *id = (uint32_t)((struct fake_handle*)graph)->id;
  return CUPTI_SUCCESS;
}

static void invoke_resource(uint32_t cbid, CUpti_GraphData* graph_data) {
  CUpti_CallbackFunc callback;
  void* userdata;
  pthread_mutex_lock(&g_lock);
  callback = g_subscribed && g_enabled[CUPTI_CB_DOMAIN_RESOURCE][cbid] ? g_callback : NULL;
  userdata = g_userdata;
  pthread_mutex_unlock(&g_lock);
  if (callback == NULL) return;
  CUpti_ResourceData data = {g_context, NULL, graph_data};
  callback(userdata, CUPTI_CB_DOMAIN_RESOURCE, cbid, &data);
}

static void node_created(uint64_t graph_id, uint64_t node_id) {
  CUpti_GraphData graph_data;
  memset(&graph_data, 0, sizeof graph_data);
  graph_data.graph = fake_handle(g_fake_graphs, &g_fake_graph_count, graph_id);
  graph_data.node = fake_handle(g_fake_nodes, &g_fake_node_count, node_id);
  graph_data.nodeType = 0; /* CU_GRAPH_NODE_TYPE_KERNEL */
  invoke_resource(CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED, &graph_data);
}

/* cudaLaunchKernel on a stream being captured into graph `graph_id`: the
 * launch callbacks run, and inside the call the node is created. */
EXPORT void tbpipe_double_capture_launch(const char* symbol, uint32_t correlation, uint64_t graph_id,
                                         uint64_t node_id) {
  static const int host_stub = 0;
  cudaLaunchKernel_v7000_params params = {&host_stub, {8, 1, 1}, {64, 1, 1}, NULL, 0, (void*)(uintptr_t)0x7000};
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaLaunchKernel_v7000, CUPTI_API_ENTER, "cudaLaunchKernel", symbol, &params,
         correlation);
  node_created(graph_id, node_id);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaLaunchKernel_v7000, CUPTI_API_EXIT, "cudaLaunchKernel", symbol, &params,
         correlation);
}

/* cudaGraphAddKernelNode: a node made by the graph API, not by a captured launch. */
EXPORT void tbpipe_double_graph_add_kernel_node(uint64_t graph_id, uint64_t node_id, uint32_t correlation) {
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaGraphAddKernelNode_v10000, CUPTI_API_ENTER, "cudaGraphAddKernelNode", NULL,
         NULL, correlation);
  node_created(graph_id, node_id);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaGraphAddKernelNode_v10000, CUPTI_API_EXIT, "cudaGraphAddKernelNode", NULL,
         NULL, correlation);
}

/* cudaGraphInstantiate: each node of the graph cloned into the executable graph. */
EXPORT void tbpipe_double_graph_clone_node(uint64_t exec_graph_id, uint64_t original_node_id, uint64_t node_id) {
  CUpti_GraphData graph_data;
  memset(&graph_data, 0, sizeof graph_data);
  graph_data.graph = fake_handle(g_fake_graphs, &g_fake_graph_count, exec_graph_id);
  graph_data.node = fake_handle(g_fake_nodes, &g_fake_node_count, node_id);
  graph_data.originalNode = fake_handle(g_fake_nodes, &g_fake_node_count, original_node_id);
  invoke_resource(CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED, &graph_data);
}

/* ---- test control: copies and sets ---------------------------------------- */

typedef struct {
  void* dst;
  const void* src;
  size_t count;
  int kind;
  void* stream;
} cudaMemcpyAsync_v3020_params;

typedef struct {
  void* devPtr;
  int value;
  size_t count;
  void* stream;
} cudaMemsetAsync_v3020_params;

/* cudaMemcpyAsync, reaching the driver's cuMemcpyAsync inside. */
EXPORT void tbpipe_double_cuda_memcpy_async(size_t bytes, int kind, uintptr_t stream, uint32_t correlation) {
  cudaMemcpyAsync_v3020_params params = {NULL, NULL, bytes, kind, (void*)stream};
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaMemcpyAsync_v3020, CUPTI_API_ENTER, "cudaMemcpyAsync", NULL, &params,
         correlation);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuMemcpyAsync, CUPTI_API_ENTER, "cuMemcpyAsync", NULL, NULL,
         correlation + 100000);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuMemcpyAsync, CUPTI_API_EXIT, "cuMemcpyAsync", NULL, NULL,
         correlation + 100000);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaMemcpyAsync_v3020, CUPTI_API_EXIT, "cudaMemcpyAsync", NULL, &params,
         correlation);
}

EXPORT void tbpipe_double_cuda_memset_async(size_t bytes, uintptr_t stream, uint32_t correlation) {
  cudaMemsetAsync_v3020_params params = {NULL, 0, bytes, (void*)stream};
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaMemsetAsync_v3020, CUPTI_API_ENTER, "cudaMemsetAsync", NULL, &params,
         correlation);
  invoke(CUPTI_CB_DOMAIN_RUNTIME_API, RT_cudaMemsetAsync_v3020, CUPTI_API_EXIT, "cudaMemsetAsync", NULL, &params,
         correlation);
}

/* cuMemsetD32Async called directly (a library on the driver API). */
EXPORT void tbpipe_double_cu_memset_d32_async(uint32_t correlation) {
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuMemsetD32Async, CUPTI_API_ENTER, "cuMemsetD32Async", NULL, NULL,
         correlation);
  invoke(CUPTI_CB_DOMAIN_DRIVER_API, DRV_cuMemsetD32Async, CUPTI_API_EXIT, "cuMemsetD32Async", NULL, NULL, correlation);
}
