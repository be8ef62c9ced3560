// Tensor-core dK/dV kernel (with the atomic dQ) in a 2-D warp layout, for fp16/bf16 calls at
// dims 64 to 256 (Bwd2dConfig) without the general per-score step: plain, or (kFeatures)
// with a sliding window, a variable-length batch and a bias / mask, staged in smem per tile as
// in bwd_sm80.cuh. The block and its walk (query_walk.cuh) are those of bwd_sm80.cuh's kernel:
// one block per (batch, kv head, key tile of kBN = 128 keys, 64 above dim 128); the products
// are laid out differently:
//   S = Q K^T, dP = dO V^T      warps on a grid of rows x 32 keys (2 x 4 of kBM / 2 rows for
//                               128-key blocks, 4 x 2 of kBM / 4 rows for 64; A: Q / dO rows,
//                               B: K / V rows)
//   P, dS = P (dP - D)          in registers, stored to smem as [row][key] (Elem; by stmatrix on
//                               sm_90+ at dims <= 128)
//   dV += P^T dO, dK += dS^T Q  warps on a grid of 32 keys x dims (4 x 2 of kDim / 2 for
//                               128-key blocks, 2 x 4 of kDim / 4 for 64; A: P^T / dS^T read
//                               transposed from smem, B: dO / Q)
//   dQ += dS K                  warps on 2 x 4 or 4 x 2 (rows x dims; Bwd2dConfig::kDqColWarps),
//                               added with atomics
// P and dS round to Elem before the products, as in the 1-D kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/bias_tile.cuh"
#include "../common/check.h"
#include "../common/cp_async.cuh"
#include "../common/dq_atomics.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "../common/numeric.cuh"
#include "../common/online_softmax.cuh"
#include "../common/tile_copy.cuh"
#include "../plan.h"
#include "../schedule/query_walk.cuh"
#include "../schedule/tail_split.cuh"
#include "bwd_2d_steps.cuh"
#include "bwd_forms.h"
#include "launch.h"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// Where the LSE and D of query row m lie in the kernel's stats area at dim 64 (elsewhere
// query_walk.cuh's RowStats): a lane of S / dP reads those of rows 16 i + g and 16 i + g + 8 of
// its warp's slab of kSlab rows as one 16-byte chunk, and the 8 chunks of one i lie in 128
// contiguous bytes: one conflict-free LDS.128 per row group, 4 per tile where RowStats takes 16
// scalar LDS (Bwd2dConfig::kSlabStats says why only there).
// kBufs: buffers of kBM rows (one: `buf` ignored).
template <int kBM, int kSlab, int kBufs>
struct SlabStats {
  static __device__ __forceinline__ int lse(int buf, int m) {
    const int r = m % kSlab;
    return (kBufs > 1 ? buf : 0) * 2 * kBM + 2 * (m - r) + 32 * (r / 16) + 4 * (r % 8) + 2 * (r / 8 % 2);
  }
  static __device__ __forceinline__ int d(int buf, int m) { return lse(buf, m) + 1; }
};

// kOneSync (Bwd2dConfig): one barrier per query tile, with the Q / dO and P / dS buffers below;
// kTwoBlocks: half the block, two per SM (Bwd2dConfig). A block takes one walk, or (plain calls
// whose grid's last wave is split: tail_split.cuh) a part of one, its dK / dV added into the tail
// area.
template <class Elem, int kDim, bool kFeatures, bool kOneSync, bool kTwoBlocks = false>
__global__ void __launch_bounds__(Bwd2dConfig<Elem, kDim, kOneSync, kTwoBlocks>::kThreads, 1)
    bwd_dkdv_2d_kernel(const BwdParams p, const float* dsum_g, const DqAccum accum, KeyTileRound round) {
  static_assert(!(kOneSync && kFeatures), "one barrier per tile serves plain calls (bias tiles would need more buffers)");
#ifndef FLASHATTN_STMATRIX
  // Their swizzled P / dS are stored only with stmatrix: launch_dkdv_2d launches them on sm_90+ only.
  if constexpr (kOneSync || kTwoBlocks) {
    __trap();
    return;
  }
#endif
  using W = Bwd2dShape<Elem, kDim, kOneSync, kTwoBlocks>;
  using Cfg = typename W::Cfg;
  using M = typename W::M;
  using Acc = float;
  using Exp = ExpDomain<Acc>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd, kLdP = Cfg::kLdP, kThreads = Cfg::kThreads;
  constexpr bool kSw = Cfg::kSwizzle;  // K, V, Q, dO tiles swizzled (tile_copy.cuh)
  // The warp grids: S / dP kRowW x kKeyW, dK / dV kKeyW x kColW, dQ kQRW x kQCW (Bwd2dShape).
  constexpr int kKeyW = W::kKeyW, kRowW = W::kRowW, kColW = W::kColW;
  constexpr int kKA = W::kKA, kQA = W::kQA;
  constexpr int kQCW = W::kQCW, kQRW = W::kQRW;
  constexpr int kQBufs = Cfg::kQBufs, kPBufs = Cfg::kPBufs, kStatsBufs = Cfg::kStatsBufs;
  using Stats = std::conditional_t<Cfg::kSlabStats, SlabStats<kBM, kBM / kRowW, kStatsBufs>, RowStats<kBM, kQBufs>>;
  static_assert(!Cfg::kSlabStats || (kQBufs == 2 && Cfg::kStatsOffset % 16 == 0),
                "SlabStats chunks are read 16 bytes at a time, two Q / dO buffers");
  static_assert(kStatsBufs == kQBufs || (Cfg::kSlabStats && !kOneSync),
                "one LSE / D buffer: SlabStats, and a walk whose next tile loads after the P / dS barrier");

  extern __shared__ __align__(16) unsigned char smem_raw[];  // dynamic smem starts the block window: 128-byte aligned, as swizzled tiles need
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);
  Elem* sV = sK + kBN * kLd;
  Elem* sQ = sV + kBN * kLd;              // [kQBufs][kBM][kLd]
  Elem* sdO = sQ + kQBufs * kBM * kLd;    // [kQBufs][kBM][kLd]
  Elem* sP = sdO + kQBufs * kBM * kLd;    // [kPBufs][P, dS][kBM][kLdP]
  Elem* sdS = sP + kBM * kLdP;            // dS of P / dS buffer 0
  Acc* sStats = reinterpret_cast<Acc*>(smem_raw + Cfg::kStatsOffset);  // LSE (natural log as stored) and D of kStatsBufs tiles: Stats
  unsigned char* sBias = reinterpret_cast<unsigned char*>(sStats + 2 * kStatsBufs * kBM);  // [2] bias tiles (kFeatures)
  uint64_t* sLanded = reinterpret_cast<uint64_t*>(sStats + 2 * kStatsBufs * kBM);  // [2] mbarriers (Cfg::kTracked)

  constexpr bool kSplit = !kFeatures && Cfg::kTailSplit;  // (launch_with_tail_split plans none otherwise)
  const WalkSegment seg = kSplit ? walk_segment(round) : WalkSegment{blockIdx.x, 0, -1, -1};
  const TileBlock blk = tile_block(round.groups, 1, p.heads_kv, /*heaviest_first=*/false, seg.block);
  const int64_t hk = blk.head, b = blk.batch;
  const int64_t group = p.heads_q / p.heads_kv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const Seq sq = kFeatures ? sequence(p, b) : plain_sequence(p, b);
  const int64_t n0 = int64_t(round.first + blk.tile) * kBN;
  if (n0 >= sq.len_k) return;
  const int rows_k = sq.k_tile_rows(n0, kBN);
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const Acc score_scale = Exp::score_scale(p.scale);

  copy_tile_async<kBN, kDim, kThreads, false, kSw>(sK, kLd, sq.k_rows<const Elem>(p.k, p.k_stride, hk, n0), p.k_stride.row,
                                       rows_k, E, tid);
  copy_tile_async<kBN, kDim, kThreads, false, kSw>(sV, kLd, sq.k_rows<const Elem>(p.v, p.v_stride, hk, n0), p.v_stride.row,
                                       rows_k, Ev, tid);

  const BiasTileLayout bias_tile = kFeatures ? bias_tile_layout<kBM, kBN>(p) : BiasTileLayout{};
  const bool bias_chunked = kFeatures && bias_rows_chunked(p);
  auto load = [&](int64_t h, int64_t m0, int buf) {
    load_query_tile<kBM, kBN, kDim, kThreads, kSw, Stats>(sQ, sdO, sStats, sBias, kLd, bias_tile, bias_chunked, p, sq, dsum_g,
                                              h, m0, n0, rows_k, buf, tid);
  };

  // This warp's places in the three layouts (kKeyW is 2 or 4: shifts and masks).
  constexpr int kKeyShift = kKeyW == 4 ? 2 : 1;
  static_assert(kKeyW == 1 << kKeyShift, "2 or 4 key warps");
  const int s_row = (kBM / kRowW) * (warp >> kKeyShift), s_key = 32 * (warp & (kKeyW - 1));   // S, dP
  const int k_key = 32 * (warp & (kKeyW - 1)), k_col = (kDim / kColW) * (warp >> kKeyShift);  // dK, dV
  const unsigned uwarp = unsigned(warp);  // (unsigned: / and % by the constants are shifts)
  const int q_row = (kBM / kQRW) * int(uwarp / kQCW), q_col = (kDim / kQCW) * int(uwarp % kQCW);  // dQ

  // Swizzled, the lanes' ldmatrix addresses in K / V / Q / dO (tile_copy.cuh's SwizzledAddress):
  // in K and in buffer 0 of Q; V, dO and Q's buffer 1 lie whole lines further. A warp's column
  // offset is a multiple of its span (a power of two, or of 8 chunks), so that no step carries in
  // the swizzle. Padded, the reads take pointers (the same addresses formed this way measured
  // 2-4% slower at dim 64: ptxas schedules the loop differently).
  using TA = typename W::TA;
  static_assert(!kSw || ((kKA % 8 == 0 || (kKA & (kKA - 1)) == 0) && (kQA % 8 == 0 || (kQA & (kQA - 1)) == 0)),
                "a warp's chunk span in dK / dV and dQ is a power of two or whole lines");
  constexpr uint32_t kBufBytes = W::kBufBytes;
  uint32_t q_of_s = 0, k_of_s = 0, q_of_dk = 0, k_of_dq = 0;
  if constexpr (kSw) {
    const auto rows_first = M::rows_first(lane), chunks_first = M::chunks_first(lane);
    q_of_s = TA::base(sQ, s_row + rows_first.row, rows_first.chunk);       // S, dP: A
    k_of_s = TA::base(sK, s_key + chunks_first.row, chunks_first.chunk);   // S, dP: B
    q_of_dk = TA::base(sQ, rows_first.row, k_col / 8 + rows_first.chunk);  // dK, dV: B
    k_of_dq = TA::base(sK, rows_first.row, q_col / 8 + rows_first.chunk);  // dQ: B
  }

  // P and dS: a buffer's dS lies kDsBytes after its P, the next buffer kPBufBytes further
  // (Bwd2dShape). Swizzled (kOneSync), the lanes' addresses as for K / V / Q / dO: rows of kBN
  // elements.
  using TP = typename W::TP;
  constexpr uint32_t kPBufBytes = W::kPBufBytes;
  uint32_t p_of_dk = 0, ds_of_dq = 0;
  if constexpr (Cfg::kSwizzleP) {
    const auto rows_first = M::rows_first(lane), chunks_first = M::chunks_first(lane);
    p_of_dk = TP::base(sP, chunks_first.row, k_key / 8 + chunks_first.chunk);  // dK, dV: A (transposed)
    ds_of_dq = TP::base(sdS, q_row + rows_first.row, rows_first.chunk);         // dQ: A
  }
  int pbuf = 0;  // this tile's P / dS buffer

  typename W::DkDv dk, dv;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int d = 0; d < kKA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[i][d][e] = dv[i][d][e] = Acc(0);

  constexpr QueryBuffers kBuffers =
      Cfg::kRing3 ? QueryBuffers::kRingOfThree : Cfg::kTracked ? QueryBuffers::kTwoTracked : QueryBuffers::kTwo;
  walk_query_tiles<kBM, kBuffers>(sq, n0, rows_k, hk * group, group, load, [&](int64_t h, int64_t m0, int buf, auto start_next) {
    // The tile's buffers: swizzled operands through the lanes' addresses, padded ones through
    // pointers (each step reads the ones of its variant).
    const uint32_t q_buf_s = q_of_s + buf * kBufBytes, q_buf_dk = q_of_dk + buf * kBufBytes;
    const Elem* q_s = sQ + buf * kBM * kLd;
    const Elem* do_s = sdO + buf * kBM * kLd;
    const Acc* stats_s = sStats + Stats::lse(buf, s_row) + 4 * g;  // SlabStats: row group 0's chunk
    const Acc* lse_s = sStats + Stats::lse(buf, 0);                 // RowStats
    const Acc* d_s = sStats + Stats::d(buf, 0);
    const uint32_t p_buf_bytes = pbuf * kPBufBytes;  // this tile's P / dS buffer, from buffer 0
    Elem* p_s = sP + pbuf * 2 * kBM * kLdP;
    Elem* ds_s = sdS + pbuf * 2 * kBM * kLdP;

    typename W::SdP s, dp;
    scores_and_dp<W>(s, dp, q_buf_s, k_of_s, q_s, do_s, sK, sV, s_row, s_key, lane);

    // P and dS (probs_and_ds), instantiated for tiles every row sees in full and for masked ones,
    // and per bias element type: the common case carries no test.
    const bool all_visible = n0 >= sq.key_begin(m0 + kBM - 1) && n0 + kBN <= sq.key_end(m0);
    auto probs = [&](auto masked_tag, auto reader) {
      probs_and_ds<W, decltype(masked_tag)::value>(s, dp, reader, sq, m0, n0, stats_s, lse_s, d_s,
                                                   sBias + buf * bias_tile.buffer_bytes(), bias_tile, score_scale,
                                                   s_row, s_key, g, t);
    };
    auto probs_of_tile = [&](auto masked_tag) {
      if constexpr (kFeatures)
        with_bias_reader<Elem>(p.bias_kind, p.bias_dtype, [&](auto reader) { probs(masked_tag, reader); });
      else
        probs(masked_tag, NoBias{});
    };
    if (all_visible) probs_of_tile(std::false_type{});
    else probs_of_tile(std::true_type{});
    store_p_ds<W>(s, dp, sP, p_s, ds_s, p_buf_bytes, s_row, s_key, lane, g, t);
    // P, dS of the whole tile in smem for all. The next query tile's copies start here rather than
    // at the top of the iteration: there they followed the previous tile's dQ atomics (ncu at dim
    // 256: lg-throttle stalls, none in FlashAttention-2's kernel). H200, bf16: backward +0.3..+1.3%
    // at dims 64 / 128 / 256; started after the S / dP products instead, -1..+0.8%. With kOneSync
    // this is the tile's one barrier (in start_next() with the ring of three: walk_query_tiles).
    if constexpr (!Cfg::kRing3) __syncthreads();
    start_next();

    add_dkdv<W>(dk, dv, p_of_dk, p_buf_bytes, p_s, ds_s, q_buf_dk, q_s, do_s, k_key, k_col, lane);

    // dQ += dS K for the warp's kBM / kQRW rows x kDim / kQCW dims, added into the accumulator.
    // (accum.base is never null; without the test, ptxas allocates the dim-256 feature variant
    // with 112 bytes of spills instead of none.)
    if (accum.base != nullptr) {
      Acc dq[W::kRQ][kQA][4];
      dq_products<W>(dq, ds_of_dq, p_buf_bytes, ds_s, k_of_dq, sK, q_row, q_col, lane);
      const int64_t tile_row = sq.row_index(p.heads_q, h, m0);
      const int rows_valid = sq.q_tile_rows(m0, kBM);
      add_dq_atoms(accum.block_slice<float>(round.groups), tile_row, dq, q_row, q_col, rows_valid, E, lane);
    }
    if constexpr (kPBufs == 2) pbuf ^= 1;
  }, sLanded, seg.first, seg.count);

  // The lane's dK (scaled) and dV pairs: into the tail area, or stored.
  const Acc scale = Acc(p.scale);
  auto each_pair = [&](auto put_k, auto put_v) {
    each_dkdv_pair<W>(dk, dv, scale, rows_k, k_key, k_col, g, t, E, Ev, put_k, put_v);
  };
  if (kSplit && seg.tail >= 0) {  // a part of a split walk: added into the tail area
    float* dk_t = round.tail.dkdv + int64_t(seg.tail) * kBN * (E + Ev);
    float* dv_t = dk_t + kBN * E;
    each_pair([&](int key, int col, Acc x, Acc y) { atomic_add_pair(dk_t + key * E + col, x, y); },
              [&](int key, int col, Acc x, Acc y) { atomic_add_pair(dv_t + key * Ev + col, x, y); });
    return;
  }
  Elem* dk_g = sq.k_rows<Elem>(p.dk, p.dk_stride, hk, 0);
  Elem* dv_g = sq.k_rows<Elem>(p.dv, p.dv_stride, hk, 0);
  each_pair([&](int key, int col, Acc x, Acc y) { M::store_pair(dk_g + (n0 + key) * p.dk_stride.row + col, x, y); },
            [&](int key, int col, Acc x, Acc y) { M::store_pair(dv_g + (n0 + key) * p.dv_stride.row + col, x, y); });
}

// Launches the 2-D kernel in the form the plan chose (kSm80TwoBlocks, kSm80OneSync, kSm80TwoDim);
// false where this tier has no such form.
template <class Elem, int kDim>
bool launch_dkdv_2d(const BwdParams& p, BwdKernel form, const void* dsum, const DqAccum& accum, const DkDvTail& tail,
                    cudaStream_t stream) {
  using Cfg = Bwd2dConfig<Elem, kDim>;
  using OneSyncCfg = Bwd2dConfig<Elem, kDim, /*kOneSync=*/true>;
  using TwoBlocksCfg = Bwd2dConfig<Elem, kDim, /*kOneSync=*/false, /*kTwoBlocks=*/true>;
  if constexpr (!Cfg::kServed) {
    return false;
  } else {
    // The kernel with config C's blocks (key tiles and threads).
    auto launch = [&](auto kernel, auto config, size_t smem) {
      using C = decltype(config);
      set_smem(kernel, smem, "sm80::bwd_dkdv_2d_kernel");
      for_key_tile_rounds(p, C::kBN, accum, [&](unsigned blocks, KeyTileRound round) {
        launch_with_tail_split<C, Elem>(kernel, smem, p, static_cast<const float*>(dsum), accum, tail, blocks, round,
                                        stream, "sm80::bwd_dkdv_2d_kernel");
      });
      return true;
    };
    if (form == BwdKernel::kSm80TwoBlocks) {
      if constexpr (TwoBlocksCfg::kServed)
        return launch(bwd_dkdv_2d_kernel<Elem, kDim, false, false, true>, TwoBlocksCfg{}, TwoBlocksCfg::kSmemBytes);
      return false;
    }
    if (form == BwdKernel::kSm80OneSync) {
      if constexpr (OneSyncCfg::kServed)
        return launch(bwd_dkdv_2d_kernel<Elem, kDim, false, true>, OneSyncCfg{}, OneSyncCfg::kSmemBytes);
      return false;
    }
    if (form != BwdKernel::kSm80TwoDim) return false;
    const size_t smem = Cfg::kSmemBytes + 2 * size_t(bias_tile_layout<Cfg::kBM, Cfg::kBN>(p).buffer_bytes());
    if (p.has_features()) return launch(bwd_dkdv_2d_kernel<Elem, kDim, true, false>, Cfg{}, smem);
    // Plain calls: where a GPU can run this form (bwd_forms.h).
    if constexpr (bwd_2d_plain_compiled<Elem, kDim>()) return launch(bwd_dkdv_2d_kernel<Elem, kDim, false, false>, Cfg{}, smem);
    return false;
  }
}

}  // namespace flashattn::cuda::sm80
