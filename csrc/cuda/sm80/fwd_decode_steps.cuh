// The steps of the decode kernel (fwd_decode.cuh): the chunk's Q rows into smem, per key tile a
// warp's S over its 16 keys (or two slots of 16 keys), the online softmax and P V, then the warps' rows
// merged through smem, a walk's parts merged through the workspace, and the output.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/fragments.cuh"
#include "../common/online_softmax.cuh"
#include "../common/tile_copy.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// The chunk's Q rows (packed row r: query head head_of(r0 + r), row row_of(r0 + r)) into sQ;
// past the chunk's `rows` zeros.
template <int kDim, class Elem, class HeadOf, class RowOf>
__device__ __forceinline__ void load_chunk_q(Elem* sQ, const FwdParams& p, const Seq& sq, int64_t r0, int rows, int E,
                                             const HeadOf& head_of, const RowOf& row_of, int tid) {
  using Cfg = DecodeConfig<Elem, kDim>;
  constexpr int kRows = Cfg::kRows, kLd = Cfg::kLd, kThreads = Cfg::kThreads;
  constexpr int kPerRow = kDim / chunk_elems<Elem>();
#pragma unroll
  for (int i = tid; i < kRows * kPerRow; i += kThreads) {
    const int r = i / kPerRow, c = i % kPerRow;
    const bool valid = r < rows && c * chunk_elems<Elem>() < E;
    const Elem* src = valid ? sq.q_rows<const Elem>(p.q, p.q_stride, head_of(r0 + r), row_of(r0 + r)) +
                                  c * chunk_elems<Elem>()
                            : static_cast<const Elem*>(p.q);
    cp_async_16_zfill(sQ + r * kLd + (Cfg::kSwizzle ? (c & ~7) | ((c ^ r) & 7) : c) * chunk_elems<Elem>(), src,
                      valid);
  }
}

// The operand reads: the warp's 16 Q rows (row group `group`: rows 16 group ..) and its 16 keys of a K / V
// tile (slot `slot`, keys 16 slot ..; `next` reads the slot after it), swizzled tiles through the lane's smem
// addresses, padded ones through pointers (fragments.cuh).
template <class Cfg, class Elem>
struct DecodeOperandReads {
  using M = Mma<Elem>;
  using TA = SwizzledAddress<Cfg::kLd * int(sizeof(Elem))>;
  static constexpr int kBN = Cfg::kBN, kLd = Cfg::kLd;
  static constexpr uint32_t kTileBytes = kBN * kLd * sizeof(Elem);
  static constexpr bool kSw = Cfg::kSwizzle;
  Elem *sQ, *sK, *sV;
  int slot, lane;
  uint32_t q_at = 0, k_at = 0, v_at = 0;

  __device__ __forceinline__ DecodeOperandReads(Elem* sQ_, Elem* sK_, Elem* sV_, int group, int slot_, int lane_)
      : sQ(sQ_ + 16 * group * kLd), sK(sK_), sV(sV_), slot(slot_), lane(lane_) {
    if constexpr (kSw) {
      const auto rows_first = M::rows_first(lane), chunks_first = M::chunks_first(lane);
      q_at = TA::base(sQ_, 16 * group + rows_first.row, rows_first.chunk);
      k_at = TA::base(sK, 16 * slot + chunks_first.row, chunks_first.chunk);
      v_at = TA::base(sV, 16 * slot + rows_first.row, rows_first.chunk);
    }
  }
  __device__ __forceinline__ void q(typename M::A& a, int kk) const {  // the warp's rows, k kk..
    if constexpr (kSw) M::load_a(a, TA::at(q_at, 0, kk / 8));
    else M::load_a(a, sQ + kk, kLd, lane);
  }
  // the warp's keys (slot + next), k kk..
  __device__ __forceinline__ void k(typename M::B (&b)[2], int stage, int next, int kk) const {
    if constexpr (kSw) M::load_b2_nk(b, TA::at(k_at + stage * kTileBytes, 16 * next, kk / 8));
    else M::load_b2_nk(b, sK + (stage * kBN + 16 * (slot + next)) * kLd + kk, kLd, lane);
  }
  // the warp's keys (slot + next), columns col..
  __device__ __forceinline__ void v(typename M::B (&b)[2], int stage, int next, int col) const {
    if constexpr (kSw) M::load_b2_kn(b, TA::at(v_at + stage * kTileBytes, 16 * next, col / 8));
    else M::load_b2_kn(b, sV + (stage * kBN + 16 * (slot + next)) * kLd + col, kLd, lane);
  }
};

// S = Q K^T for the warp's rows and its 16 keys of kTiles consecutive tiles, tile i in buffer stages[i] (slot
// read.slot + next: keys from n0 + i kBN + 16 (slot + next)), scaled, and -inf outside the lane's rows' bands
// [lo[r], hi[r]) unless every row sees the tile whole (all_visible).
template <int kDim, int kTiles, class Reads, class AllVisible>
__device__ __forceinline__ void warp_scores(float (&s)[kTiles][2][4], const Reads& read, const int (&stages)[kTiles],
                                            int next, int64_t n0, const AllVisible& all_visible,
                                            const int64_t (&lo)[2], const int64_t (&hi)[2], float score_scale,
                                            int t) {
  using M = typename Reads::M;
  constexpr int kKSteps = kDim / 16;
  // Each tile's k steps in two chains (even and odd steps, summed at the end), the tiles' products interleaved:
  // the scores wait for kKSteps / 2 dependent products, not kTiles kKSteps (one warp per scheduler in a short
  // step: nothing else hides them); one read of Q's fragment serves every tile. Not at dim 256, whose registers
  // are full (the second chain spilled 52 B).
  constexpr bool kTwoChains = kDim <= 128;
  float odd[kTiles][2][4] = {};
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    typename M::A a;
    read.q(a, 16 * ks);
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      typename M::B bk[2];
      read.k(bk, stages[i], next, 16 * ks);
      float(&acc)[2][4] = kTwoChains && ks % 2 == 1 ? odd[i] : s[i];
      M::mma(acc[0], a, bk[0]);
      M::mma(acc[1], a, bk[1]);
    }
  }
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    if constexpr (kTwoChains) {
#pragma unroll
      for (int jn = 0; jn < 2; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][jn][e] += odd[i][jn][e];
    }
    const int64_t n_i = n0 + int64_t(i) * Reads::kBN;
    if (all_visible(n_i)) {  // (uniform across the block: the common tile skips the columns' arithmetic)
#pragma unroll
      for (int jn = 0; jn < 2; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][jn][e] *= score_scale;
      continue;
    }
#pragma unroll
    for (int jn = 0; jn < 2; ++jn)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = n_i + 16 * (read.slot + next) + 8 * jn + 2 * t + (e & 1);
        const int r = e >> 1;
        s[i][jn][e] = col >= lo[r] && col < hi[r] ? s[i][jn][e] * score_scale : neg_inf<float>();
      }
  }
}

// The online softmax over the warp's keys of kTiles tiles (s: scaled scores, masked ones -inf; becomes the
// unnormalised P), the lane's rows' max and sum updated once for them all; alpha rescales O. Tiles that do not
// raise a row's max give it alpha = 1 without an exponential: along a long walk most tiles, so that warp_pv
// skips the rescale.
template <int kTiles>
__device__ __forceinline__ void warp_softmax(float (&s)[kTiles][2][4], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2]) {
  using Exp = ExpDomain<float>;
  constexpr int kN = 4 * kTiles;  // a lane's scores of a row
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x[kN];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      x[4 * i] = s[i][0][2 * r];
      x[4 * i + 1] = s[i][0][2 * r + 1];
      x[4 * i + 2] = s[i][1][2 * r];
      x[4 * i + 3] = s[i][1][2 * r + 1];
    }
    float reduced[kN];  // (tree_reduce works in place)
#pragma unroll
    for (int j = 0; j < kN; ++j) reduced[j] = x[j];
    const float tile_max = reduce_max_lanes<4>(tree_reduce(reduced, [](float a, float b) { return acc_max(a, b); }));
    const bool moves = tile_max > row_max[r];  // (row_max -inf: any visible key raises it)
    const float base = exp_base(moves ? tile_max : row_max[r]);
    alpha[r] = moves ? Exp::exp(row_max[r] - base) : 1.f;
    if (moves) row_max[r] = tile_max;
#pragma unroll
    for (int j = 0; j < kN; ++j) reduced[j] = x[j] = Exp::exp(x[j] - base);
    row_sum[r] = row_sum[r] * alpha[r] + tree_reduce(reduced, [](float a, float b) { return a + b; });
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      s[i][0][2 * r] = x[4 * i];
      s[i][0][2 * r + 1] = x[4 * i + 1];
      s[i][1][2 * r] = x[4 * i + 2];
      s[i][1][2 * r + 1] = x[4 * i + 3];
    }
  }
}

// O = alpha O + P V over the warp's 16 keys (V from buffer `stage`, slot read.slot + next).
template <int kDA, class Reads>
__device__ __forceinline__ void warp_pv(float (&o)[kDA][4], float (&s)[2][4], const float (&alpha)[2],
                                        const Reads& read, int stage, int next) {
  using M = typename Reads::M;
  typename M::A pa;
  M::a_from_acc(pa, s);
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // (a row's max rose: rarely, late in a walk)
#pragma unroll
    for (int d = 0; d < kDA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] *= alpha[e >> 1];
  }
#pragma unroll
  for (int d = 0; d < kDA; d += 2) {
    typename M::B bv[2];
    read.v(bv, stage, next, 8 * d);
    M::mma(o[d], pa, bv[0]);
    M::mma(o[d + 1], pa, bv[1]);
  }
}

// The warp's 16 rows into smem for the merge: O [warp][row][kOLd], then max and sum [warp][2][row].
template <class Cfg, int kDA>
__device__ __forceinline__ void stash_warp_rows(float* sO, float* sStats, const float (&o)[kDA][4],
                                                const float (&row_max)[2], const float (&row_sum)[2], int warp, int g,
                                                int t) {
  constexpr int kRows = Cfg::kWarpRows;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const float l = reduce_sum_lanes<4>(row_sum[r]);
    float* dst = sO + (warp * kRows + row) * Cfg::kOLd + 2 * t;
#pragma unroll
    for (int d = 0; d < kDA; ++d) *reinterpret_cast<float2*>(dst + 8 * d) = make_float2(o[d][2 * r], o[d][2 * r + 1]);
    if (t == 0) {
      sStats[(2 * warp) * kRows + row] = row_max[r];
      sStats[(2 * warp + 1) * kRows + row] = l;
    }
  }
}

}  // namespace flashattn::cuda::sm80
