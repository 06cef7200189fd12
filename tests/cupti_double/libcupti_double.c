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
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUptiResult;
typedef void (*CUpti_CallbackFunc)(void* userdata, int domain, uint32_t cbid, const void* cbdata);
typedef struct CUpti_Subscriber_st* CUpti_SubscriberHandle;

enum {
  CUPTI_SUCCESS = 0,
  CUPTI_ERROR_INVALID_PARAMETER = 1,
  CUPTI_ERROR_NOT_INITIALIZED = 15,
  CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39,
  CUPTI_ERROR_UNKNOWN = 999,
};
enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 };
enum { CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RUNTIME_API = 2 };

/* cbids from cupti_runtime_cbid.h / cupti_driver_cbid.h */
enum {
  RT_cudaLaunchKernel_v7000 = 211,
  RT_cudaLaunchKernelExC_v11060 = 430,
  RT_cudaGraphLaunch_v10000 = 311,
  DRV_cuLaunchKernel = 307,
  DRV_cuLaunchKernelEx = 652,
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
static unsigned char g_enabled[3][1024]; /* [domain][cbid] */
static int g_fake_context_token;
static void* const g_context = &g_fake_context_token;

static void invoke(int domain, uint32_t cbid, int site, const char* api, const char* symbol, const void* params,
                   uint32_t correlation) {
  CUpti_CallbackFunc callback;
  void* userdata;
  pthread_mutex_lock(&g_lock);
  callback = g_subscribed && domain < 3 && cbid < 1024 && g_enabled[domain][cbid] ? g_callback : NULL;
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
  if (subscriber != (CUpti_SubscriberHandle)&g_subscriber_token || domain < 1 || domain > 2 || cbid >= 1024) {
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
  if (subscriber != (CUpti_SubscriberHandle)&g_subscriber_token || domain < 1 || domain > 2) {
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
  if (domain < 0 || domain > 2 || cbid >= 1024) return 0;
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
