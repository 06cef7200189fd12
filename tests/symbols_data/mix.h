/* Header-inlined code: its frames must name this file, not the .c file that includes it. */
#ifndef TB_MIX_H
#define TB_MIX_H

static inline __attribute__((always_inline)) unsigned tb_mix(unsigned h, unsigned v) {
  h ^= v;
  h *= 0x9e3779b1u;
  return (h << 5) | (h >> 27);
}

#endif
