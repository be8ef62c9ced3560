// The steps of the 1-D dK/dV kernel's query-tile loop (bwd_sm80.cuh), each on one warp's m16n8
// fragments of its 16 keys: S^T and dP^T (and a warp pair's exchange of partial sums), P^T and
// dS^T (the general per-score step, or the plain one), dQ = dS K.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../common/bias_tile.cuh"
#include "../common/features.cuh"
#include "../common/fragments.cuh"
#include "../common/numeric.cuh"
#include "../common/online_softmax.cuh"

namespace flashattn::cuda::sm80 {

// An accumulator atom (4 values of a lane) to / added from smem, 16 bytes (fp64: 2 x 16) at a time.
__device__ __forceinline__ void store_atom(float* dst, const float (&c)[4]) {
  *reinterpret_cast<float4*>(dst) = make_float4(c[0], c[1], c[2], c[3]);
}
__device__ __forceinline__ void store_atom(double* dst, const double (&c)[4]) {
  reinterpret_cast<double2*>(dst)[0] = make_double2(c[0], c[1]);
  reinterpret_cast<double2*>(dst)[1] = make_double2(c[2], c[3]);
}
__device__ __forceinline__ void add_atom(float (&c)[4], const float* src) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  c[0] += v.x; c[1] += v.y; c[2] += v.z; c[3] += v.w;
}
__device__ __forceinline__ void add_atom(double (&c)[4], const double* src) {
  const double2 a = reinterpret_cast<const double2*>(src)[0], b = reinterpret_cast<const double2*>(src)[1];
  c[0] += a.x; c[1] += a.y; c[2] += b.x; c[3] += b.y;
}

// The two products of the backward that share their shape, over the kDim head dims in smem
// rows of pitch kLd: s = A_s B_s^T and dp = A_dp B_dp^T for a warp's 16 A rows and kN B rows
// (8 per atom). The dK/dV kernel takes A = its keys of K, V and B = the query tile's Q, dO
// (S^T, dP^T).
template <class M, int kDim, int kLd, class Elem, class Acc, int kNA>
__device__ __forceinline__ void scores_and_dp(Acc (&s)[kNA][4], Acc (&dp)[kNA][4], const Elem* a_s,
                                              const Elem* a_dp, const Elem* b_s, const Elem* b_dp, int lane) {
#pragma unroll
  for (int j = 0; j < kNA; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = Acc(0);
#pragma unroll
  for (int kk = 0; kk < kDim; kk += M::kK) {
    typename M::A as, adp;
    M::load_a(as, a_s + kk, kLd, lane);
    M::load_a(adp, a_dp + kk, kLd, lane);
#pragma unroll
    for (int j = 0; j < kNA; j += 2) {
      typename M::B bs[2], bdp[2];
      M::load_b2_nk(bs, b_s + 8 * j * kLd + kk, kLd, lane);
      M::load_b2_nk(bdp, b_dp + 8 * j * kLd + kk, kLd, lane);
      M::mma(s[j], as, bs[0]);
      M::mma(s[j + 1], as, bs[1]);
      M::mma(dp[j], adp, bdp[0]);
      M::mma(dp[j + 1], adp, bdp[1]);
    }
  }
}

// Warp pairs (BwdConfig::kPair = 2): adds the partner's partial S^T and dP^T (the other half of the
// dims) through smem (sX: [kWarps][2 kQA][32 lanes][4]), atom by atom as held. Both warps get the
// same sums (a + b == b + a).
template <int kKeyGroups, int kWarps, class Acc, int kQA>
__device__ __forceinline__ void add_partner_sums(Acc (&st)[kQA][4], Acc (&dpt)[kQA][4], Acc* sX, int warp, int lane) {
  auto atom = [&](int w, int i) { return sX + ((w * 2 * kQA + i) * 32 + lane) * 4; };
#pragma unroll
  for (int i = 0; i < kQA; ++i) {
    store_atom(atom(warp, i), st[i]);
    store_atom(atom(warp, kQA + i), dpt[i]);
  }
  __syncthreads();
  const int partner = (warp + kKeyGroups) % kWarps;
#pragma unroll
  for (int i = 0; i < kQA; ++i) {
    add_atom(st[i], atom(partner, i));
    add_atom(dpt[i], atom(partner, kQA + i));
  }
}

// P^T and dS^T through the general per-score step (softcap, ALiBi, dropout, the bias gradient:
// ScoreMods and feature_grad) for the warp's keys (from wkey) of key tile n0 against query tile m0.
// On masked tiles the warp's key kw (0..15) is visible to tile row `row` iff lo0 + row <= kw <=
// hi0 + row and kw < k_lim (bwd_dkdv_kernel's band_bases); rows without a visible key (LSE -inf)
// and rows past the sequence see none.
template <int kBM, class Acc, int kQA, class Mods, class Drop>
__device__ __forceinline__ void general_probs_and_ds(Acc (&st)[kQA][4], Acc (&dpt)[kQA][4], const Mods& mods,
                                                     const Drop& drop, Acc* dbias, const Seq& sq, int64_t m0,
                                                     int64_t n0, int wkey, const Acc* lse_s, const Acc* d_s,
                                                     const unsigned char* bias_s, const BiasTileLayout& bias_tile,
                                                     int lo0, int hi0, int k_lim, int g, int t) {
  using Exp = ExpDomain<Acc>;
  const int q_lim = sq.q_tile_rows(m0, kBM);  // rows past it are padding
  // Sets of up to 8 scores (few registers beside dK, dV): per key of the lane (kw = g,
  // g + 8), its rows 8j + 2t (+1) of kSet / 2 consecutive j.
  constexpr int kSet = 2 * kQA < 8 ? 2 * kQA : 8, kHalves = 2 * kQA / kSet;
  static_assert(kSet * kHalves == 2 * kQA, "the sets cover the lane's rows");
#pragma unroll
  for (int set = 0; set < 2 * kHalves; ++set) {
    const int kh = set / kHalves, j0 = (set % kHalves) * (kSet / 2), kw = g + 8 * kh;
    auto row = [&](int i) { return 8 * (j0 + (i >> 1)) + 2 * t + (i & 1); };
    Acc x[kSet], th[kSet];
    bool in[kSet];
#pragma unroll
    for (int i = 0; i < kSet; ++i) {
      x[i] = st[j0 + (i >> 1)][2 * kh + (i & 1)];
      in[i] = lse_s[row(i)] != neg_inf<Acc>() && row(i) < q_lim && kw >= lo0 + row(i) &&
              kw <= hi0 + row(i) && kw < k_lim;
    }
    mods.scores(x, in, m0, n0 + wkey + kw, [&](int i) { return int2{row(i), 0}; },
                [&](int i) { return bias_s + bias_tile.offset(row(i), wkey + kw); }, th);
#pragma unroll
    for (int i = 0; i < kSet; ++i)
      feature_grad(st[j0 + (i >> 1)][2 * kh + (i & 1)], dpt[j0 + (i >> 1)][2 * kh + (i & 1)], x[i], in[i],
                   th[i], Exp::from_lse(lse_s[row(i)]), d_s[row(i)], m0 + row(i), n0 + wkey + kw, sq, mods,
                   drop, dbias);
  }
}

// P^T and dS^T without the general step: P^T = exp(scale S^T - LSE) (plus the bias tile's term:
// reader) and dS^T = P^T (dP^T - D), 0 wherever the key is not visible (so values there, even NaN
// or inf, never reach a gradient); kMasked: the band test of general_probs_and_ds. A bias term of
// -inf makes P 0 through the exp. (The scalars by reference, as the loop's lambda that held this
// code captured them: taken by value, the fp64 kernels' predicates came out in another form.)
template <bool kMasked, class R, class Acc, int kQA>
__device__ __forceinline__ void probs_and_ds_t(Acc (&st)[kQA][4], Acc (&dpt)[kQA][4], R reader,
                                               const Acc* const& lse_s, const Acc* const& d_s,
                                               unsigned char* const& sBias, const int& buf,
                                               const BiasTileLayout& bias_tile, const Acc& score_scale,
                                               const int& wkey, const int& lo0, const int& hi0, const int& k_lim,
                                               const int& g, const int& t) {
  using Exp = ExpDomain<Acc>;
  const unsigned char* bias_s = sBias + buf * bias_tile.buffer_bytes() + (wkey + g) * R::kBytes;
#pragma unroll
  for (int j = 0; j < kQA; ++j) {
    // The lane's two query rows 8j + 2t, 8j + 2t + 1 (element e holds row e & 1).
    const auto lse2 = load_vec2(lse_s + 8 * j + 2 * t);
    const auto d2 = load_vec2(d_s + 8 * j + 2 * t);
    const Acc lse_pair[2] = {Exp::from_lse(lse2.x), Exp::from_lse(lse2.y)};
    const Acc d_pair[2] = {d2.x, d2.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Acc lse = lse_pair[e & 1];
      bool vis = lse != neg_inf<Acc>();
      const int row = 8 * j + 2 * t + (e & 1), kw = g + 8 * (e >> 1);
      if constexpr (kMasked) vis = vis && kw >= lo0 + row && kw <= hi0 + row && kw < k_lim;
      Acc x = st[j][e] * score_scale - lse;
      if constexpr (R::kBytes > 0)
        x += Exp::score_scale(1.0) *
             reader.template value<Acc>(bias_s + bias_tile.row_offset(row) + 8 * (e >> 1) * R::kBytes);
      const Acc pr = Exp::exp_if(vis, x);
      st[j][e] = pr;
      dpt[j][e] = vis ? pr * (dpt[j][e] - d_pair[e & 1]) : Acc(0);
    }
  }
}

// dQ = dS K for the tile's 16-row group rg (dS^T from smem, key-major, read transposed) and the
// kQCA atoms of column group cg (kQCols wide), over the kBN keys.
template <class M, int kBN, int kLd, int kLdS, int kQCols, class Acc, int kQCA, class Elem>
__device__ __forceinline__ void dq_of_row_group(Acc (&dq)[kQCA][4], const Elem* sdSt, const Elem* sK, int rg, int cg,
                                                int lane) {
#pragma unroll
  for (int d = 0; d < kQCA; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[d][e] = Acc(0);
#pragma unroll
  for (int kk = 0; kk < kBN; kk += M::kK) {
    typename M::A a;
    M::load_a_kn(a, sdSt + kk * kLdS + 16 * rg, kLdS, lane);
#pragma unroll
    for (int d = 0; d < kQCA; d += 2) {
      typename M::B bk[2];
      M::load_b2_kn(bk, sK + kk * kLd + cg * kQCols + 8 * d, kLd, lane);
      M::mma(dq[d], a, bk[0]);
      M::mma(dq[d + 1], a, bk[1]);
    }
  }
}

}  // namespace flashattn::cuda::sm80
