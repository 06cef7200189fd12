/* A C library with a three-deep inline chain, header-inlined code and a hot/cold split
 * (the abort() path goes to a .cold part), built by the symbolization tests with -O2 -g. */
#include <stdlib.h>

#include "mix.h"

static inline __attribute__((always_inline)) unsigned tb_leaf(const unsigned *p, int n) {
  unsigned h = 17;
  for (int i = 0; i < n; i++) h = tb_mix(h, p[i]);
  return h;
}

static inline __attribute__((always_inline)) unsigned tb_middle(const unsigned *p, int n) {
#ifdef TB_OTHER_BUILD
  n += 1; /* a different build of the same library: other code, other build-ID */
#endif
  if (__builtin_expect(n < 0, 0)) abort();
  return tb_leaf(p, n) + (unsigned)n;
}

__attribute__((noinline)) unsigned tb_outer(const unsigned *p, int n) {
  return tb_middle(p, n) * 3u;
}

__attribute__((noinline)) unsigned tb_second(unsigned x) {
  unsigned values[4] = {x, x + 1, x + 2, x + 3};
  return tb_outer(values, 4) ^ x;
}
