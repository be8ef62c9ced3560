// Fixed-width SIMD vectors through the compiler's vector extension, so the same source
// becomes AVX2 code, or AVX-512 code where kernels_avx512.cpp builds it, without intrinsics.
//
// Every header of the CPU kernels puts its code in namespace flashattn::cpu::FLASHATTN_CPU_ISA,
// one per instruction set the kernels are compiled for, so that the copies built with
// different vector widths never meet under one symbol name.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef FLASHATTN_CPU_ISA
#define FLASHATTN_CPU_ISA baseline
#endif

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

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

// exp on a float vector as 2^(x log2(e)): round to n, a degree-6 polynomial for 2^f on f in
// [-1/2, 1/2] (relative error < 1e-7), and 2^n built in the exponent bits. Callers pass
// differences of nearby scores (s - max, s - lse), which are exact in floating point, so the
// change of base adds no error that grows with the scores. Underflow (including -inf) gives
// exactly 0 so masked scores drop out; NaN stays NaN.
inline vec_t<float> vexp(vec_t<float> x) {
  typedef int32_t vi __attribute__((vector_size(kVecBytes)));
  const vec_t<float> t = x * 1.4426950408889634f;
  const vec_t<float> tc = t < -126.0f ? vbroadcast(-126.0f) : (t > 127.0f ? vbroadcast(127.0f) : t);
  const vec_t<float> n = (tc + 12582912.0f) - 12582912.0f;  // round to nearest
  const vec_t<float> f = tc - n;
  vec_t<float> p = vbroadcast(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vec_t<float> two_n;
  std::memcpy(&two_n, &bits, sizeof(bits));
  return t < -126.0f ? vbroadcast(0.0f) : p * two_n;
}

// tanh on a float vector, to about an ulp: an odd Taylor polynomial (through x^17) below
// |x| = 0.55, where 1 - 2 / (e^2|x| + 1) would cancel, and that formula above (with the sign
// put back). NaN stays NaN.
inline vec_t<float> vtanh(vec_t<float> x) {
  const vec_t<float> a = x < 0.0f ? -x : x;
  const vec_t<float> x2 = x * x;
  vec_t<float> p = vbroadcast(6404582.0f / 10854718875.0f);
  p = p * x2 - 929569.0f / 638512875.0f;
  p = p * x2 + 21844.0f / 6081075.0f;
  p = p * x2 - 1382.0f / 155925.0f;
  p = p * x2 + 62.0f / 2835.0f;
  p = p * x2 - 17.0f / 315.0f;
  p = p * x2 + 2.0f / 15.0f;
  p = p * x2 - 1.0f / 3.0f;
  const vec_t<float> small = x + x * x2 * p;
  const vec_t<float> big = 1.0f - 2.0f / (vexp(a + a) + 1.0f);
  return a < 0.55f ? small : (x < 0.0f ? -big : big);
}

inline vec_t<double> vexp(vec_t<double> x) {
  for (int i = 0; i < Vec<double>::width; ++i) x[i] = std::exp(x[i]);
  return x;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
