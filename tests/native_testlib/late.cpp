// Loaded by the tests only after a first walk, to check that the module
// registry finds libraries dlopen'ed later. LATE_VARIANT changes the code so
// that two builds get different build-IDs.
#ifndef LATE_VARIANT
#define LATE_VARIANT 1
#endif

extern "C" {

volatile int late_sink;

__attribute__((noinline)) int late_call(void (*cb)(void)) {
  cb();
  late_sink = late_sink + LATE_VARIANT;
  return LATE_VARIANT;
}

}  // extern "C"
