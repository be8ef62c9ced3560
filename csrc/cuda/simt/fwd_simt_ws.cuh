// fp32 forward with the two products on different warps (sm_80+), so that the FMA pipe (scores)
// and the tensor pipe (P V) work at the same time. In the Q-resident kernel (fwd_simt_qres.cuh)
// every warp forms scores, then every warp forms P V, barrier to barrier, and each pipe idles
// while the other one works.
//
// One block of 384 threads per (batch, query head) and one or two 128-row query tiles (see the
// kernel), 64-key tiles:
// - warps 0-3, the score warps: thread (r, c) = (tid / 8, tid % 8) owns query rows r + 16i and
//   keys c + 8j (i, j < 8) of S = Q K^T, formed with FMAs (the accuracy fp32 logits need, see
//   pv_tf32x3.cuh), masks and scales them, runs the online softmax (a row's statistics over the 8
//   lanes that share it) and hands P and the rows' rescale factors to the P V warps in smem. They
//   load Q and K (one K buffer: the next tile loads while they turn the scores into P).
// - warps 4-11, the P V warps: O += P V as three TF32 products (pv_tf32x3.cuh, 4 x 2 warps of 32
//   rows x kDim / 2 columns), V split into its TF32 halves as its fragments are read. They load V
//   (two buffers).
// Hand-over per tile through two mbarriers: p_full (the score warps arrive once P and alpha of a
// tile are in smem; the P V warps wait for it) and p_free (the P V warps arrive once they have read
// them; the score warps wait for it before writing the next). The score warps compute the next
// tile's scores while the P V warps multiply the current one.
#pragma once
#include <cstdint>

#include "../../common/sequence.h"
#include "../common/barrier.cuh"
#include "../common/check.h"
#include "../common/grid.cuh"
#include "../common/online_softmax.cuh"
#include "../common/opaque.cuh"
#include "launch.h"
#include "pv_tf32x3.cuh"
#include "resident_config.h"
#include "scale_scores.cuh"
#include "tile_gemm.cuh"
#include "tile_load_x4.cuh"

namespace flashattn::cuda::simt {

// Named barriers within one role: among the score warps, among the P V warps.
enum WsBarrier : int { kBarScore = 1, kBarPv = 2 };

template <int kDim>
__global__ void __launch_bounds__(WsTraits<kDim>::kThreads, 1)
    fwd_ws_kernel(const FwdParams p, int num_m_tiles, bool paired, bool vec) {
  using Tr = WsTraits<kDim>;
  using Exp = ExpDomain<float>;
  using Pv = PvTf32x3<Tr::kBlockN, kDim, Tr::kLd, Tr::kLdP>;
  constexpr int kBM = Tr::kBlockM, kBN = Tr::kBlockN, kTM = Tr::kTM, kTN = Tr::kTN, kScoreUnroll = Tr::kScoreUnroll;
  constexpr int kLd = Tr::kLd, kLdP = Tr::kLdP, kNS = Tr::kScoreThreads, kNP = Tr::kPvThreads;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);
  float* sK = sQ + kBM * kLd;
  float* sV = sK + kBN * kLd;  // two buffers
  float* sP = sV + 2 * kBN * kLd;
  float* sRow = sP + kBM * kLdP;  // alpha per row, then 1 / l
  uint64_t* p_full = reinterpret_cast<uint64_t*>(sRow + kBM);  // (8-byte aligned: kBM is even)
  uint64_t* p_free = p_full + 1;
  if (threadIdx.x == 0) {
    mbar_init(p_full, kNS);
    mbar_init(p_free, kNP);
  }
  __syncthreads();  // the mbarriers initialised for all

  // The block's query tiles: with `paired`, the pair (num_m_tiles - 1 - j, j), heavier first, or
  // the middle tile alone; the score warps start the second tile while the P V warps finish the
  // first, so a block fills and drains the two-role pipeline once per pair (and under causal
  // masking every pair sees the same number of keys). Else tile num_m_tiles - 1 - j, heaviest
  // first (grids too small to pair without idling SMs).
  const int num_slots = paired ? (num_m_tiles + 1) / 2 : num_m_tiles;
  const TileBlock blk = tile_block(num_slots, 1, p.heads_q, /*heaviest_first=*/false);
  const int64_t h = blk.head, b = blk.batch, hk = kv_head(p, h);
  const int num_items = paired && 2 * blk.tile + 1 != num_m_tiles ? 2 : 1;
  auto item_m0 = [&](int item) { return int64_t(item == 0 ? num_m_tiles - 1 - blk.tile : blk.tile) * kBM; };
  const Seq sq = plain_sequence(p, b);  // this kernel serves calls without optional features
  auto item_n_end = [&](int64_t m0) { return sq.key_end((p.len_q - m0 < kBM ? p.len_q : m0 + kBM) - 1); };
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  // Where the tile's first kBM / 2 rows see no key of a key tile (the second of the causal
  // diagonal's two), their scores and their P V warps' products are skipped (the mask makes those
  // scores -inf, so P is 0 and alpha 1 there).
  auto first_half_blind = [&](int64_t m0, int64_t n0) { return n0 >= sq.key_end(m0 + kBM / 2 - 1); };
  // Both roles count the hand-overs (a key tile's P, or a query tile's 1 / l) in `phase`: the
  // mbarriers' phase parity, and (P V warps) which V buffer a key tile takes.
  int phase = 0;

  if (threadIdx.x < kNS) {
    // ---- score warps ----
    const int tid = threadIdx.x, r = tid >> 3, c = tid & 7;
    const float score_scale = Exp::score_scale(p.scale);
    const float* k = sq.k_rows<const float>(p.k, p.k_stride, hk, 0);
    float* lse = static_cast<float*>(p.lse) + (b * p.heads_q + h) * p.len_q;
#pragma unroll 1
    for (int item = 0; item < num_items; ++item) {
      const int64_t m0 = item_m0(item), n_end = item_n_end(m0);
      const int64_t k_row = opaque(p.k_stride.row);
      auto load_k = [&](int64_t n0) {
        const int rows_k = int(p.len_k - n0 < kBN ? p.len_k - n0 : kBN);
        load_tile_x4<kBN, kDim, kNS>(sK, kLd, k + n0 * k_row, k_row, rows_k, E, vec, tid);
        cp_async_commit();
      };
      // (sQ and sK are free: every score warp has passed the barrier after the previous tile's product)
      if (n_end > 0) {
        const int rows_q = int(p.len_q - m0 < kBM ? p.len_q - m0 : kBM);
        load_tile_x4<kBM, kDim, kNS>(sQ, kLd, sq.q_rows<const float>(p.q, p.q_stride, h, m0),
                                     opaque(p.q_stride.row), rows_q, E, vec, tid);
        load_k(0);
      }
      float row_max[kTM], row_sum[kTM];
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
        row_max[i] = neg_inf<float>();
        row_sum[i] = 0.f;
      }
      for (int64_t n0 = 0; n0 < n_end; n0 += kBN) {
        cp_async_wait<0>();
        bar_sync(kBarScore, kNS);  // Q and this K visible to the score warps
        float s[kTM][kTN];
#pragma unroll
        for (int i = 0; i < kTM; ++i)
#pragma unroll
          for (int j = 0; j < kTN; ++j) s[i][j] = 0.f;
        if (first_half_blind(m0, n0))
          gemm_rows_x_rows_interleaved<kTM, kTN, kLd, 16, kDim, kTM / 2, kTM, 8, kScoreUnroll>(s, sQ, sK, r, c);
        else
          gemm_rows_x_rows_interleaved<kTM, kTN, kLd, 16, kDim, 0, kTM, 8, kScoreUnroll>(s, sQ, sK, r, c);
        bar_sync(kBarScore, kNS);  // sK (and after the last key tile sQ) free
        if (n0 + kBN < n_end) load_k(n0 + kBN);

        scale_scores<16, 8, kBN>(s, score_scale, p, sq, m0, n0, r, c);
        float alpha[kTM];
#pragma unroll
        for (int i = 0; i < kTM; ++i) alpha[i] = online_softmax_step<8>(s[i], row_max[i], row_sum[i]);

        if (phase > 0) mbar_wait(p_free, (phase - 1) & 1);  // the P V warps are done with the previous hand-over
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          if (c == 0) sRow[r + 16 * i] = alpha[i];
#pragma unroll
          for (int j = 0; j < kTN; ++j) sP[(r + 16 * i) * kLdP + c + 8 * j] = s[i][j];
        }
        mbar_arrive(p_full);
        ++phase;
      }

      float l[kTM];
#pragma unroll
      for (int i = 0; i < kTM; ++i) l[i] = reduce_sum_lanes<8>(row_sum[i]);
      if (phase > 0) mbar_wait(p_free, (phase - 1) & 1);  // the last P V product has read the alphas
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
        // l == 0 only when no key is visible: out = 0, lse = -inf. A NaN l propagates.
        const bool empty = l[i] == 0.f;
        const int64_t m = m0 + r + 16 * i;
        if (c == 0) sRow[r + 16 * i] = empty ? 0.f : 1.f / l[i];
        if (c == 0 && m < p.len_q) lse[m] = empty ? neg_inf<float>() : Exp::lse(row_max[i], l[i]);
      }
      mbar_arrive(p_full);
      ++phase;
    }
  } else {
    // ---- P V warps ----
    const int tid = threadIdx.x - kNS, warp = tid >> 5, lane = tid & 31;
    const float* v = sq.k_rows<const float>(p.v, p.v_stride, hk, 0);
#pragma unroll 1
    for (int item = 0; item < num_items; ++item) {
      const int64_t m0 = item_m0(item), n_end = item_n_end(m0);
      // Key tiles as int counts (64-bit ones held across the loop made ptxas spill O).
      const int num_n_tiles = int((n_end + kBN - 1) / kBN);
      const int blind_from = int((sq.key_end(m0 + kBM / 2 - 1) + kBN - 1) / kBN);  // first_half_blind
      const int64_t v_row = opaque(p.v_stride.row);
      auto load_v = [&](int tile, float* dst) {
        if (tile < num_n_tiles) {
          const int64_t n0 = int64_t(tile) * kBN;
          const int rows_k = int(p.len_k - n0 < kBN ? p.len_k - n0 : kBN);
          load_tile_x4<kBN, kDim, kNP>(dst, kLd, v + n0 * v_row, v_row, rows_k, Ev, vec, tid);
        }
        cp_async_commit();  // (empty past the last tile, so that one group per tile is always in flight)
      };
      // (both buffers are free: every P V warp has passed the barrier after the previous key tile)
      load_v(0, sV + (phase & 1) * kBN * kLd);
      load_v(1, sV + (~phase & 1) * kBN * kLd);
      float o[2][Pv::kNA][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < Pv::kNA; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[i][n][e] = 0.f;
      for (int tile = 0; tile < num_n_tiles; ++tile, ++phase) {
        float* vt = sV + (phase & 1) * kBN * kLd;
        cp_async_wait<1>();
        // A tile with a V element that is not finite, or that rounds to inf, takes the exact fp32
        // product (pv_tf32x3.cuh); each thread checks the part it copied, the barrier (which also
        // makes this V visible to the P V warps) ORs them.
        const bool exact = bar_sync_or(kBarPv, kNP, copied_part_not_splittable<kBN, kDim, kNP>(vt, kLd, tid));
        mbar_wait(p_full, phase & 1);  // this P and alpha written
        if (tile < blind_from || Pv::row0(warp) >= kBM / 2) Pv::template run<true>(o, sP, vt, vt, sRow, exact, warp, lane);
        mbar_arrive(p_free);
        bar_sync(kBarPv, kNP);  // every P V warp is done with this V buffer
        load_v(tile + 2, vt);
      }
      mbar_wait(p_full, phase & 1);  // 1 / l of every row in sRow
      const int g = lane >> 2;
      float inv[2][2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) inv[i][half] = sRow[Pv::row0(warp) + 16 * i + g + 8 * half];
      mbar_arrive(p_free);  // sRow free for the next query tile's alphas
      ++phase;
      Pv::store(o, [&](int i, int half, int) { return inv[i][half]; }, sq.q_rows<float>(p.out, p.out_stride, h, m0),
                p.out_stride.row, p.len_q - m0, Ev, warp, lane);
    }
  }
}

// fp32, head dims up to kDim, sm_80+ with 202 KB of smem per block (sm_90, sm_100; not sm_80's
// 163 KB); false, launching nothing, otherwise.
template <int kDim>
bool launch_fwd_ws(const FwdParams& p, cudaStream_t stream) {
  using Tr = WsTraits<kDim>;
  if (p.has_features() || device_limits().major < 8 || Tr::kSmemBytes > device_limits().smem_optin) return false;
  const int64_t num_m_tiles = (p.len_q + Tr::kBlockM - 1) / Tr::kBlockM;
  // Pairs of query tiles per block where there are blocks for at least two waves even so.
  const bool paired = num_m_tiles * p.heads_q * p.batch >= 4 * int64_t(device_limits().sms);
  const int64_t blocks = (paired ? (num_m_tiles + 1) / 2 : num_m_tiles) * p.heads_q * p.batch;
  if (grid_too_large(blocks, "fwd_simt_ws_kernel")) return true;
  const bool vec = rows_aligned_x4<float>(p.q, p.q_stride.batch, p.q_stride.head, p.q_stride.row) &&
                   rows_aligned_x4<float>(p.k, p.k_stride.batch, p.k_stride.head, p.k_stride.row) &&
                   rows_aligned_x4<float>(p.v, p.v_stride.batch, p.v_stride.head, p.v_stride.row);
  auto kernel = fwd_ws_kernel<kDim>;
  set_smem(kernel, Tr::kSmemBytes, "fwd_ws_kernel");
  kernel<<<unsigned(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, int(num_m_tiles), paired, vec);
  check_launch("fwd_ws_kernel");
  return true;
}

}  // namespace flashattn::cuda::simt
