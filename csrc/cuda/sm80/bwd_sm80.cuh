// Tensor-core backward (sm_80+): dK, dV, and dQ added atomically into an accumulator
// (schedule/key_tile_rounds.h's DqAccum), one kernel for fp16, bf16 and fp64 through fragments.cuh.
//
// One block per (batch, kv head, kBN-key tile); each warp owns 16 keys (at the dims where dK
// and dV do not fit in one warp's registers, a pair of warps owns them: see below). K and V stay in smem;
// the block walks every query head of the group and every kBM-row query tile that can see its
// keys, with Q, dO, LSE, D and the mask/bias tile double-buffered (the next tile loads while
// this one is used).
// Working on the transposed products keeps everything a warp needs in its registers:
//   S^T = K Q^T and dP^T = V dO^T            (warp rows = its keys)
//   P^T = exp(scale S^T - LSE), dS^T = P^T (dP^T - D)    elementwise, in registers
//   dV += P^T dO, dK += dS^T Q               (A operands taken straight from P^T / dS^T)
// dQ = dS K needs dS by query row: dS^T goes through smem once per tile, stored as the warps
// hold it (key-major, two adjacent rows per store) and read back transposed by ldmatrix; warps
// then split that product by (16-row group, column group) and add their part into the fp32
// (fp64) accumulator.
// Warp pairs (BwdConfig::kPair = 2): the two warps of a key group each take half the dims of the
// S^T and dP^T reductions, add each other's partial sums through smem (both get the same sums:
// a + b == b + a), and keep dK, dV for their half of the columns.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../params.h"
#include "../common/bias_tile.cuh"
#include "../common/check.h"
#include "../common/dq_atomics.cuh"
#include "../common/features.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "../common/numeric.cuh"
#include "../common/online_softmax.cuh"
#include "../common/operand_alignment.h"
#include "../common/tile_copy.cuh"
#include "../plan.h"
#include "../schedule/causal_order.cuh"
#include "../schedule/query_walk.cuh"
#include "bwd_forms.h"
#include "bwd_sm80_2d.cuh"
#include "bwd_steps.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// kFeatures: the variant for calls with optional features (see fwd_sm80.cuh). kGeneral: with
// the per-score step for softcap, ALiBi, dropout and the bias gradient (needs_general_step),
// which takes registers and so smaller tiles; windows, varlen and a bias alone go without it.
// kCompact: the general variant's tiles for GPUs with 99 KB of smem per block (BwdConfig).
template <class Elem, int kDim, bool kFeatures, bool kGeneral, bool kCompact = false>
__global__ void __launch_bounds__(BwdConfig<Elem, kDim, kGeneral, kCompact>::kThreads,
                                  BwdConfig<Elem, kDim, kGeneral, kCompact>::kMinBlocks)
    bwd_dkdv_kernel(const BwdParams p, const typename Mma<Elem>::Acc* dsum_g, const DqAccum accum,
                    KeyTileRound round) {
  static_assert(kFeatures || !kGeneral, "the general step is a feature");
  using Cfg = BwdConfig<Elem, kDim, kGeneral, kCompact>;
  using M = Mma<Elem>;
  using Acc = typename M::Acc;
  using Exp = ExpDomain<Acc>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd, kLdS = Cfg::kLdS;
  constexpr int kThreads = Cfg::kThreads, kWarps = Cfg::kWarps;
  constexpr int kQA = kBM / 8;   // S^T atoms of a warp (8 query rows each)
  // A warp reduces S^T, dP^T over dims [c0, c0 + kDimOut) and owns those columns of dK, dV
  // (kDimOut = kDim unless warps pair up).
  constexpr int kPair = Cfg::kPair, kKeyGroups = kWarps / kPair, kDimOut = Cfg::kDimOut;
  constexpr int kDA = kDimOut / 8;  // dK / dV atoms of a warp
  // dQ split: warp -> (16-row group, column group of kDim / kColGroups). Column groups at
  // least 32 wide where that leaves two: a 16-wide group loads as many dS^T fragments as K
  // fragments per product (dim 64: 32 wide, +2% on the backward, the other 4 warps skip dQ);
  // dim 32 keeps two groups of 16 (one of 32 measured -4%).
  constexpr int kRowGroups = kBM / 16;
  // fp64 loads its fragments without ldmatrix: 16-wide groups, so more warps share the product.
  constexpr int kColCap = Cfg::kDouble ? kDim / 16 : kDim / 32 > 2 ? kDim / 32 : 2;
  constexpr int kColGroups = kWarps / kRowGroups < kColCap ? kWarps / kRowGroups : kColCap;
  constexpr int kQCols = kDim / kColGroups, kQCA = kQCols / 8;
  static_assert(kWarps % kRowGroups == 0, "dQ split");
  static_assert(kQCA % 2 == 0, "B atoms load in pairs (column groups are 16 or 32k wide)");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);
  Elem* sV = sK + kBN * kLd;
  Elem* sQ = sV + kBN * kLd;        // [2][kBM][kLd]
  Elem* sdO = sQ + 2 * kBM * kLd;   // [2][kBM][kLd]
  Elem* sdSt = sdO + 2 * kBM * kLd;  // [kBN][kLdS]: dS^T, key-major
  Acc* sLse = reinterpret_cast<Acc*>(sdSt + kBN * kLdS);  // [2][kBM], natural log as stored
  Acc* sD = sLse + 2 * kBM;                                 // [2][kBM]
  Acc* sX = sD + 2 * kBM;  // warp pairs: [kWarps][2 kQA][32 lanes][4] partial S^T, dP^T
  unsigned char* sBias = reinterpret_cast<unsigned char*>(sX) + Cfg::kExchangeBytes;  // [2] bias tiles

  // Early key tiles (seen by the most query rows under causal masking) first; a causal grid's
  // last pairs key tile slowest (causal_order.cuh).
  const TileBlock blk = tile_block(round.groups, 1, p.heads_kv, /*heaviest_first=*/false,
                                   ordered_block<!kFeatures>(round.heavy, round.groups));
  const int nt = round.first + blk.tile;
  const int64_t hk = blk.head, b = blk.batch;
  const int64_t group = p.heads_q / p.heads_kv;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int half = kPair > 1 ? warp / kKeyGroups : 0;  // which warp of its pair
  const int wkey = (kPair > 1 ? warp % kKeyGroups : warp) * 16, c0 = half * kDimOut;
  // Rows and keys are counted within the sequence (see fwd_sm80.cuh).
  const Seq sq = kFeatures ? sequence(p, b) : plain_sequence(p, b);
  const int64_t n0 = int64_t(nt) * kBN;
  if (n0 >= sq.len_k) return;
  const int rows_k = sq.k_tile_rows(n0, kBN);
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const Acc score_scale = Exp::score_scale(p.scale);

  const Elem* k = sq.k_rows<const Elem>(p.k, p.k_stride, hk, n0);
  const Elem* v = sq.k_rows<const Elem>(p.v, p.v_stride, hk, n0);
  copy_tile_async<kBN, kDim, kThreads>(sK, kLd, k, p.k_stride.row, rows_k, E, tid);
  copy_tile_async<kBN, kDim, kThreads>(sV, kLd, v, p.v_stride.row, rows_k, Ev, tid);

  const BiasTileLayout bias_tile = kFeatures ? bias_tile_layout<kBM, kBN>(p) : BiasTileLayout{};
  const bool bias_chunked = kFeatures && bias_rows_chunked(p);
  auto load = [&](int64_t h, int64_t m0, int buf) {
    load_query_tile<kBM, kBN, kDim, kThreads, false, RowStats<kBM>>(sQ, sdO, sLse, sBias, kLd, bias_tile, bias_chunked, p, sq, dsum_g,
                                              h, m0, n0, rows_k, buf, tid);
  };

  Acc dk[kDA][4], dv[kDA][4];
#pragma unroll
  for (int d = 0; d < kDA; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = Acc(0);

  walk_query_tiles<kBM>(sq, n0, rows_k, hk * group, group, load, [&](int64_t h, int64_t m0, int buf, auto start_next) {
    start_next();
    const Elem* q_s = sQ + buf * kBM * kLd;
    const Elem* do_s = sdO + buf * kBM * kLd;
    const Acc* lse_s = sLse + buf * kBM;
    const Acc* d_s = sD + buf * kBM;

    Acc st[kQA][4], dpt[kQA][4];
    scores_and_dp<M, kDimOut, kLd>(st, dpt, sK + wkey * kLd + c0, sV + wkey * kLd + c0, q_s + c0, do_s + c0, lane);
    if constexpr (kPair > 1) add_partner_sums<kKeyGroups, kWarps>(st, dpt, sX, warp, lane);

    // P^T and dS^T, both 0 wherever the key is not visible (so values there, even NaN or
    // inf, never reach a gradient). Tiles every row sees in full skip the per-element mask.
    const bool all_visible = n0 >= sq.key_begin(m0 + kBM - 1) && n0 + kBN <= sq.key_end(m0);
    // On masked tiles, the warp's key kw (0..15) is visible to tile row `row` iff
    // lo0 + row <= kw <= hi0 + row and kw < k_lim. The bases are clamped once per tile to
    // [-kBM - 1, 17], which keeps every comparison (0 <= row < kBM, 0 <= kw < 16) in 32 bits.
    int lo0 = 0, hi0 = 0, k_lim = 16;
    auto band_bases = [&] {
      auto clamp_base = [](int64_t x) { return int(x < -kBM - 1 ? -kBM - 1 : x > 17 ? 17 : x); };
      const int64_t base = m0 - n0 - wkey;
      lo0 = clamp_base(base + sq.band.lo);
      hi0 = clamp_base(base + sq.band.hi);
      k_lim = clamp_base(sq.len_k - n0 - wkey);
    };
    bool featured = false;
    if constexpr (kGeneral) {
      const ScoreMods<Acc> mods(p, sq, h);
      const DropoutMask<Acc> drop(p, sq, h);
      Acc* dbias = c0 == 0 ? dbias_rows<Acc>(p, sq, h) : nullptr;  // one warp of a pair writes it
      // A bias alone (no gradient) takes the plain step below with one add per score; both warps
      // of a pair take the same step (so they hold the same dS^T).
      featured = mods_beyond_bias(p) || drop.on || p.dbias != nullptr;
      if (featured) {
        band_bases();
        general_probs_and_ds<kBM>(st, dpt, mods, drop, dbias, sq, m0, n0, wkey, lse_s, d_s,
                                  sBias + buf * bias_tile.buffer_bytes(), bias_tile, lo0, hi0, k_lim, g, t);
      }
    }
    if (!featured) {
      if (!all_visible) band_bases();
      // Written once, instantiated for all-visible and masked tiles (and per bias element type),
      // so the per-score code of the common case carries no branch (a branch inside it cost
      // ~12 instructions a score). A bias term of -inf makes P 0 through the exp.
      auto probs = [&](auto masked_tag, auto reader) {
        probs_and_ds_t<decltype(masked_tag)::value>(st, dpt, reader, lse_s, d_s, sBias, buf, bias_tile, score_scale,
                                                    wkey, lo0, hi0, k_lim, g, t);
      };
      auto probs_of_tile = [&](auto masked_tag) {
        if constexpr (kFeatures)
          with_bias_reader<Elem>(p.bias_kind, p.bias_dtype, [&](auto reader) { probs(masked_tag, reader); });
        else probs(masked_tag, NoBias{});
      };
      if (all_visible) probs_of_tile(std::false_type{});
      else probs_of_tile(std::true_type{});
    }

    // dV += P^T dO and dK += dS^T Q over the tile's rows, the A operands straight from the P^T /
    // dS^T registers. (Here, not in a function of bwd_steps.cuh: there the compact kernels' code
    // changed.)
#pragma unroll
    for (int kk = 0; kk < kBM; kk += M::kK) {
      typename M::A ap, ads;
      M::a_from_acc(ap, &st[kk / 8]);
      M::a_from_acc(ads, &dpt[kk / 8]);
#pragma unroll
      for (int d = 0; d < kDA; d += 2) {
        typename M::B bo[2], bq[2];
        M::load_b2_kn(bo, do_s + kk * kLd + c0 + 8 * d, kLd, lane);
        M::load_b2_kn(bq, q_s + kk * kLd + c0 + 8 * d, kLd, lane);
        M::mma(dv[d], ap, bo[0]);
        M::mma(dv[d + 1], ap, bo[1]);
        M::mma(dk[d], ads, bq[0]);
        M::mma(dk[d + 1], ads, bq[1]);
      }
    }

    if (accum.base != nullptr) {  // (never null: the test steers register allocation, see bwd_sm80_2d.cuh)
      // dS^T into smem as held: key wkey + g (+ 8), query rows 8j + 2t and 8j + 2t + 1 (by one
      // warp of a pair: both hold the same values).
      if (half == 0) {
#pragma unroll
        for (int j = 0; j < kQA; ++j) {
          M::store_pair(sdSt + (wkey + g) * kLdS + 8 * j + 2 * t, dpt[j][0], dpt[j][1]);
          M::store_pair(sdSt + (wkey + g + 8) * kLdS + 8 * j + 2 * t, dpt[j][2], dpt[j][3]);
        }
      }
      __syncthreads();
      if (warp >= kRowGroups * kColGroups) return;
      const int rg = warp % kRowGroups, cg = warp / kRowGroups;
      Acc dq[1][kQCA][4];  // one row group (add_dq_atoms takes several)
      dq_of_row_group<M, kBN, kLd, kLdS, kQCols>(dq[0], sdSt, sK, rg, cg, lane);
      add_dq_atoms(accum.block_slice<Acc>(round.groups), sq.row_index(p.heads_q, h, m0), dq, 16 * rg, cg * kQCols,
                   sq.q_tile_rows(m0, kBM), E, lane);
    }
  });

  Elem* dk_g = sq.k_rows<Elem>(p.dk, p.dk_stride, hk, 0);
  Elem* dv_g = sq.k_rows<Elem>(p.dv, p.dv_stride, hk, 0);
  const Acc scale = Acc(p.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wkey + g + 8 * r;
    if (key >= rows_k) continue;
#pragma unroll
    for (int d = 0; d < kDA; ++d) {
      const int col = c0 + 8 * d + 2 * t;
      if (col < E)
        M::store_pair(dk_g + (n0 + key) * p.dk_stride.row + col, dk[d][2 * r] * scale,
                      dk[d][2 * r + 1] * scale);
      if (col < Ev)
        M::store_pair(dv_g + (n0 + key) * p.dv_stride.row + col, dv[d][2 * r], dv[d][2 * r + 1]);
    }
  }
}

template <class Elem, int kDim, bool kFeatures, bool kGeneral, bool kCompact = false>
bool launch_dkdv(const BwdParams& p, const void* dsum, const DqAccum& accum, cudaStream_t stream) {
  using Cfg = BwdConfig<Elem, kDim, kGeneral, kCompact>;
  const size_t smem = Cfg::kSmemBytes + 2 * size_t(bias_tile_layout<Cfg::kBM, Cfg::kBN>(p).buffer_bytes());
  if (!tensor_cores_usable(smem) || !bwd_operands_aligned(p)) return false;
  using Acc = typename Mma<Elem>::Acc;
  auto kernel = bwd_dkdv_kernel<Elem, kDim, kFeatures, kGeneral, kCompact>;
  set_smem(kernel, smem, "sm80::bwd_dkdv_kernel");
  const int per_sm = !kFeatures && heavy_last_serves(p) ? blocks_per_sm(kernel, Cfg::kThreads, smem) : 0;
  for_key_tile_rounds(p, Cfg::kBN, accum, [&](unsigned blocks, KeyTileRound round) {
    round.heavy = plan_heavy_last(blocks, round.groups, per_sm);
    kernel<<<blocks, Cfg::kThreads, smem, stream>>>(p, static_cast<const Acc*>(dsum), accum, round);
    check_launch("sm80::bwd_dkdv_kernel");
  });
  return true;
}

template <class Elem, int kDim>
bool bwd_dkdv(const BwdParams& p, BwdKernel kernel, const void* dsum, const DqAccum& accum, const DkDvTail& tail,
              cudaStream_t stream) {
  if constexpr (!BwdConfig<Elem, kDim>::kServed) {
    return false;
  } else {
    switch (kernel) {
      case BwdKernel::kSm80Plain:  // (compiled at the tiers where a GPU can run it: bwd_forms.h)
        if constexpr (bwd_1d_plain_compiled<Elem, kDim>()) return launch_dkdv<Elem, kDim, false, false>(p, dsum, accum, stream);
        return false;
      case BwdKernel::kSm80Features: return launch_dkdv<Elem, kDim, true, false>(p, dsum, accum, stream);
      case BwdKernel::kSm80General: return launch_dkdv<Elem, kDim, true, true>(p, dsum, accum, stream);
      case BwdKernel::kSm80Compact:
        if constexpr (BwdConfig<Elem, kDim, true, true>::kServed)
          return launch_dkdv<Elem, kDim, true, true, true>(p, dsum, accum, stream);
        return false;
      default: return launch_dkdv_2d<Elem, kDim>(p, kernel, dsum, accum, tail, stream);
    }
  }
}

}  // namespace flashattn::cuda::sm80
