// A C++ library for demangling: namespaces, a class template, an inlined member function
// and STL code inlined from the system headers.
#include <cstddef>
#include <vector>

namespace tbx {

template <typename T>
struct Accumulator {
  T total{};
  inline __attribute__((always_inline)) void add(T value) { total += value * 2; }
};

static inline __attribute__((always_inline)) long fold(const std::vector<long>& values) {
  Accumulator<long> acc;
  for (long v : values) acc.add(v);
  return acc.total;
}

__attribute__((noinline)) long entry(const std::vector<long>& values, int extra) { return fold(values) + extra; }

}  // namespace tbx

extern "C" long tb_cxx_entry(int n) {
  std::vector<long> values(static_cast<std::size_t>(n), 3);
  return tbx::entry(values, n);
}
