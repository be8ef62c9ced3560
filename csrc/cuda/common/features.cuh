// The optional features inside the CUDA kernels, with the per-score math of csrc/common/
// that the CPU backend uses too: softcap, ALiBi and the bias tensor (ScoreMods) and the
// dropout keep mask (DropoutMask), for one (sequence, query head).
#pragma once
#include <cstdint>

#include "../../common/dropout.h"
#include "../../common/score_mods.h"
#include "../../common/sequence.h"
#include "bias_tile_layout.h"
#include "numeric.cuh"
#include "online_softmax.cuh"

namespace flashattn::cuda {

// Address of the bias element at (m, n) of (sequence, query head h).
__device__ __forceinline__ const unsigned char* bias_element(const FwdParams& p, const Seq& sq, int64_t h, int64_t m,
                                                             int64_t n) {
  return static_cast<const unsigned char*>(p.bias) +
         (sq.b * p.bias_stride[0] + h * p.bias_stride[1] + m * p.bias_stride[2] + n * p.bias_stride[3]) *
             bias_elem_bytes(p.bias_kind, p.bias_dtype);
}

// Readers of one bias element as the value added to a natural-log-domain score: the float
// bias itself, 0 or -inf for a bool mask (so a masked score becomes -inf by the same add). One
// type per element type, so per-score code carries no dtype branch.
struct NoBias {
  static constexpr int kBytes = 0;
};
struct MaskBias {
  static constexpr int kBytes = 1;
  template <class Acc>
  __device__ __forceinline__ Acc value(const unsigned char* e) const {
    return *e ? Acc(0) : neg_inf<Acc>();
  }
};
template <class B>
struct FloatBias {
  static constexpr int kBytes = sizeof(B);
  template <class Acc>
  __device__ __forceinline__ Acc value(const unsigned char* e) const {
    return Acc(to_acc(*reinterpret_cast<const B*>(e)));
  }
};

// Calls f with the reader of a bias of kind k in dtype t (NoBias without one), for any dtype.
template <class F>
__device__ __forceinline__ void with_any_bias_reader(BiasKind k, DType t, F&& f) {
  if (k == BiasKind::kNone) f(NoBias{});
  else if (k == BiasKind::kBool) f(MaskBias{});
  else if (t == DType::kFloat64) f(FloatBias<double>{});
  else if (t == DType::kFloat32) f(FloatBias<float>{});
  else if (t == DType::kBFloat16) f(FloatBias<__nv_bfloat16>{});
  else f(FloatBias<__half>{});
}

// The same for kernels with Elem inputs: a float bias is float32 or Elem (what the op
// accepts), so three readers (fewer copies of the caller's per-score code).
template <class Elem, class F>
__device__ __forceinline__ void with_bias_reader(BiasKind k, DType t, F&& f) {
  if (k == BiasKind::kNone) f(NoBias{});
  else if (k == BiasKind::kBool) f(MaskBias{});
  else if (t == DType::kFloat32) f(FloatBias<float>{});
  else f(FloatBias<Elem>{});
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
  int bias_bytes;                 // of one element
  const unsigned char* bias;      // element (0, 0) of this (sequence, head)
  int64_t bias_row, bias_col;     // element strides
  int64_t len_q, len_k;

  __device__ ScoreMods(const FwdParams& p, const Seq& sq, int64_t h)
      : any(p.softcap > 0.0 || p.alibi_slopes != nullptr || p.bias_kind != BiasKind::kNone),
        scale(Acc(p.scale)),
        softcap(Acc(p.softcap)),
        slope(p.alibi_slopes ? Acc(p.alibi_slopes[sq.b * p.alibi_batch_stride + h]) : Acc(0)),
        alibi(p.alibi_slopes != nullptr),
        bias_kind(p.bias_kind),
        bias_dtype(p.bias_dtype),
        bias_bytes(bias_elem_bytes(p.bias_kind, p.bias_dtype)),
        bias(bias_element(p, sq, h, 0, 0)),
        bias_row(p.bias_stride[2]),
        bias_col(p.bias_stride[3]),
        len_q(sq.len_q),
        len_k(sq.len_k) {}

  // Address of the bias element at (m, n) in global memory.
  __device__ __forceinline__ const unsigned char* bias_at(int64_t m, int64_t n) const {
    return bias + (m * bias_row + n * bias_col) * bias_bytes;
  }

  // The natural-log-domain scores of a thread's set of scores: x[i] is the raw q.k at
  // (m + pos(i).x, n + pos(i).y) and becomes scale * x, softcapped (tanh(s / softcap) to th[i]
  // when th is given, for the backward), plus ALiBi and bias; -inf where in[i] is false or a
  // bool mask removes it. The bias element of score i is read at at(i) (shared or global
  // memory; read for every i, so it must be addressable). Each feature is tested once per set,
  // and the set's bias loads are issued together so their latencies overlap.
  template <int kN, class Pos, class At>
  __device__ __forceinline__ void scores(Acc (&x)[kN], const bool (&in)[kN], int64_t m, int64_t n, Pos pos,
                                         At at, Acc* th) const {
#pragma unroll
    for (int i = 0; i < kN; ++i) x[i] *= scale;
    if (softcap > Acc(0)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const Acc t = softcap_tanh(x[i], softcap);
        if (th != nullptr) th[i] = t;
        x[i] = softcap * t;
      }
    }
    if (alibi) {
#pragma unroll
      for (int i = 0; i < kN; ++i) x[i] += alibi_bias(slope, m + pos(i).x, n + pos(i).y, len_q, len_k);
    }
    with_any_bias_reader(bias_kind, bias_dtype, [&](auto reader) {
      using R = decltype(reader);
      if constexpr (R::kBytes > 0) {
        Acc v[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] = reader.template value<Acc>(at(i));
#pragma unroll
        for (int i = 0; i < kN; ++i) x[i] += v[i];
      }
    });
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (!in[i]) x[i] = neg_inf<Acc>();
  }

  // One score (m, n), in range, its bias read from global memory.
  __device__ __forceinline__ Acc score(Acc raw, int64_t m, int64_t n, Acc* th) const {
    Acc x[1] = {raw};
    const bool in[1] = {true};
    scores(x, in, m, n, [](int) { return int2{0, 0}; }, [&](int) { return bias_at(m, n); }, th);
    return x[0];
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
        offset(p.dropout_state ? uint32_t(uint64_t(p.dropout_state[1])) : p.dropout_offset),
        seed(p.dropout_state ? uint64_t(p.dropout_state[0]) : p.dropout_seed),
        bh(sq.b * p.heads_q + h),
        inv_keep(Acc(1.0 / (1.0 - p.dropout_p))) {}

  __device__ __forceinline__ bool keep(int64_t m, int64_t n) const {
    const Philox4 w = dropout_bits(seed, offset, bh, m, n >> 2);
    const int i = int(n & 3);
    const uint32_t word = i == 0 ? w.x[0] : i == 1 ? w.x[1] : i == 2 ? w.x[2] : w.x[3];
    return word >= threshold;
  }
};

// The bias-gradient rows of (sequence, head h), (len_q, len_k) row-major, or null.
template <class Acc>
__device__ __forceinline__ Acc* dbias_rows(const BwdParams& p, const Seq& sq, int64_t h) {
  return p.dbias ? static_cast<Acc*>(p.dbias) + (sq.b * p.heads_q + h) * sq.len_q * sq.len_k : nullptr;
}

// The backward's step on one score with the optional features, after ScoreMods::scores: x is
// the score the softmax took (natural log domain, -inf where masked), `vis` whether (m, n) is
// in the row's band (and the row has an LSE), th the softcap's tanh. `s` becomes the
// probability as P V used it (dropped ones 0, kept ones / (1 - p)), `dp` becomes dS; both 0
// where the score is masked. dS goes to dbias (when given) before the softcap's derivative
// enters it. `lse` is in the exponent domain.
template <class Acc>
__device__ __forceinline__ void feature_grad(Acc& s, Acc& dp, Acc x, bool vis, Acc th, Acc lse, Acc dsum,
                                             int64_t m, int64_t n, const Seq& sq, const ScoreMods<Acc>& mods,
                                             const DropoutMask<Acc>& drop, Acc* dbias) {
  const bool live = x != neg_inf<Acc>();
  const Acc pr = ExpDomain<Acc>::exp_if(live, x * ExpDomain<Acc>::score_scale(1.0) - lse);
  const Acc kept = !drop.on ? Acc(1) : (vis && drop.keep(m, n)) ? drop.inv_keep : Acc(0);
  Acc ds = live ? pr * (dp * kept - dsum) : Acc(0);
  if (dbias != nullptr && vis) dbias[m * sq.len_k + n] = ds;
  if (mods.softcap > Acc(0)) ds *= Acc(1) - th * th;
  dp = ds;
  s = live ? pr * kept : Acc(0);
}

}  // namespace flashattn::cuda
