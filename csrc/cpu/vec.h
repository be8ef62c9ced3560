// Fixed-width SIMD vectors through the compiler's vector extension, so the same source
// becomes AVX2 code (or AVX-512, where the file is built for it) without intrinsics.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace flashattn::cpu {

#ifndef FLASHATTN_VEC_BYTES
#define FLASHATTN_VEC_BYTES 32
#endif
constexpr int kVecBytes = FLASHATTN_VEC_BYTES;

template <class A>
struct Vec {
  typedef A type __attribute__((vector_size(kVecBytes)));
  static constexpr int width = kVecBytes / sizeof(A);
};
template <class A>
using vec_t = typename Vec<A>::type;

template <class A>
inline vec_t<A> vload(const A* p) {
  vec_t<A> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <class A>
inline void vstore(A* p, vec_t<A> v) {
  std::memcpy(p, &v, sizeof(v));
}
template <class A>
inline vec_t<A> vbroadcast(A x) {
  return vec_t<A>{} + x;
}

// exp on a float vector: Cody-Waite range reduction to r in [-ln2/2, ln2/2], a degree-7
// polynomial (relative error ~2 ulp), and 2^n built in the exponent bits. Underflow
// (x < -87.3, including -inf) gives exactly 0 so masked scores drop out; NaN stays NaN.
inline vec_t<float> vexp(vec_t<float> x) {
  typedef int32_t vi __attribute__((vector_size(kVecBytes)));
  const vec_t<float> xc = x < -87.3f ? vbroadcast(-87.3f) : (x > 88.7f ? vbroadcast(88.7f) : x);
  const vec_t<float> n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const vec_t<float> r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  vec_t<float> p = vbroadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vec_t<float> two_n;
  std::memcpy(&two_n, &bits, sizeof(bits));
  const vec_t<float> y = p * two_n;
  return x != x ? x : (x < -87.3f ? vbroadcast(0.0f) : y);
}

inline vec_t<double> vexp(vec_t<double> x) {
  for (int i = 0; i < Vec<double>::width; ++i) x[i] = std::exp(x[i]);
  return x;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace flashattn::cpu
