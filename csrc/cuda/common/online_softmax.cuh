// Online softmax in the exponent domain the kernels use: base 2 with log2(e) folded into the
// score scale for fp32 accumulation, natural exp for fp64.
#pragma once
#include "numeric.cuh"

namespace flashattn::cuda {

template <class Acc> struct ExpDomain;

template <> struct ExpDomain<float> {
  static constexpr double kLog2e = 1.4426950408889634;
  static constexpr float kLn2 = 0.6931471805599453f;
  static __device__ __forceinline__ float score_scale(double scale) { return float(scale * kLog2e); }
  // 2^x as one MUFU.EX2: exp2f's ex2.approx.f32 adds three instructions to keep subnormal
  // results, which no probability needs (the .ftz form flushes values below 2^-126 to 0).
  static __device__ __forceinline__ float exp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  // 2^x on the FMA pipe instead of the MUFU (which shares the MIO queue with the shared-memory
  // loads): 2^round(x) from the exponent bits times a degree-4 polynomial for 2^f, f in [-0.5, 0.5]
  // (relative error 2.7e-6, for probabilities that round to fp16 / bf16 next). For x <= ~1; x below
  // -127 (and -inf) gives 0, as the .ftz MUFU does; NaN stays NaN (the clamp's compare is false).
  static __device__ __forceinline__ float exp_fma(float x) {
    constexpr float kRound = 12582912.f;  // 1.5 * 2^23: x + kRound holds round(x) in its low mantissa bits
    x = x < -127.f ? -127.f : x;
    const float t = x + kRound;
    const float f = x - (t - kRound);
    float p = 0.009570101276f;
    p = fmaf(p, f, 0.05591785907f);
    p = fmaf(p, f, 0.2402474433f);
    p = fmaf(p, f, 0.6931217909f);
    p = fmaf(p, f, 0.9999992847f);
    return p * __int_as_float((__float_as_int(t) << 23) + (127 << 23));  // times 2^round(x)
  }
  // exp(x) where `keep`, else 0. The exponential is computed either way: the compiler does not
  // if-convert the inline asm, and a branch per score cost two convergence instructions.
  static __device__ __forceinline__ float exp_if(bool keep, float x) {
    const float y = exp(x);
    return keep ? y : 0.f;
  }
  // Natural-log LSE from a base-2 running max and the sum of 2^(s - max).
  static __device__ __forceinline__ float lse(float row_max, float row_sum) {
    return row_max * kLn2 + logf(row_sum);
  }
  static __device__ __forceinline__ float from_lse(float lse) { return lse * float(kLog2e); }
};

template <> struct ExpDomain<double> {
  static __device__ __forceinline__ double score_scale(double scale) { return scale; }
  static __device__ __forceinline__ double exp(double x) { return ::exp(x); }
  static __device__ __forceinline__ double exp_if(bool keep, double x) { return keep ? ::exp(x) : 0.0; }
  static __device__ __forceinline__ double lse(double row_max, double row_sum) {
    return row_max + ::log(row_sum);
  }
  static __device__ __forceinline__ double from_lse(double lse) { return lse; }
};

// The subtrahend of exp(x - max): the max, or 0 for a row with no visible key yet (max -inf).
template <class Acc> __device__ __forceinline__ Acc exp_base(Acc row_max) {
  return row_max == neg_inf<Acc>() ? Acc(0) : row_max;
}

// Reduces x[0..N) with `op` pairwise, leaving independent operations for the scheduler at every
// level (an element without a partner at a level is carried up); the result is in x[0].
template <class Acc, int N, class Op>
__device__ __forceinline__ Acc tree_reduce(Acc (&x)[N], Op op) {
#pragma unroll
  for (int w = 1; w < N; w *= 2)
#pragma unroll
    for (int j = 0; j + w < N; j += 2 * w) x[j] = op(x[j], x[j + w]);
  return x[0];
}

// Reductions over the kLanes consecutive lanes that share a row: a half-warp in the SIMT
// kernels, the 4 lanes of a quad in the tensor-core ones.
template <int kLanes, class Acc> __device__ __forceinline__ Acc reduce_max_lanes(Acc x) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) x = acc_max(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
template <int kLanes, class Acc> __device__ __forceinline__ Acc reduce_sum_lanes(Acc x) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// One online-softmax step for a thread's slice of a row. `s` holds scaled scores (masked ones
// -inf) and becomes the unnormalised probabilities; returns the factor that rescales the old
// accumulator. `row_sum` stays a per-thread partial sum (every lane of the row group shares
// `row_max`, so partials add up at the end). A row with no visible key so far keeps max -inf,
// sum 0 and a zero accumulator; using 0 as the base avoids (-inf) - (-inf).
template <int kLanes, class Acc, int N>
__device__ __forceinline__ Acc online_softmax_step(Acc (&s)[N], Acc& row_max, Acc& row_sum) {
  Acc tile_max = s[0];
#pragma unroll
  for (int j = 1; j < N; ++j) tile_max = acc_max(tile_max, s[j]);
  tile_max = reduce_max_lanes<kLanes>(tile_max);
  const Acc new_max = acc_max(row_max, tile_max);
  const Acc base = exp_base(new_max);
  const Acc alpha = ExpDomain<Acc>::exp(row_max - base);
  row_max = new_max;
  Acc sum = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    s[j] = ExpDomain<Acc>::exp(s[j] - base);
    sum += s[j];
  }
  row_sum = row_sum * alpha + sum;
  return alpha;
}

// Merges the softmax state of some rows' other keys (max m_i, sum l_i, unnormalised O whose float4 c is
// load(c)) into a running one (max, sum, acc), both rescaled to the larger max: how split work over one row's keys
// (warps, parts of a walk) is added up. The order of the adds fixes the result.
template <int N, class Load>
__device__ __forceinline__ void merge_softmax_state(float& max, float& sum, float4 (&acc)[N], float m_i, float l_i,
                                                    Load load) {
  const float new_max = acc_max(max, m_i), base = exp_base(new_max);
  const float a = ExpDomain<float>::exp(max - base), f = ExpDomain<float>::exp(m_i - base);
  max = new_max;
  sum = sum * a + l_i * f;
#pragma unroll
  for (int c = 0; c < N; ++c) {
    const float4 x = load(c);
    acc[c] = make_float4(acc[c].x * a + x.x * f, acc[c].y * a + x.y * f, acc[c].z * a + x.z * f,
                         acc[c].w * a + x.w * f);
  }
}

}  // namespace flashattn::cuda
