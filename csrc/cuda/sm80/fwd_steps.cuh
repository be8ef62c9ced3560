// The steps of the tensor-core forward's key loop (fwd_sm80.cuh), each on one warp's m16n8
// fragments: S = Q K^T, the scores into the exponent domain (scale, score modifiers, bias, band
// mask), the online softmax, O = alpha O + P V, and the output epilogue.
//
// A warp owns 16 * kMW query rows of the block's tile; the lane holds rows g and g + 8 of each
// 16-row group mw (r = 0, 1) and columns 2t, 2t + 1 of each 8-wide atom (g = lane / 4, t = lane % 4).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"
#include "../common/band_mask.cuh"
#include "../common/bias_tile.cuh"
#include "../common/features.cuh"
#include "../common/fragments.cuh"
#include "../common/online_softmax.cuh"
#include "../common/opaque.cuh"
#include "../common/tile_copy.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// A query tile of a forward block: rows [m0, m0 + rows) of the sequence (m_last the last one)
// and the key tiles [n_begin, n_end) that any of its rows sees.
struct FwdQueryTile {
  int64_t m0, m_last, n_begin, n_end;
  int rows;
  FLASHATTN_HD bool has_keys() const { return n_end > n_begin; }
  // Its key tiles of kBN keys.
  FLASHATTN_HD int64_t key_tiles(int kBN) const { return has_keys() ? (n_end - n_begin + kBN - 1) / kBN : 0; }
};

// The kBM-row query tile of sequence `sq` at row m0 (the kernels', and the host's for the split's
// plan, launch_fwd).
FLASHATTN_HD FwdQueryTile query_tile(const Seq& sq, int64_t m0, int kBM, int kBN) {
  FwdQueryTile tile;
  tile.m0 = m0;
  tile.rows = sq.q_tile_rows(m0, kBM);
  tile.m_last = m0 + tile.rows - 1;
  tile.n_begin = sq.key_begin(m0) / kBN * kBN;
  tile.n_end = sq.key_end(tile.m_last);
  return tile;
}

// The forward's shapes for one instantiation: tiles (FwdConfig), fragments, what a warp holds.
template <class Elem, int kDim_, bool kFeatures_>
struct FwdShape {
  static constexpr int kDim = kDim_;
  static constexpr bool kFeatures = kFeatures_;
  using Cfg = FwdConfig<Elem, kDim, kFeatures>;
  using M = Mma<Elem>;
  using Acc = typename M::Acc;
  using Exp = ExpDomain<Acc>;
  static constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kMW = Cfg::kMW, kLd = Cfg::kLd;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kNA = kBN / 8;   // S atoms per warp row group
  static constexpr int kDA = kDim / 8;  // O atoms per warp row group
  // Up to dim 64 the warp's Q fragments (16 registers per 16-row group) stay in registers for
  // the whole key loop instead of being re-read from smem for every key tile, except with the
  // 128-key tiles at dim 64 (the S accumulators leave no room: 204 B of spills).
  static constexpr bool kQInRegs = sizeof(Elem) == 2 && (kDim <= 32 || (kDim <= 64 && kBN < 128));
  static constexpr int kKSteps = kDim / M::kK;
  static constexpr bool kSw = Cfg::kSwizzle;  // Q, K, V tiles swizzled (tile_copy.cuh)
  static constexpr int kKvBufs = Cfg::kStaggered ? 1 : 2;
  using TA = SwizzledAddress<kLd * int(sizeof(Elem))>;
  static constexpr uint32_t kKvBufBytes = kBN * kLd * sizeof(Elem);
  // A warp's fragments: S of one key tile, O, a per-row statistic (max, sum, alpha).
  using S = Acc[kMW][kNA][4];
  using O = Acc[kMW][kDA][4];
  using RowStat = Acc[kMW][2];
};

// The operand reads from smem: swizzled tiles through the lanes' smem addresses
// (SwizzledAddress; a K / V buffer lies whole lines further), padded ones through pointers
// (every Elem, fp64 included).
template <class F, class Elem>
struct FwdOperandReads {
  using M = typename F::M;
  using TA = typename F::TA;
  static constexpr int kBN = F::kBN, kLd = F::kLd;
  static constexpr bool kSw = F::kSw;
  Elem *sQ, *sK, *sV;
  int wrow, lane;
  uint32_t q_at = 0, k_at = 0, v_at = 0;

  __device__ __forceinline__ FwdOperandReads(Elem* sQ_, Elem* sK_, Elem* sV_, int wrow_, int lane_)
      : sQ(sQ_), sK(sK_), sV(sV_), wrow(wrow_), lane(lane_) {
    if constexpr (kSw) {
      const auto rows_first = M::rows_first(lane), chunks_first = M::chunks_first(lane);
      q_at = TA::base(sQ, wrow + rows_first.row, rows_first.chunk);
      k_at = TA::base(sK, chunks_first.row, chunks_first.chunk);
      v_at = TA::base(sV, rows_first.row, rows_first.chunk);
    }
  }
  __device__ __forceinline__ void q(typename M::A& a, int mw, int kk) const {  // rows 16 mw.., k kk..
    if constexpr (kSw) M::load_a(a, TA::at(q_at, 16 * mw, kk / 8));
    else M::load_a(a, sQ + (wrow + 16 * mw) * kLd + kk, kLd, lane);
  }
  __device__ __forceinline__ void k(typename M::B (&b)[2], int buf, int key, int kk) const {  // keys key.., k kk..
    if constexpr (kSw) M::load_b2_nk(b, TA::at(k_at + buf * F::kKvBufBytes, key, kk / 8));
    else M::load_b2_nk(b, sK + buf * kBN * kLd + key * kLd + kk, kLd, lane);
  }
  // keys key.., columns col..
  __device__ __forceinline__ void v(typename M::B (&b)[2], int buf, int key, int col) const {
    if constexpr (kSw) M::load_b2_kn(b, TA::at(v_at + buf * F::kKvBufBytes, key, col / 8));
    else M::load_b2_kn(b, sV + buf * kBN * kLd + key * kLd + col, kLd, lane);
  }
};

// The block's copies into smem (cp.async): its query tile's Q rows, and K (with the bias / mask
// tile of the query tile's rows against it) and V tiles of kBN keys from n0 into buffer buf. (The
// block's values by reference, as lambdas capture them.)
template <class F, class Elem>
struct FwdTileLoads {
  using Cfg = typename F::Cfg;
  static constexpr int kBM = F::kBM, kBN = F::kBN, kLd = F::kLd, kThreads = F::kThreads, kDim = F::kDim;
  // Copies past the valid rows name a valid source (tile_copy.cuh: measured).
  static constexpr bool kClampSource = true;
  const FwdParams& p;
  const Seq& sq;
  const FwdQueryTile& tile;
  const int64_t& h;
  Elem* const &sQ, *const &sK, *const &sV;
  unsigned char* const& sBias;
  const BiasTileLayout& bias_tile;
  const bool& bias_chunked;
  const Elem* const &k, *const &v;  // the sequence's first key row
  const int &E, &Ev, &tid;

  __device__ __forceinline__ int rows_k(int64_t n0) const { return sq.k_tile_rows(n0, kBN); }
  __device__ __forceinline__ void q() const {
    copy_tile_async<kBM, kDim, kThreads, false, F::kSw, kClampSource>(
        sQ, kLd, sq.q_rows<const Elem>(p.q, p.q_stride, h, tile.m0), p.q_stride.row, tile.rows, E, tid);
  }
  __device__ __forceinline__ void k_tile(int64_t n0, int buf) const {
    if (F::kFeatures && bias_tile.rows > 0)
      stage_bias_tile<kBM, kBN, kThreads>(sBias + buf * bias_tile.buffer_bytes(), bias_tile, bias_chunked, p, sq,
                                          h, tile.m0, n0, tile.rows, rows_k(n0), tid);
    copy_tile_async<kBN, kDim, kThreads, Cfg::kFullTileCopies, F::kSw, kClampSource>(
        sK + buf * kBN * kLd, kLd, k + n0 * p.k_stride.row, p.k_stride.row, rows_k(n0), E, tid);
  }
  __device__ __forceinline__ void v_tile(int64_t n0, int buf) const {
    copy_tile_async<kBN, kDim, kThreads, Cfg::kFullTileCopies, F::kSw, kClampSource>(
        sV + buf * kBN * kLd, kLd, v + n0 * p.v_stride.row, p.v_stride.row, rows_k(n0), Ev, tid);
  }
};

// O = 0, row max -inf, row sum 0.
template <class F>
__device__ __forceinline__ void init_rows(typename F::O& o, typename F::RowStat& row_max,
                                          typename F::RowStat& row_sum) {
  using Acc = typename F::Acc;
#pragma unroll
  for (int mw = 0; mw < F::kMW; ++mw) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mw][r] = neg_inf<Acc>();
      row_sum[mw][r] = Acc(0);
    }
#pragma unroll
    for (int d = 0; d < F::kDA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mw][d][e] = Acc(0);
  }
}

// Q's fragments into the registers qa (F::kQInRegs), once Q's copy has landed.
template <class F, class QFrags, class Reads>
__device__ __forceinline__ void q_to_registers(QFrags& qa, const Reads& read) {
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int kk = 0; kk < (F::kQInRegs ? F::kKSteps : 0); ++kk)
#pragma unroll
    for (int mw = 0; mw < F::kMW; ++mw) read.q(qa[kk][mw], mw, kk * F::M::kK);
}

// S = Q K^T for the key tile in K buffer kb (Q from the registers qa where F::kQInRegs).
template <class F, class Reads, class QFrags>
__device__ __forceinline__ void tile_scores(typename F::S& s, const QFrags& qa, const Reads& read, int kb) {
  using M = typename F::M;
  using Acc = typename F::Acc;
  constexpr int kMW = F::kMW, kNA = F::kNA;
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
    for (int j = 0; j < kNA; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mw][j][e] = Acc(0);
#pragma unroll
  for (int ks = 0; ks < F::kKSteps; ++ks) {
    const int kk = ks * M::kK;
    typename M::A a[kMW];
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw) {
      if constexpr (F::kQInRegs) a[mw] = qa[ks][mw];
      else read.q(a[mw], mw, kk);
    }
#pragma unroll
    for (int j = 0; j < kNA; j += 2) {
      typename M::B bf[2];
      read.k(bf, kb, 8 * j, kk);
#pragma unroll
      for (int mw = 0; mw < kMW; ++mw) {
        M::mma(s[mw][j], a[mw], bf[0]);
        M::mma(s[mw][j + 1], a[mw], bf[1]);
      }
    }
  }
}

// Scores -> exponent domain through the general per-score path of ScoreMods (softcap, ALiBi and
// the rest of the feature variant's mods, the bias tile's values among them). The lane's scores of
// one row a set: columns [lo, hi) of the tile are in the row's band (all on an all-visible tile,
// none for rows past the sequence); the mods may still mask. (bias_s by reference here and in
// tile_scores_scaled: by value, the feature variant's code changed.)
template <class F, class Mods, class Col, class Layout>
__device__ __forceinline__ void tile_scores_with_mods(typename F::S& s, const Mods& mods, const Seq& sq,
                                                      const FwdQueryTile& tile, int64_t n0, bool tile_all_visible,
                                                      int wrow, int g, int t, Col tile_column,
                                                      const unsigned char* const& bias_s, const Layout& bias_tile) {
  using Acc = typename F::Acc;
  using Exp = typename F::Exp;
  constexpr int kNA = F::kNA, kBN = F::kBN;
#pragma unroll
  for (int mw = 0; mw < F::kMW; ++mw)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tr = wrow + 16 * mw + g + 8 * r;
      const int64_t m = tile.m0 + tr;
      int lo = 0, hi = tr < tile.rows ? kBN : 0;
      if (!tile_all_visible && hi > 0) {
        lo = tile_column(sq.key_begin(m) - n0);
        hi = tile_column(sq.key_end(m) - n0);
      }
      auto col = [&](int i) { return 8 * (i >> 1) + 2 * t + (i & 1); };
      Acc x[2 * kNA];
      bool in[2 * kNA];
#pragma unroll
      for (int i = 0; i < 2 * kNA; ++i) {
        x[i] = s[mw][i >> 1][2 * r + (i & 1)];
        in[i] = col(i) >= lo && col(i) < hi;
      }
      mods.scores(x, in, m, n0, [&](int i) { return int2{0, col(i)}; },
                  [&](int i) { return bias_s + bias_tile.offset(tr, col(i)); }, static_cast<Acc*>(nullptr));
#pragma unroll
      for (int i = 0; i < 2 * kNA; ++i) s[mw][i >> 1][2 * r + (i & 1)] = x[i] * Exp::score_scale(1.0);
    }
}

// Scores -> exponent domain without the general mods: the scale, then (feature variant) the bias
// tile's values, one add per score.
template <class F, class Elem, class Layout>
__device__ __forceinline__ void tile_scores_scaled(typename F::S& s, typename F::Acc score_scale, const FwdParams& p,
                                                   const unsigned char* const& bias_s, const Layout& bias_tile,
                                                   int wrow, int g, int t) {
  using Acc = typename F::Acc;
  using Exp = typename F::Exp;
  constexpr int kMW = F::kMW, kNA = F::kNA;
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
    for (int j = 0; j < kNA; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mw][j][e] *= score_scale;
  if constexpr (F::kFeatures) {
    with_bias_reader<Elem>(p.bias_kind, p.bias_dtype, [&](auto reader) {
      using R = decltype(reader);
      if constexpr (R::kBytes > 0) {
#pragma unroll
        for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const unsigned char* row = bias_s + bias_tile.row_offset(wrow + 16 * mw + g + 8 * r);
#pragma unroll
            for (int j = 0; j < kNA; ++j)
#pragma unroll
              for (int cc = 0; cc < 2; ++cc)
                s[mw][j][2 * r + cc] +=
                    Exp::score_scale(1.0) * reader.template value<Acc>(row + (8 * j + 2 * t + cc) * R::kBytes);
          }
      }
    });
  }
}

// The online softmax of a key tile's scores (in the exponent domain, masked ones -inf): the rows'
// max and sum updated, S turned into the unnormalised P, alpha the factors that rescale O. Returns
// whether the max of some row of the warp grew (alpha is exactly 1 where it did not).
// probs(s, mw, r) runs after each row's P and sum are formed (dropout: FwdDropout).
template <class F, class Probs>
__device__ __forceinline__ bool online_softmax_tile(typename F::S& s, typename F::RowStat& row_max,
                                                    typename F::RowStat& row_sum, typename F::RowStat& alpha,
                                                    const Probs& probs) {
  using Acc = typename F::Acc;
  using Exp = typename F::Exp;
  constexpr int kMW = F::kMW, kNA = F::kNA;
  // Each row's tile max over its quad, as a tree (depth log2(2 kNA), not a chain of 2 kNA
  // dependent FMNMX).
  Acc tile_max[kMW][2];
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      Acc mx[kNA];
#pragma unroll
      for (int j = 0; j < kNA; ++j) mx[j] = acc_max(s[mw][j][2 * r], s[mw][j][2 * r + 1]);
      tile_max[mw][r] = reduce_max_lanes<4>(tree_reduce(mx, [](Acc a, Acc b) { return acc_max(a, b); }));
    }

  // alpha differs from 1 only on tiles where the max of some row of the warp grew. The max is
  // never left stale: with a lagging max the row's largest P is no longer exactly 1 and a one-hot
  // row loses O = V exactly (fwd_piece).
  bool grow = false;
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
    for (int r = 0; r < 2; ++r) grow |= tile_max[mw][r] > row_max[mw][r];
  grow = __any_sync(0xffffffffu, grow);
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      alpha[mw][r] = Acc(1);
      if (grow) {
        const Acc new_max = acc_max(row_max[mw][r], tile_max[mw][r]);
        alpha[mw][r] = Exp::exp(row_max[mw][r] - exp_base(new_max));
        row_max[mw][r] = new_max;
      }
      // A row with no visible key so far keeps max -inf; 0 as the base avoids (-inf) - (-inf).
      const Acc base = exp_base(row_max[mw][r]);
      Acc sums[kNA];
#pragma unroll
      for (int j = 0; j < kNA; ++j) {
        Acc* x = s[mw][j] + 2 * r;
        x[0] = Exp::exp(x[0] - base);
        x[1] = Exp::exp(x[1] - base);
        sums[j] = x[0] + x[1];
      }
      row_sum[mw][r] = row_sum[mw][r] * alpha[mw][r] + tree_reduce(sums, [](Acc a, Acc b) { return a + b; });
      probs(s, mw, r);
    }
  }
  return grow;
}

// Dropout on a row's probabilities (feature variant): the row sum keeps every probability, only
// P V sees the dropped ones as 0. The lane's rows of the warp (first row wrow of the query tile
// at m0) against the tile's keys from n0.
template <class F>
struct FwdDropout {
  const DropoutMask<typename F::Acc>& drop;
  int64_t m0, n0;
  int wrow, g, t;
  __device__ __forceinline__ void operator()(typename F::S& s, int mw, int r) const {
    if (F::kFeatures && drop.on) {
      const int64_t m = m0 + wrow + 16 * mw + g + 8 * r;
#pragma unroll
      for (int j = 0; j < F::kNA; ++j)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc)
          if (!drop.keep(m, n0 + 8 * j + 2 * t + cc)) s[mw][j][2 * r + cc] = typename F::Acc(0);
    }
  }
};

// O = alpha O (rescale) where `rescale`, then O += P V with P straight from the S registers and V
// from buffer vb.
template <class F, class Reads>
__device__ __forceinline__ void add_pv(typename F::O& o, typename F::S& s, const typename F::RowStat& alpha,
                                       bool rescale, const Reads& read, int vb) {
  using M = typename F::M;
  constexpr int kMW = F::kMW, kDA = F::kDA;
  if (rescale) {
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
      for (int d = 0; d < kDA; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mw][d][e] *= alpha[mw][e >> 1];
  }
#pragma unroll
  for (int kk = 0; kk < F::kBN; kk += M::kK) {
    typename M::A a[kMW];
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw) M::a_from_acc(a[mw], &s[mw][kk / 8]);
#pragma unroll
    for (int d = 0; d < kDA; d += 2) {
      typename M::B bf[2];
      read.v(bf, vb, kk, 8 * d);
#pragma unroll
      for (int mw = 0; mw < kMW; ++mw) {
        M::mma(o[mw][d], a[mw], bf[0]);
        M::mma(o[mw][d + 1], a[mw], bf[1]);
      }
    }
  }
}

// The tile's output through smem (plain swizzled kernels): a warp writes its rows O / l into its
// own rows of sQ, which only it read and its last S products are done with, and copies them out a
// 16-byte chunk per lane, a row's chunks across lanes (4-byte stores from the accumulators
// write half sectors of 8 rows, with a column test per store). Measured (H200, bf16, key loops'
// SASS unchanged): forward +1.7..+4% at L = 512 at dims 128 / 256, +1..+2% at 1024, within
// noise from 4096 (docs/kernels/sm80_forward.md). The feature variant keeps the stores from
// registers (store_rows).
template <class F, class Elem>
__device__ __forceinline__ void store_rows_staged(const typename F::O& o, const typename F::RowStat& row_max,
                                                  const typename F::RowStat& row_sum, const FwdParams& p,
                                                  const Seq& sq, const FwdQueryTile& tile, int64_t h,
                                                  unsigned char* smem_raw, Elem* sQ, int wrow, int g, int t,
                                                  int Ev) {
  using M = typename F::M;
  using Acc = typename F::Acc;
  using Exp = typename F::Exp;
  using TA = typename F::TA;
  constexpr int kMW = F::kMW, kDA = F::kDA;
  Elem* out = sq.q_rows<Elem>(p.out, p.out_stride, h, 0);
  Acc* lse = static_cast<Acc*>(p.lse);
  // (opaque: formed here, not ahead of the key loop and held across it)
  const uint32_t out_at = TA::base(sQ, opaque(wrow + g), 0);  // the lane's row g of the warp's rows
  __syncwarp();  // every lane's reads of these rows (ldmatrix serves other lanes) are done
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const Acc l = reduce_sum_lanes<4>(row_sum[mw][r]);
      // l == 0 only when no key is visible: out = 0, lse = -inf. A NaN l propagates.
      const bool empty = l == Acc(0);
      const Acc inv = empty ? Acc(0) : Acc(1) / l;
#pragma unroll
      for (int d = 0; d < kDA; ++d) {  // row 16 mw + 8 r + g, chunk d, bytes 4t.. of the warp's rows
        const uint32_t at = TA::at(out_at, 16 * mw + 8 * r, d) + 4 * t;
        *reinterpret_cast<uint32_t*>(smem_raw + (at - smem_addr(smem_raw))) =
            M::pack(o[mw][d][2 * r] * inv, o[mw][d][2 * r + 1] * inv);
      }
      const int64_t m = tile.m0 + wrow + 16 * mw + g + 8 * r;
      if (t == 0 && m < sq.len_q)
        lse[sq.row_index(p.heads_q, h, m)] = empty ? neg_inf<Acc>() : Exp::lse(row_max[mw][r], l);
    }
  }
  __syncwarp();
  // A row's chunks on kLanesPerRow lanes (one chunk each, read at SwizzledAddress's place),
  // kRowsPerStep rows per step (fwd() checks that the output rows are 16-byte aligned). A rolled
  // loop: fully unrolled, it moved the key loop's registers (52 B of spills at dims 64 and 128,
  // 5 more registers at 256); one step per iteration serialized each load and its store.
  constexpr int kChunk = chunk_elems<Elem>(), kLanesPerRow = F::kDim / kChunk, kRowsPerStep = 32 / kLanesPerRow;
  static_assert(kLanesPerRow <= 32 && 32 % kLanesPerRow == 0, "a row's chunks divide the warp");
  const int lane_o = opaque(4 * g + t);  // (opaque: the forms below stay out of the key loop)
  const int c = lane_o % kLanesPerRow, row0 = wrow + lane_o / kLanesPerRow;
  Elem* dst = out + (tile.m0 + row0) * p.out_stride.row + c * kChunk;
  const int64_t dst_step = kRowsPerStep * p.out_stride.row;
  const bool col_ok = c * kChunk < Ev;
  const int rows_left = tile.rows - row0;
  // Steps in batches of 4: their loads first, then their stores, so that the loads overlap.
  constexpr int kSteps = 16 * kMW / kRowsPerStep, kBatch = 4;
  static_assert(kSteps % kBatch == 0, "whole batches");
#pragma unroll 1
  for (int i0 = 0; i0 < kSteps; i0 += kBatch) {
    uint4 chunk[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const uint32_t at = TA::base(sQ, row0 + (i0 + j) * kRowsPerStep, c);
      chunk[j] = *reinterpret_cast<const uint4*>(smem_raw + (at - smem_addr(smem_raw)));
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (col_ok && (i0 + j) * kRowsPerStep < rows_left)
        *reinterpret_cast<uint4*>(dst + (i0 + j) * dst_step) = chunk[j];
  }
}

// The tile's output from the accumulators: O / l (times 1 / keep with dropout) and the LSE of
// each row of the sequence.
template <class F, class Elem>
__device__ __forceinline__ void store_rows(const typename F::O& o, const typename F::RowStat& row_max,
                                           const typename F::RowStat& row_sum, const FwdParams& p, const Seq& sq,
                                           const FwdQueryTile& tile, int64_t h,
                                           const DropoutMask<typename F::Acc>& drop, int wrow, int g, int t, int Ev) {
  using M = typename F::M;
  using Acc = typename F::Acc;
  using Exp = typename F::Exp;
  Elem* out = sq.q_rows<Elem>(p.out, p.out_stride, h, 0);
  Acc* lse = static_cast<Acc*>(p.lse);
#pragma unroll
  for (int mw = 0; mw < F::kMW; ++mw) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const Acc l = sq.row_sum(reduce_sum_lanes<4>(row_sum[mw][r]));
      const int64_t m = tile.m0 + wrow + 16 * mw + g + 8 * r;
      if (m >= sq.len_q) continue;
      // l == 0 only when no key is visible: out = 0, lse = -inf. A NaN l (an invalid sequence's
      // too) propagates.
      const bool empty = l == Acc(0);
      const Acc inv = empty ? Acc(0) : (F::kFeatures && drop.on ? drop.inv_keep : Acc(1)) / l;
      Elem* o_row = out + m * p.out_stride.row;
#pragma unroll
      for (int d = 0; d < F::kDA; ++d) {
        const int col = 8 * d + 2 * t;
        if (col < Ev) M::store_pair(o_row + col, o[mw][d][2 * r] * inv, o[mw][d][2 * r + 1] * inv);
      }
      if (t == 0) lse[sq.row_index(p.heads_q, h, m)] = empty ? neg_inf<Acc>() : Exp::lse(row_max[mw][r], l);
    }
  }
}

}  // namespace flashattn::cuda::sm80
