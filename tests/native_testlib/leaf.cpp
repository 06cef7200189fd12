// A second test library: chain.cpp calls into it through the PLT and it calls
// back into chain.cpp through a function pointer, so the walked stack crosses
// library boundaries in both directions.
extern "C" {

volatile int leaf_sink;

__attribute__((noinline)) void leaf_bounce(int n, void (*k)(int)) {
  k(n);
  leaf_sink = leaf_sink + 1;  // keeps the call a call, not a tail jump
}

}  // extern "C"
