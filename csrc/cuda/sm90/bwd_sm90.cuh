// dK/dV kernel (with the atomic dQ) on Hopper's warpgroup products (wgmma, sm_90a): plain fp16 / bf16
// calls at head dims 64 and 128 (head_dim == head_dim_v == kDim, no optional feature). The walk is the sm80/
// kernels' (query_walk.cuh): one block per (batch, kv head, key tile of kBN = 128 keys) visits every
// query tile of kBM = 64 rows that sees one of its keys, over the kv head's query heads. Two
// warpgroups, each owning 64 of the block's keys:
//   S^T = K Q^T, dP^T = V dO^T   wgmma m64n64 (K / V rows of the warpgroup x the tile's rows), smem
//   P^T, dS^T = P^T (dP^T - D)   in registers (LSE and D per column, from smem)
//   dV += P^T dO, dK += dS^T Q   wgmma m64n128, P^T / dS^T from registers, dO / Q MN-major from smem
//   dQ += dS K                   dS^T through smem; wgmma m64n64 per warpgroup (its half of the
//                                dims), A and B MN-major; added with atomics (dq_atomics.cuh)
// P and dS round to Elem before the products, as in the sm80/ kernels.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dq_atomics.cuh"
#include "../schedule/causal_order.cuh"
#include "../schedule/key_tile_rounds.h"
#include "../schedule/query_walk.cuh"
#include "fwd_sm90.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm90 {

template <class Elem, int kDim>
__global__ void __launch_bounds__(BwdWgmmaConfig<Elem, kDim>::kThreads, 1)
    bwd_wgmma_kernel(const BwdParams p, const float* dsum_g, const DqAccum accum, KeyTileRound round) {
#ifdef FLASHATTN_WGMMA
  using Cfg = BwdWgmmaConfig<Elem, kDim>;
  using M = Mma<Elem>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kThreads = Cfg::kThreads;
  constexpr int kRA = kBM / 8, kDA = kDim / 8;  // S^T / dP^T atoms (over the rows), dK / dV atoms

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const tiles = align_1024(smem_raw);
  unsigned char* const sK = tiles;
  unsigned char* const sV = tiles + Cfg::kKvBytes;
  auto sQ = [&](int buf) { return tiles + 2 * Cfg::kKvBytes + buf * Cfg::kQBytes; };
  auto sdO = [&](int buf) { return tiles + 2 * Cfg::kKvBytes + (2 + buf) * Cfg::kQBytes; };
  unsigned char* const sdS = tiles + 2 * Cfg::kKvBytes + 4 * Cfg::kQBytes;  // dS^T: kBN lines of kBM rows
  float* const sStats = reinterpret_cast<float*>(tiles + Cfg::kStatsOffset);  // [buf][LSE, D][kBM]

  // A causal grid's last pairs tile slowest, heaviest first (schedule/causal_order.cuh; never with the
  // deterministic accumulators, whose slice follows blockIdx.x).
  const unsigned block =
      blockIdx.x >= round.heavy.start ? heavy_last_block(round.heavy, round.groups, blockIdx.x) : blockIdx.x;
  const TileBlock blk = tile_block(round.groups, 1, p.heads_kv, /*heaviest_first=*/false, block);
  const int64_t hk = blk.head, b = blk.batch, group = p.heads_q / p.heads_kv;
  const Seq sq = plain_sequence(p, b);
  const int64_t n0 = int64_t(round.first + blk.tile) * kBN;
  if (n0 >= sq.len_k) return;
  const int rows_k = sq.k_tile_rows(n0, kBN);
  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31, warp = (tid / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const int wkey = wg * 64 + warp * 16;  // the warp's first key in the tile
  const float score_scale = Exp::score_scale(p.scale);

  copy_panels<kBN, kDim, kThreads>(sK, sq.k_rows<const Elem>(p.k, p.k_stride, hk, n0), p.k_stride.row, rows_k, tid);
  copy_panels<kBN, kDim, kThreads>(sV, sq.k_rows<const Elem>(p.v, p.v_stride, hk, n0), p.v_stride.row, rows_k, tid);
  // A query tile's Q and dO rows (past the sequence zero, with LSE = D = 0: P = 1, dP = dS = 0, so
  // they add nothing) and its LSE and D.
  auto load = [&](int64_t h, int64_t m0, int buf) {
    const int rows = sq.q_tile_rows(m0, kBM);
    copy_panels<kBM, kDim, kThreads>(sQ(buf), sq.q_rows<const Elem>(p.q, p.q_stride, h, m0), p.q_stride.row, rows, tid);
    copy_panels<kBM, kDim, kThreads>(sdO(buf), sq.q_rows<const Elem>(p.dout, p.dout_stride, h, m0), p.dout_stride.row,
                                     rows, tid);
    const int64_t r0 = sq.row_index(p.heads_q, h, m0);
    if (tid < 2 * kBM) {
      const int m = tid % kBM;
      const float* src = (tid < kBM ? static_cast<const float*>(p.lse) : dsum_g) + r0 + m;
      cp_async_elem_zfill(sStats + buf * 2 * kBM + tid, src, m < rows);
    }
  };

  // Descriptors (common/wgmma.cuh): K-major operands step 32 bytes along the line per k16 step, a
  // panel of `lines` lines further every 4 steps; MN-major ones step 16 lines.
  auto kmajor = [](uint32_t at, int kk, int lines) {
    return smem_desc(at + (kk / 4) * lines * 128 + (kk % 4) * 32, 16, 1024);
  };
  auto mnmajor = [](uint32_t at, int kk, int lines) { return smem_desc(at + kk * 16 * 128, lines * 128, 1024); };
  const uint32_t k_at = smem_addr(sK), v_at = smem_addr(sV), ds_at = smem_addr(sdS);

  float dk[kDA][4], dv[kDA][4];
#pragma unroll
  for (int d = 0; d < kDA; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;

  walk_query_tiles<kBM, QueryBuffers::kTwo, /*kAsyncProxy=*/true>(
      sq, n0, rows_k, hk * group, group, load, [&](int64_t h, int64_t m0, int buf, auto start_next) {
        const uint32_t q_at = smem_addr(sQ(buf)), do_at = smem_addr(sdO(buf));
        // S^T and dP^T of the warpgroup's 64 keys x the tile's rows.
        float st[kRA][4], dpt[kRA][4];
        wgmma_fence();
        Wgmma<Elem, kBM>::template ss<0>(st, kmajor(k_at + wg * 64 * 128, 0, kBN), kmajor(q_at, 0, kBM));
#pragma unroll
        for (int kk = 1; kk < kDim / 16; ++kk)
          Wgmma<Elem, kBM>::template ss<1>(st, kmajor(k_at + wg * 64 * 128, kk, kBN), kmajor(q_at, kk, kBM));
        Wgmma<Elem, kBM>::template ss<0>(dpt, kmajor(v_at + wg * 64 * 128, 0, kBN), kmajor(do_at, 0, kBM));
#pragma unroll
        for (int kk = 1; kk < kDim / 16; ++kk)
          Wgmma<Elem, kBM>::template ss<1>(dpt, kmajor(v_at + wg * 64 * 128, kk, kBN), kmajor(do_at, kk, kBM));
        wgmma_commit();
        start_next();  // the next tile's copies, into the other buffers
        wgmma_wait<0>();
        pin(st);
        pin(dpt);

        // P^T and dS^T; keys outside a row's band 0 (tested only where the tile is not all visible,
        // in 32-bit tile coordinates as the sm80/ kernels do).
        const float* lse_s = sStats + buf * 2 * kBM;
        const float* d_s = lse_s + kBM;
        const bool all_visible = n0 >= sq.key_begin(m0 + kBM - 1) && n0 + kBN <= sq.key_end(m0);
        auto clamp_base = [](int64_t x) { return int(x < -kBM - 1 ? -kBM - 1 : x > kBN + 1 ? kBN + 1 : x); };
        const int lo0 = clamp_base(m0 - n0 + sq.band.lo), hi0 = clamp_base(m0 - n0 + sq.band.hi);
        const int k_lim = clamp_base(sq.len_k - n0);
#pragma unroll
        for (int j = 0; j < kRA; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int row = 8 * j + 2 * t + c;
            // A row that sees no key (LSE -inf) takes +inf: its exponentials are then 0.
            const float lse_row = Exp::from_lse(lse_s[row]);
            const float lse = lse_row == neg_inf<float>() ? -neg_inf<float>() : lse_row;
            const float dsum = d_s[row];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int key = wkey + g + 8 * r, e = 2 * r + c;
              const float pr = Exp::exp(st[j][e] * score_scale - lse);
              const bool vis = all_visible || (key - row >= lo0 && key - row <= hi0 && key < k_lim);
              st[j][e] = vis ? pr : 0.f;
              dpt[j][e] = vis ? pr * (dpt[j][e] - dsum) : 0.f;
            }
          }
        }
        uint32_t pa[kBM / 16][4], dsa[kBM / 16][4];
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk) {
          typename M::A a;
          M::a_from_acc(a, &st[2 * kk]);
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[kk][e] = a.r[e];
          M::a_from_acc(a, &dpt[2 * kk]);
#pragma unroll
          for (int e = 0; e < 4; ++e) dsa[kk][e] = a.r[e];
        }

        // dV += P^T dO, dK += dS^T Q (dO and Q MN-major: rows along the lines' k).
        pin(dk);
        pin(dv);
        pin(pa);
        pin(dsa);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk) Wgmma<Elem, kDim>::rs(dv, pa[kk], mnmajor(do_at, kk, kBM));
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk) Wgmma<Elem, kDim>::rs(dk, dsa[kk], mnmajor(q_at, kk, kBM));
        wgmma_commit();

        // dS^T to smem (line = key, the tile's 64 rows along it: one 128-byte panel), for dQ.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key = wkey + g + 8 * r;
#pragma unroll
          for (int j = 0; j < kRA; ++j)
            *reinterpret_cast<uint32_t*>(sdS + key * 128 + ((j ^ (key % 8)) * 16) + 4 * t) =
                M::pack(dpt[j][2 * r], dpt[j][2 * r + 1]);
        }
        fence_proxy_async();
        wgmma_wait<0>();  // dV, dK (their P^T / dS^T registers are free for dQ)
        pin(dk);
        pin(dv);
        pin(pa);
        pin(dsa);
        __syncthreads();  // dS^T of both warpgroups in smem

        // dQ (the tile's rows x this warpgroup's half of the dims) = dS K: A = dS (rows along dS^T's
        // lines), B = K (dims along K's lines), both MN-major; K steps over the block's 128 keys. The
        // half starts kDim / 2 columns into K's lines: a panel further at dim 128, 64 bytes into the
        // line at dim 64.
        constexpr int kHalf = kDim / 2;
        const uint32_t k_half = k_at + (kDim == 128 ? wg * kBN * 128 : wg * kHalf * 2);
        float dq[1][kHalf / 8][4];
        wgmma_fence();
        Wgmma<Elem, kHalf>::template ss<0, 1, 1>(dq[0], mnmajor(ds_at, 0, kBN), mnmajor(k_half, 0, kBN));
#pragma unroll
        for (int kk = 1; kk < kBN / 16; ++kk)
          Wgmma<Elem, kHalf>::template ss<1, 1, 1>(dq[0], mnmajor(ds_at, kk, kBN), mnmajor(k_half, kk, kBN));
        wgmma_commit();
        wgmma_wait<0>();
        pin(dq[0]);
        const int64_t tile_row = sq.row_index(p.heads_q, h, m0);
        add_dq_atoms(accum.block_slice<float>(round.groups), tile_row, dq, warp * 16, wg * kHalf,
                           sq.q_tile_rows(m0, kBM), kDim, lane);
      });

  // dK (scaled) and dV of the warp's keys below rows_k.
  Elem* dk_g = sq.k_rows<Elem>(p.dk, p.dk_stride, hk, n0);
  Elem* dv_g = sq.k_rows<Elem>(p.dv, p.dv_stride, hk, n0);
  const float scale = float(p.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wkey + g + 8 * r;
    if (key >= rows_k) continue;
#pragma unroll
    for (int d = 0; d < kDA; ++d) {
      M::store_pair(dk_g + key * p.dk_stride.row + 8 * d + 2 * t, dk[d][2 * r] * scale, dk[d][2 * r + 1] * scale);
      M::store_pair(dv_g + key * p.dv_stride.row + 8 * d + 2 * t, dv[d][2 * r], dv[d][2 * r + 1]);
    }
  }
#endif
}

template <class Elem, int kDim>
bool bwd_wgmma(const BwdParams& p, const void* dsum, const DqAccum& accum, cudaStream_t stream) {
  using Cfg = BwdWgmmaConfig<Elem, kDim>;
  constexpr auto kernel = bwd_wgmma_kernel<Elem, kDim>;
  set_smem(kernel, Cfg::kSmemBytes, "sm90::bwd_wgmma_kernel");
  const int per_sm = heavy_last_serves(p) ? 1 : 0;  // one block of this kernel per SM
  for_key_tile_rounds(p, Cfg::kBN, accum, [&](unsigned blocks, KeyTileRound round) {
    round.heavy = plan_heavy_last(blocks, round.groups, per_sm);
    kernel<<<blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, static_cast<const float*>(dsum), accum, round);
    check_launch("sm90::bwd_wgmma_kernel");
  });
  return true;
}

}  // namespace flashattn::cuda::sm90
