// Rotary position embedding inside a KV-cache append (AppendParams' rotary fields), shared by the
// CPU and CUDA backends: the positions a sequence uses, the feature pairs of a head, and the
// rotation of one pair in the accumulator type (float32, float64 for float64 inputs). Each product
// is rounded on its own (no fused multiply-add), then the difference and the sum, as torch's
// elementwise ops round x1 * cos - x2 * sin and x1 * sin + x2 * cos: the kernels give the bits of
// that composition, rounded once to the element type.
#pragma once
#include <cstdint>

#include "../params.h"
#include "hd.h"

namespace flashattn {

// Positions sequence b uses from seqlens[b] on: its new keys' and its query rows' (every row at
// seqlens[b] when they are not consecutive).
FLASHATTN_HD int64_t rotary_span(const AppendParams& p) {
  const int64_t q_rows = !p.q ? 0 : p.q_rows_consecutive ? p.len_q : (p.len_q > 0 ? 1 : 0);
  return p.len_new > q_rows ? p.len_new : q_rows;
}

// Every position sequence b uses is a row of the tables (for a sequence whose seqlens[b] >= 0).
FLASHATTN_HD bool rotary_positions_allowed(const AppendParams& p, int64_t b) {
  return !p.rotary_cos || int64_t(p.seqlens[b]) + rotary_span(p) <= p.rotary_positions;
}

FLASHATTN_HD int64_t q_position(const AppendParams& p, int64_t b, int64_t i) {
  return int64_t(p.seqlens[b]) + (p.q_rows_consecutive ? i : 0);
}

// Unit u (0 <= u < rotary_units) of a head: the pair of features rotated together (interleaved
// 2u, 2u + 1, or u, u + half), or past the pairs one feature passed through (first == second).
struct FeatureUnit {
  int64_t first, second;
  bool rotated;
};
FLASHATTN_HD int64_t rotary_units(const AppendParams& p) { return p.head_dim - p.rotary_half; }
FLASHATTN_HD FeatureUnit feature_unit(const AppendParams& p, int64_t u) {
  if (u >= p.rotary_half) return FeatureUnit{u + p.rotary_half, u + p.rotary_half, false};
  return p.rotary_interleaved ? FeatureUnit{2 * u, 2 * u + 1, true} : FeatureUnit{u, u + p.rotary_half, true};
}

// a * b rounded to Acc, never fused with a following addition.
FLASHATTN_HD float product(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;  // (a store and a load the compiler cannot contract into an fma)
  return r;
#endif
}
FLASHATTN_HD double product(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  volatile double r = a * b;
  return r;
#endif
}

template <class Acc>
struct RotatedPair {
  Acc first, second;
};
template <class Acc>
FLASHATTN_HD RotatedPair<Acc> rotate_pair(Acc x1, Acc x2, Acc cos, Acc sin) {
  return RotatedPair<Acc>{product(x1, cos) - product(x2, sin), product(x1, sin) + product(x2, cos)};
}

}  // namespace flashattn
