// CUDA kernel launches through the CUPTI callback API (the `cuda` source).
//
// libcupti is loaded at run time (dlopen), never linked: CI machines have no
// CUDA, and the process must pick the CUPTI that matches its CUDA runtime (the
// toolkit's, or the nvidia-cuda-cupti wheel torch came with). The few CUPTI
// types this needs are declared in cupti.cpp, checked against NVIDIA's headers
// by a test where those headers exist.
//
// The callback runs on the launching thread, usually with the GIL released. It
// never takes the GIL: it reads the launch parameters, formats them as JSON and
// hands them to Recorder::record_native, which walks the thread's own frames.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace tbpipe {

// Attribute text of one event from a native source: a JSON object built in a
// fixed buffer, without allocation, so it can run in any callback. A member
// that does not fit is left out whole and `"truncated": true` is added, so
// the text is always valid JSON.
class JsonAttrs {
 public:
  JsonAttrs() { reset(); }
  void reset() {
    text_[0] = '{';
    size_ = committed_ = 1;
    overflow_ = truncated_ = false;
  }

  // One member: open(key), any put_*() calls for its value, commit().
  void open(const char* key) {
    if (size_ > 1) put_char(',');
    put_char('"');
    put_raw(key, std::strlen(key));
    put_raw("\":", 2);
  }
  void commit() {
    if (overflow_) {
      size_ = committed_;
      overflow_ = false;
      truncated_ = true;
    } else {
      committed_ = size_;
    }
  }

  void put_char(char c) { put_raw(&c, 1); }
  void put_raw(const char* data, size_t size) {
    if (overflow_ || size_ + size > kCapacity - kReserve) {
      overflow_ = true;
      return;
    }
    std::memcpy(text_ + size_, data, size);
    size_ += size;
  }
  void put_uint(uint64_t value) {
    char digits[20];
    size_t count = 0;
    do {
      digits[count++] = static_cast<char>('0' + value % 10);
      value /= 10;
    } while (value != 0);
    char out[20];
    for (size_t i = 0; i < count; ++i) out[i] = digits[count - 1 - i];
    put_raw(out, count);
  }
  void put_int(int64_t value) {
    if (value < 0) {
      put_char('-');
      put_uint(static_cast<uint64_t>(-(value + 1)) + 1);  // no overflow at INT64_MIN
    } else {
      put_uint(static_cast<uint64_t>(value));
    }
  }
  void put_string(const char* data, size_t size) {
    put_char('"');
    for (size_t i = 0; i < size; ++i) {
      const unsigned char c = static_cast<unsigned char>(data[i]);
      if (c == '"' || c == '\\') {
        const char escaped[2] = {'\\', static_cast<char>(c)};
        put_raw(escaped, 2);
      } else if (c < 0x20) {
        static const char kHex[] = "0123456789abcdef";
        const char escaped[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]};
        put_raw(escaped, 6);
      } else {
        put_char(static_cast<char>(c));
      }
    }
    put_char('"');
  }

  void field_uint(const char* key, uint64_t value) {
    open(key);
    put_uint(value);
    commit();
  }
  void field_int(const char* key, int64_t value) {
    open(key);
    put_int(value);
    commit();
  }
  void field_string(const char* key, const char* value) {
    open(key);
    put_string(value, std::strlen(value));
    commit();
  }
  void field_dims(const char* key, uint64_t x, uint64_t y, uint64_t z) {
    open(key);
    put_char('[');
    put_uint(x);
    put_char(',');
    put_uint(y);
    put_char(',');
    put_uint(z);
    put_char(']');
    commit();
  }

  // The finished object; valid until the next reset().
  const char* finish(size_t* size) {
    size_ = committed_;
    overflow_ = false;
    if (truncated_) {
      static const char kMark[] = "\"truncated\":true";
      if (size_ > 1) text_[size_++] = ',';
      std::memcpy(text_ + size_, kMark, sizeof(kMark) - 1);
      size_ += sizeof(kMark) - 1;
    }
    text_[size_++] = '}';
    *size = size_;
    committed_ = size_;
    return text_;
  }

 private:
  static constexpr size_t kCapacity = 2048;
  static constexpr size_t kReserve = 24;  // room for ,"truncated":true}
  char text_[kCapacity];
  size_t size_ = 0;
  size_t committed_ = 0;
  bool overflow_ = false;
  bool truncated_ = false;
};

enum class CuptiStartStatus : int {
  kStarted = 0,
  kNoLibrary = 1,        // no candidate libcupti could be loaded
  kMissingSymbols = 2,   // loaded, but not a CUPTI with the callback API
  kOtherSubscriber = 3,  // CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (Kineto, Nsight, ...)
  kSubscribeFailed = 4,  // any other CUPTI error (no driver, no GPU, no permission, ...)
};

struct CuptiStartResult {
  CuptiStartStatus status = CuptiStartStatus::kNoLibrary;
  std::string library;  // path of the libcupti in use, when one was loaded
  std::string message;  // one line for the user when not started
  int enabled_callbacks = 0;
};

struct CuptiCounters {
  uint64_t kernel_launches = 0;  // kernel_launch events handed to the recorder
  uint64_t graph_launches = 0;   // graph_launch events handed to the recorder
  uint64_t nested_skipped = 0;   // driver launches made inside a runtime launch already recorded
  uint64_t not_recorded = 0;     // launches seen while the recorder was stopped, or dropped by it
  uint64_t transfers = 0;        // memcpy and memset events handed to the recorder
};

struct CuptiActivityStartResult {
  bool started = false;
  unsigned kinds = 0;        // GpuActivityKind bits CUPTI accepted
  bool graph_nodes = false;  // graph node callbacks enabled (replayed kernels lead to their captured launches)
  std::string message;       // why not started, or what was refused
  int64_t clock_offset_ns = 0;
};

// Loads the first loadable library of `candidates` (paths or sonames), then
// subscribes and enables the launch callbacks. Starting again while started
// only resumes recording. Never throws; never ends the process.
CuptiStartResult cupti_start(const std::vector<std::string>& candidates);
// With the launch callbacks subscribed: records GPU activity of `kinds`
// (GpuActivityKind bits, native/cupti_activity.h), memcpy/memset events when
// those kinds are asked for, and graph nodes as they are made.
CuptiActivityStartResult cupti_activity_start(unsigned kinds);
// Stops recording and unsubscribes, so another CUPTI client may subscribe;
// GPU activity still in CUPTI's buffers is flushed into the store first.
// The library stays loaded: a callback may still be running on some thread.
void cupti_stop();
bool cupti_subscribed();
CuptiCounters cupti_counters();

// The launch callbacks this source enables, and the constants, sizes and
// offsets of its own CUPTI declarations, named as in NVIDIA's headers: a test
// compiles the same names against the real headers where they are installed.
struct CuptiCallbackInfo {
  int domain;
  uint32_t cbid;
  const char* api;
  const char* cbid_name;
  bool graph;
};
std::vector<CuptiCallbackInfo> cupti_launch_callbacks();
std::vector<std::pair<std::string, uint64_t>> cupti_declared_abi();
// The same with the activity API's records and resource callbacks.
std::vector<std::pair<std::string, uint64_t>> cupti_declared_abi_all();

}  // namespace tbpipe
