// The steps of the 2-D dK/dV kernel's query-tile loop (bwd_sm80_2d.cuh), each on one warp's
// m16n8 fragments in its place of the step's warp grid: S = Q K^T and dP = dO V^T, P and
// dS = P (dP - D), P / dS into smem, dV += P^T dO and dK += dS^T Q, dQ = dS K, and the block's
// dK / dV pairs at the end.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../common/bias_tile.cuh"
#include "../common/fragments.cuh"
#include "../common/online_softmax.cuh"
#include "../common/tile_copy.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// The 2-D kernel's shapes for one instantiation: tiles (Bwd2dConfig), its three warp grids and
// the byte strides of its smem operands.
template <class Elem, int kDim_, bool kOneSync, bool kTwoBlocks>
struct Bwd2dShape {
  static constexpr int kDim = kDim_;
  using Cfg = Bwd2dConfig<Elem, kDim, kOneSync, kTwoBlocks>;
  using M = Mma<Elem>;
  using Acc = float;
  using Exp = ExpDomain<Acc>;
  static constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd, kLdP = Cfg::kLdP;
  static constexpr bool kSw = Cfg::kSwizzle;  // K, V, Q, dO tiles swizzled (tile_copy.cuh)
  static constexpr int kKeyW = Cfg::kKeyWarps, kRowW = Cfg::kWarps / kKeyW;  // S / dP: kRowW x kKeyW
  static constexpr int kColW = Cfg::kWarps / kKeyW;                          // dK / dV: kKeyW x kColW
  static constexpr int kKA = kDim / kColW / 8;  // dK / dV atoms per 16-key group of a warp
  static constexpr int kRA = kBM / kRowW / 16;  // 16-row groups of a warp in S / dP
  static constexpr int kQCW = Cfg::kDqColWarps, kQRW = Cfg::kWarps / kQCW;  // the dQ warp grid
  static constexpr int kQA = kDim / kQCW / 8;  // dQ atoms per 16-row group of a warp
  static constexpr int kRQ = kBM / kQRW / 16;  // 16-row groups of a warp in dQ
  static_assert(kKA % 2 == 0 && kQA % 2 == 0, "B atoms load in pairs");
  // Swizzled K / V / Q / dO (bwd_dkdv_2d_kernel): V, dO and Q's second buffer lie whole lines further.
  using TA = SwizzledAddress<kLd * int(sizeof(Elem))>;
  static constexpr uint32_t kRowBytes = kLd * sizeof(Elem), kBufBytes = kBM * kRowBytes;
  static constexpr uint32_t kVBytes = kBN * kRowBytes, kDoBytes = Cfg::kQBufs * kBufBytes;  // sV - sK, sdO - sQ
  // P and dS: a buffer's dS lies kDsBytes after its P, the next buffer kPBufBytes further.
  using TP = SwizzledAddress<Cfg::kSwizzleP ? kLdP * int(sizeof(Elem)) : 128>;
  static constexpr uint32_t kDsBytes = kBM * kLdP * sizeof(Elem), kPBufBytes = 2 * kDsBytes;
  using SdP = Acc[kRA][4][4];  // S or dP of the warp's rows x 32 keys: [row group][key atom]
  using DkDv = Acc[2][kKA][4];  // dK or dV of the warp's 32 keys x kDim / kColW dims
};

// S = Q K^T and dP = dO V^T of the warp's rows (from s_row) x 32 keys (from s_key). Swizzled
// tiles through the lanes' addresses q_buf_s (Q's buffer) and k_of_s, padded ones through pointers.
template <class W, class Elem>
__device__ __forceinline__ void scores_and_dp(typename W::SdP& s, typename W::SdP& dp, uint32_t q_buf_s,
                                              uint32_t k_of_s, const Elem* q_s, const Elem* do_s, const Elem* sK,
                                              const Elem* sV, int s_row, int s_key, int lane) {
  using M = typename W::M;
  using Acc = typename W::Acc;
  using TA = typename W::TA;
  constexpr int kRA = W::kRA, kLd = W::kLd;
#pragma unroll
  for (int i = 0; i < kRA; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][j][e] = dp[i][j][e] = Acc(0);
#pragma unroll
  for (int kk = 0; kk < W::kDim; kk += M::kK) {
    typename M::A aq[kRA], ado[kRA];
#pragma unroll
    for (int i = 0; i < kRA; ++i) {
      if constexpr (W::kSw) {
        const uint32_t at = TA::at(q_buf_s, 16 * i, kk / 8);
        M::load_a(aq[i], at);
        M::load_a(ado[i], at + W::kDoBytes);
      } else {
        M::load_a(aq[i], q_s + (s_row + 16 * i) * kLd + kk, kLd, lane);
        M::load_a(ado[i], do_s + (s_row + 16 * i) * kLd + kk, kLd, lane);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      typename M::B bk[2], bv[2];
      if constexpr (W::kSw) {
        const uint32_t at = TA::at(k_of_s, 8 * j, kk / 8);
        M::load_b2_nk(bk, at);
        M::load_b2_nk(bv, at + W::kVBytes);
      } else {
        M::load_b2_nk(bk, sK + (s_key + 8 * j) * kLd + kk, kLd, lane);
        M::load_b2_nk(bv, sV + (s_key + 8 * j) * kLd + kk, kLd, lane);
      }
#pragma unroll
      for (int i = 0; i < kRA; ++i) {
        M::mma(s[i][j], aq[i], bk[0]);
        M::mma(s[i][j + 1], aq[i], bk[1]);
        M::mma(dp[i][j], ado[i], bv[0]);
        M::mma(dp[i][j + 1], ado[i], bv[1]);
      }
    }
  }
}

// P = exp(scale S - LSE) (plus the bias tile's term: reader) and dS = P (dP - D), in place of S and
// dP, for the warp's rows of query tile m0 against key tile n0. kMasked (a tile some row does not
// see in full): 0 wherever the key is not visible, each (row, key) tested against the band with
// bases clamped so that every comparison stays in 32 bits. A bias term of -inf makes P 0 through
// the exp. LSE and D of the rows: Stats' slab chunks from stats_s (Cfg::kSlabStats), else per
// row from lse_s / d_s.
template <class W, bool kMasked, class R>
__device__ __forceinline__ void probs_and_ds(typename W::SdP& s, typename W::SdP& dp, const R& reader, const Seq& sq,
                                             int64_t m0, int64_t n0, const float* stats_s, const float* lse_s,
                                             const float* d_s, const unsigned char* bias_s,
                                             const BiasTileLayout& bias_tile, float score_scale, int s_row, int s_key,
                                             int g, int t) {
  using Cfg = typename W::Cfg;
  using Acc = typename W::Acc;
  using Exp = typename W::Exp;
  constexpr int kBM = W::kBM, kBN = W::kBN;
  int lo0 = 0, hi0 = 0, k_lim = 0;
  if constexpr (kMasked) {
    auto clamp_base = [](int64_t x) { return int(x < -kBM - 1 ? -kBM - 1 : x > kBN + 1 ? kBN + 1 : x); };
    lo0 = clamp_base(m0 - n0 + sq.band.lo);  // visible: key - row >= lo0
    hi0 = clamp_base(m0 - n0 + sq.band.hi);  // and key - row <= hi0
    k_lim = clamp_base(sq.len_k - n0);       // and key < k_lim
  }
#pragma unroll
  for (int i = 0; i < W::kRA; ++i) {
    float4 slab;  // SlabStats: LSE and D of rows g and g + 8
    if constexpr (Cfg::kSlabStats) slab = *reinterpret_cast<const float4*>(stats_s + 32 * i);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = s_row + 16 * i + g + 8 * r;
      // A row that sees no key (LSE -inf) takes +inf: its exponentials are then 0, and its
      // dS 0, without a select per score where the tile is not masked.
      const Acc lse_row = Exp::from_lse(Cfg::kSlabStats ? (r ? slab.z : slab.x) : lse_s[row]);
      const Acc dsum = Cfg::kSlabStats ? (r ? slab.w : slab.y) : d_s[row];
      const Acc lse = lse_row == neg_inf<Acc>() ? -neg_inf<Acc>() : lse_row;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = s_key + 8 * j + 2 * t + c, e = 2 * r + c;
          Acc x = s[i][j][e] * score_scale - lse;
          if constexpr (R::kBytes > 0)
            x += Exp::score_scale(1.0) * reader.template value<Acc>(bias_s + bias_tile.offset(row, key));
          if constexpr (kMasked) {
            const bool vis = key - row >= lo0 && key - row <= hi0 && key < k_lim;
            const Acc pr = Exp::exp_if(vis, x);
            s[i][j][e] = pr;
            dp[i][j][e] = vis ? pr * (dp[i][j][e] - dsum) : Acc(0);
          } else {
            constexpr int kEvery = Cfg::kFmaExpEvery;
            const bool on_fma = kEvery > 0 && (2 * j + c) % (kEvery > 0 ? kEvery : 1) == kEvery - 1;
            const Acc pr = on_fma ? Exp::exp_fma(x) : Exp::exp(x);
            s[i][j][e] = pr;
            dp[i][j][e] = pr * (dp[i][j][e] - dsum);
          }
        }
      }
    }
  }
}

// P and dS = P (dP - D) into smem: two accumulator atoms (16 rows x 16 keys) per stmatrix where
// the config takes it, else 32-bit stores.
template <class W, class Elem>
__device__ __forceinline__ void store_p_ds(typename W::SdP& s, typename W::SdP& dp, Elem* sP, Elem* p_s, Elem* ds_s,
                                           uint32_t p_buf_bytes, int s_row, int s_key, int lane, int g, int t) {
  using M = typename W::M;
  using Cfg = typename W::Cfg;
  constexpr int kRA = W::kRA, kLdP = W::kLdP;
#ifdef FLASHATTN_STMATRIX
  constexpr bool kStmatrix = Cfg::kStmatrixStores;
#else
  constexpr bool kStmatrix = false;
#endif
  if constexpr (kStmatrix) {
    using TP = typename W::TP;
    // The inverse of load_a: the lane's row address is M::rows_first's spot (written out: as
    // lane & 15 the SASS changed, untimed) and the registers those of an A fragment (a_from_acc).
    // 16 instructions per warp and tile at kRA = 4 where 32-bit stores take 64.
    const int mi = lane >> 3;  // row lane % 8 of matrix mi
    const int st_row = s_row + (lane & 7) + 8 * (mi & 1);
    const uint32_t p_at = (Cfg::kSwizzleP ? TP::base(sP, st_row, s_key / 8 + (mi >> 1))
                                          : smem_addr(sP + st_row * kLdP + s_key + 8 * (mi >> 1))) +
                          p_buf_bytes;
#pragma unroll
    for (int i = 0; i < kRA; ++i)
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        const uint32_t at =
            Cfg::kSwizzleP ? TP::at(p_at, 16 * i, j) : p_at + uint32_t((16 * i * kLdP + 8 * j) * sizeof(Elem));
        typename M::A pa, dsa;
        M::a_from_acc(pa, &s[i][j]);
        M::a_from_acc(dsa, &dp[i][j]);
        stmatrix_x4(at, pa.r);
        stmatrix_x4(at + W::kDsBytes, dsa.r);
      }
  } else {
#pragma unroll
    for (int i = 0; i < kRA; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int off = (s_row + 16 * i + g + 8 * r) * kLdP + s_key + 8 * j + 2 * t;
          M::store_pair(p_s + off, s[i][j][2 * r], s[i][j][2 * r + 1]);
          M::store_pair(ds_s + off, dp[i][j][2 * r], dp[i][j][2 * r + 1]);
        }
  }
}

// dV += P^T dO and dK += dS^T Q over the tile's rows, for the warp's 32 keys (from k_key) x
// kDim / kColW dims (from k_col): P^T / dS^T read transposed from smem.
template <class W, class Elem>
__device__ __forceinline__ void add_dkdv(typename W::DkDv& dk, typename W::DkDv& dv, uint32_t p_of_dk,
                                         uint32_t p_buf_bytes, const Elem* p_s, const Elem* ds_s, uint32_t q_buf_dk,
                                         const Elem* q_s, const Elem* do_s, int k_key, int k_col, int lane) {
  using M = typename W::M;
  using TA = typename W::TA;
  using TP = typename W::TP;
  constexpr int kKA = W::kKA, kLd = W::kLd, kLdP = W::kLdP;
#pragma unroll
  for (int kk = 0; kk < W::kBM; kk += M::kK) {
    typename M::A ap[2], ads[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if constexpr (W::Cfg::kSwizzleP) {
        const uint32_t at = TP::at(p_of_dk + p_buf_bytes, kk, 2 * i);
        M::load_a_kn(ap[i], at);
        M::load_a_kn(ads[i], at + W::kDsBytes);
      } else {
        M::load_a_kn(ap[i], p_s + kk * kLdP + k_key + 16 * i, kLdP, lane);
        M::load_a_kn(ads[i], ds_s + kk * kLdP + k_key + 16 * i, kLdP, lane);
      }
    }
#pragma unroll
    for (int d = 0; d < kKA; d += 2) {
      typename M::B bo[2], bq[2];
      if constexpr (W::kSw) {
        const uint32_t at = TA::at(q_buf_dk, kk, d);
        M::load_b2_kn(bo, at + W::kDoBytes);
        M::load_b2_kn(bq, at);
      } else {
        M::load_b2_kn(bo, do_s + kk * kLd + k_col + 8 * d, kLd, lane);
        M::load_b2_kn(bq, q_s + kk * kLd + k_col + 8 * d, kLd, lane);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        M::mma(dv[i][d], ap[i], bo[0]);
        M::mma(dv[i][d + 1], ap[i], bo[1]);
        M::mma(dk[i][d], ads[i], bq[0]);
        M::mma(dk[i][d + 1], ads[i], bq[1]);
      }
    }
  }
}

// dQ = dS K for the warp's kBM / kQRW rows (from q_row) x kDim / kQCW dims (from q_col).
template <class W, class Elem, class Dq>
__device__ __forceinline__ void dq_products(Dq& dq, uint32_t ds_of_dq, uint32_t p_buf_bytes, const Elem* ds_s,
                                            uint32_t k_of_dq, const Elem* sK, int q_row, int q_col, int lane) {
  using M = typename W::M;
  using Acc = typename W::Acc;
  constexpr int kRQ = W::kRQ, kQA = W::kQA, kLd = W::kLd, kLdP = W::kLdP;
#pragma unroll
  for (int i = 0; i < kRQ; ++i)
#pragma unroll
    for (int d = 0; d < kQA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[i][d][e] = Acc(0);
#pragma unroll
  for (int kk = 0; kk < W::kBN; kk += M::kK) {
    typename M::A a[kRQ];
#pragma unroll
    for (int i = 0; i < kRQ; ++i) {
      if constexpr (W::Cfg::kSwizzleP) M::load_a(a[i], W::TP::at(ds_of_dq + p_buf_bytes, 16 * i, kk / 8));
      else M::load_a(a[i], ds_s + (q_row + 16 * i) * kLdP + kk, kLdP, lane);
    }
#pragma unroll
    for (int d = 0; d < kQA; d += 2) {
      typename M::B bk[2];
      if constexpr (W::kSw) M::load_b2_kn(bk, W::TA::at(k_of_dq, kk, d));
      else M::load_b2_kn(bk, sK + kk * kLd + q_col + 8 * d, kLd, lane);
#pragma unroll
      for (int i = 0; i < kRQ; ++i) {
        M::mma(dq[i][d], a[i], bk[0]);
        M::mma(dq[i][d + 1], a[i], bk[1]);
      }
    }
  }
}

// The lane's dK (times `scale`) and dV pairs of keys below rows_k: put_k(key, col, x, y) for
// columns below E, put_v for those below Ev.
template <class W, class PutK, class PutV>
__device__ __forceinline__ void each_dkdv_pair(const typename W::DkDv& dk, const typename W::DkDv& dv,
                                               typename W::Acc scale, int rows_k, int k_key, int k_col, int g, int t,
                                               int E, int Ev, PutK put_k, PutV put_v) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = k_key + 16 * i + g + 8 * r;
      if (key >= rows_k) continue;
#pragma unroll
      for (int d = 0; d < W::kKA; ++d) {
        const int col = k_col + 8 * d + 2 * t;
        if (col < E) put_k(key, col, dk[i][d][2 * r] * scale, dk[i][d][2 * r + 1] * scale);
        if (col < Ev) put_v(key, col, dv[i][d][2 * r], dv[i][d][2 * r + 1]);
      }
    }
  }
}

}  // namespace flashattn::cuda::sm80
