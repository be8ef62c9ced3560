// The optional features inside the CUDA kernels, with the per-score math of csrc/common/
// that the CPU backend uses too: softcap, ALiBi and the bias tensor (ScoreMods) and the
// dropout keep mask (DropoutMask), for one (sequence, query head).
#pragma once
#include <cstdint>

#include "../../common/dropout.h"
#include "../../common/score_mods.h"
#include "../../common/sequence.h"
#include "numeric.cuh"

namespace flashattn::cuda {

template <class Acc>
__device__ __forceinline__ Acc load_as_acc(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat64: return Acc(static_cast<const double*>(base)[i]);
    case DType::kFloat32: return Acc(static_cast<const float*>(base)[i]);
    case DType::kBFloat16: return Acc(__bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]));
    default: return Acc(__half2float(static_cast<const __half*>(base)[i]));
  }
}

// Softcap, ALiBi and bias of one (sequence, query head). Kernels take their plain path (one
// multiply by the scale) when `any` is false.
template <class Acc>
struct ScoreMods {
  bool any;
  Acc scale, softcap, slope;
  bool alibi;
  BiasKind bias_kind;
  DType bias_dtype;
  const void* bias;
  int64_t bias_base, bias_row, bias_col;
  int64_t len_q, len_k;

  __device__ ScoreMods(const FwdParams& p, const Seq& sq, int64_t h)
      : any(p.softcap > 0.0 || p.alibi_slopes != nullptr || p.bias_kind != BiasKind::kNone),
        scale(Acc(p.scale)),
        softcap(Acc(p.softcap)),
        slope(p.alibi_slopes ? Acc(p.alibi_slopes[sq.b * p.alibi_batch_stride + h]) : Acc(0)),
        alibi(p.alibi_slopes != nullptr),
        bias_kind(p.bias_kind),
        bias_dtype(p.bias_dtype),
        bias(p.bias),
        bias_base(sq.b * p.bias_stride[0] + h * p.bias_stride[1]),
        bias_row(p.bias_stride[2]),
        bias_col(p.bias_stride[3]),
        len_q(sq.len_q),
        len_k(sq.len_k) {}

  // The natural-log-domain score of raw = q.k at (m, n), both in range: scaled, softcapped
  // (tanh(s / softcap) goes to *th for the backward), plus ALiBi and bias; -inf where a bool
  // mask removes it.
  __device__ __forceinline__ Acc score(Acc raw, int64_t m, int64_t n, Acc* th) const {
    Acc x = raw * scale;
    if (softcap > Acc(0)) {
      *th = softcap_tanh(x, softcap);
      x = softcap * *th;
    }
    if (alibi) x += alibi_bias(slope, m, n, len_q, len_k);
    if (bias_kind == BiasKind::kBool) {
      if (!static_cast<const bool*>(bias)[bias_base + m * bias_row + n * bias_col]) x = neg_inf<Acc>();
    } else if (bias_kind == BiasKind::kFloat) {
      x += load_as_acc<Acc>(bias, bias_dtype, bias_base + m * bias_row + n * bias_col);
    }
    return x;
  }

  // score() for a thread's scores of one row m: x[i] is the raw q.k at key n0 + col(i), in the
  // row's band where lo <= col(i) < hi; it becomes the natural-log-domain score, -inf outside
  // the band or where a bool mask removes it. Each feature is tested once per row, not per
  // score, and the row's mask/bias loads are issued together so their latencies overlap.
  template <int kN, class Col>
  __device__ __forceinline__ void score_row(Acc (&x)[kN], int64_t m, int64_t n0, int lo, int hi, Col col) const {
    bool in[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      in[i] = col(i) >= lo && col(i) < hi;
      x[i] *= scale;
    }
    if (softcap > Acc(0)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) x[i] = softcap * softcap_tanh(x[i], softcap);
    }
    if (alibi) {
#pragma unroll
      for (int i = 0; i < kN; ++i) x[i] += alibi_bias(slope, m, n0 + col(i), len_q, len_k);
    }
    const int64_t row = bias_base + m * bias_row + n0 * bias_col;
    if (bias_kind == BiasKind::kBool) {
      const bool* mask = static_cast<const bool*>(bias) + row;
      bool keep[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) keep[i] = in[i] && mask[col(i) * bias_col];
#pragma unroll
      for (int i = 0; i < kN; ++i) in[i] = keep[i];
    } else if (bias_kind == BiasKind::kFloat) {
      auto add = [&](auto element) {
        using B = decltype(element);
        const B* b = static_cast<const B*>(bias) + row;
        Acc v[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] = in[i] ? Acc(to_acc(b[col(i) * bias_col])) : Acc(0);
#pragma unroll
        for (int i = 0; i < kN; ++i) x[i] += v[i];
      };
      switch (bias_dtype) {
        case DType::kFloat64: add(double()); break;
        case DType::kFloat32: add(float()); break;
        case DType::kBFloat16: add(__nv_bfloat16()); break;
        default: add(__half()); break;
      }
    }
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (!in[i]) x[i] = neg_inf<Acc>();
  }
};

// Dropout keep mask of one (sequence, query head): one Philox call per score (the kernels'
// threads hold columns 16 apart, so the other three words of a call go unused).
template <class Acc>
struct DropoutMask {
  bool on;
  uint32_t threshold, offset;
  uint64_t seed;
  int64_t bh;
  Acc inv_keep;  // 1 / (1 - p)

  __device__ DropoutMask(const FwdParams& p, const Seq& sq, int64_t h)
      : on(p.dropout_p > 0.0),
        threshold(dropout_threshold(p.dropout_p)),
        offset(p.dropout_offset),
        seed(p.dropout_seed),
        bh(sq.b * p.heads_q + h),
        inv_keep(Acc(1.0 / (1.0 - p.dropout_p))) {}

  __device__ __forceinline__ bool keep(int64_t m, int64_t n) const {
    const Philox4 w = dropout_bits(seed, offset, bh, m, n >> 2);
    const int i = int(n & 3);
    const uint32_t word = i == 0 ? w.x[0] : i == 1 ? w.x[1] : i == 2 ? w.x[2] : w.x[3];
    return word >= threshold;
  }
};

}  // namespace flashattn::cuda
