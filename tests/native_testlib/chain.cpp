// Test library for tests/test_native_unwind.py, built by the test with g++.
//
// chain_run(depth, cb) builds a real call chain: chain_rec_a -> chain_rec_b ->
// (PLT) leaf_bounce in libtbpipe_leaf.so -> chain_rec_c -> chain_rec_a ... ->
// chain_realigned (alignas(64) + alloca: GCC's DRAP prologue, whose CFA rule is
// DW_CFA_def_cfa_expression "breg6 k; deref") -> chain_innermost, which records
// glibc backtrace() and then calls the Python callback. The test compares the
// unwinder's frames in these libraries with what backtrace() saw.
//
// Other entry points: the same chain with the innermost frame raising a signal
// (the walk runs in the handler, across glibc's __restore_rt), the chain on a
// std::thread, and a few hand-written assembly frames whose CFI is missing or
// deliberately wrong.

#include <alloca.h>
#include <execinfo.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <thread>

#define NOINLINE __attribute__((noinline))

extern "C" {

void leaf_bounce(int n, void (*k)(int));

typedef void (*callback_t)(void);
typedef size_t (*unwind_into_t)(uintptr_t* pcs, int32_t* modules, uint32_t* flags, size_t max,
                                int options);

enum { kBacktraceMax = 1024, kUnwindMax = 512 };

// What backtrace() saw in the innermost function.
void* chain_bt[kBacktraceMax];
int chain_bt_n;

// Filled by the signal handler: backtrace() and tbpipe's walk, both run there.
void* sig_bt[kBacktraceMax];
int sig_bt_n;
uintptr_t sig_pcs[kUnwindMax];
int32_t sig_modules[kUnwindMax];
uint32_t sig_flags[kUnwindMax];
size_t sig_n;

volatile int chain_sink;
static callback_t g_cb;
static int g_raise_signal;
static unwind_into_t g_unwind_into;

NOINLINE void chain_innermost(void) {
  chain_bt_n = backtrace(chain_bt, kBacktraceMax);
  if (g_raise_signal) {
    raise(SIGUSR1);
  } else {
    g_cb();
  }
  chain_sink = chain_sink + 1;
}

NOINLINE void chain_use(char* a, char* b) {
  a[0] = b[0];
  chain_sink = chain_sink + a[0];
}

// alignas(64) plus a variable-size alloca makes GCC realign the stack through
// a DRAP register: the CFA becomes *(rbp - k).
NOINLINE void chain_realigned(int n) {
  alignas(64) char aligned[64];
  char* dynamic = static_cast<char*>(alloca(static_cast<size_t>(n) + 16));
  memset(dynamic, n, static_cast<size_t>(n) + 16);
  chain_use(aligned, dynamic);
  chain_innermost();
  chain_sink = chain_sink + aligned[1];
}

NOINLINE void chain_rec_a(int n);

NOINLINE void chain_rec_c(int n) {
  chain_rec_a(n - 1);
  chain_sink = chain_sink + 1;
}

NOINLINE void chain_rec_b(int n) {
  leaf_bounce(n, chain_rec_c);  // through the PLT into libtbpipe_leaf.so
  chain_sink = chain_sink + 1;
}

NOINLINE void chain_rec_a(int n) {
  if (n <= 0) {
    chain_realigned((n & 7) + 8);
  } else {
    chain_rec_b(n);
  }
  chain_sink = chain_sink + 1;
}

int chain_run(int depth, callback_t cb) {
  g_cb = cb;
  g_raise_signal = 0;
  chain_rec_a(depth);
  return chain_bt_n;
}

static void chain_signal_handler(int, siginfo_t*, void*) {
  sig_bt_n = backtrace(sig_bt, kBacktraceMax);
  sig_n = g_unwind_into(sig_pcs, sig_modules, sig_flags, kUnwindMax, /*skip_own_module=*/1);
}

// Runs the chain; the innermost function raises SIGUSR1 and the handler walks.
int chain_signal_run(int depth, uintptr_t unwind_into) {
  g_unwind_into = reinterpret_cast<unwind_into_t>(unwind_into);
  struct sigaction sa, old;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = chain_signal_handler;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGUSR1, &sa, &old) != 0) return -1;
  g_raise_signal = 1;
  sig_n = 0;
  chain_rec_a(depth);
  g_raise_signal = 0;
  sigaction(SIGUSR1, &old, nullptr);
  return static_cast<int>(sig_n);
}

// The chain on a thread with no Python frames; the ctypes callback takes the
// GIL itself (PyGILState_Ensure) when it runs.
int chain_thread_run(int depth, callback_t cb) {
  std::thread t([depth, cb] { chain_run(depth, cb); });
  t.join();
  return chain_bt_n;
}

// Hand-written frames (x86-64), each calling cb(void) through %rdi.
void chain_nocfi_call(callback_t cb);      // no FDE at all, rbp frame
void chain_bad_cfa_call(callback_t cb);    // CFA = rsp + 1 GiB: outside any stack
void chain_r10_cfa_call(callback_t cb);    // CFA = r10 + 0: no recipe form

}  // extern "C"

#if defined(__x86_64__)
asm(R"(
    .text
    .globl chain_nocfi_call
    .type chain_nocfi_call, @function
chain_nocfi_call:
    pushq %rbp
    movq %rsp, %rbp
    callq *%rdi
    popq %rbp
    retq
    .size chain_nocfi_call, .-chain_nocfi_call

    .globl chain_bad_cfa_call
    .type chain_bad_cfa_call, @function
chain_bad_cfa_call:
    .cfi_startproc
    subq $8, %rsp
    .cfi_def_cfa_offset 0x40000000
    callq *%rdi
    addq $8, %rsp
    .cfi_def_cfa_offset 8
    retq
    .cfi_endproc
    .size chain_bad_cfa_call, .-chain_bad_cfa_call

    .globl chain_r10_cfa_call
    .type chain_r10_cfa_call, @function
chain_r10_cfa_call:
    .cfi_startproc
    pushq %r10
    .cfi_adjust_cfa_offset 8
    leaq 16(%rsp), %r10
    .cfi_def_cfa %r10, 0
    callq *%rdi
    .cfi_def_cfa %rsp, 16
    popq %r10
    .cfi_adjust_cfa_offset -8
    retq
    .cfi_endproc
    .size chain_r10_cfa_call, .-chain_r10_cfa_call
)");
#endif
