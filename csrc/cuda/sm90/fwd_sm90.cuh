// Forward on Hopper's warpgroup products (wgmma, sm_90a): plain fp16 / bf16 calls at head dim 256 and
// causal ones at 128 (head_dim == head_dim_v == kDim, no optional feature, long walks: fwd_sm90.cu's
// dispatch; every other call goes to the sm80/ kernels, which run on sm_90 too). Dim 64 and
// non-causal dim 128: the warp-specialized kernel (fwd_ws_sm90.cuh).
//
// One block per (batch, query head, 128-row query tile), the last tiles first (a causal grid's
// last heads tile slowest, as schedule/causal_order.cuh). Two warpgroups of 4 warps, each owning 64
// query rows; both read the same K and V tiles of kBN keys. S = Q K^T and O += P V are wgmma
// products (Q, K, V from 128-byte-swizzled smem, P from registers), asynchronous: a warpgroup
// issues S of key tile i + 1 and P V of tile i together, and runs the softmax of tile i + 1 while
// P V runs (FlashAttention-3's intra-warpgroup overlap). K and V stream through two stages each
// (cp.async by all threads), K two tiles ahead of the softmax and V one. O leaves through smem in
// 16-byte stores. The rows' state and steps: fwd_rows.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/check.h"
#include "../common/cp_async.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "../common/numeric.cuh"
#include "../common/wgmma.cuh"
#include "../schedule/causal_order.cuh"
#include "fwd_rows.cuh"
#include "launch.h"
#include "tile_config.h"

namespace flashattn::cuda::sm90 {

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kRows rows in the panel layout
// (common/wgmma.cuh): panel chunk / 8, its line `row`, swizzled by row % 8.
template <int kRows>
__device__ __forceinline__ int panel_offset(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
}

// Copies rows [0, rows) of a kRows x kDim tile (rows g_ld elements apart) into smem at `dst` in the
// panel layout, rows from `rows` on zero-filled (their source ignored). A thread takes one chunk
// column and every (kThreads / chunks-per-row)-th row: its rows agree modulo 8, so the swizzled
// offset is one constant.
template <int kRows, int kDim, int kThreads, class Elem>
__device__ __forceinline__ void copy_panels(unsigned char* dst, const Elem* g, int64_t g_ld, int rows, int tid) {
  constexpr int kPerRow = kDim / 8, kRowStep = kThreads / kPerRow;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "a thread's rows agree modulo 8");
  const int r0 = tid / kPerRow, c = tid % kPerRow;
  unsigned char* d = dst + panel_offset<kRows>(r0, c);
  const Elem* src = g + r0 * g_ld + c * 8;
#pragma unroll
  for (int it = 0; it < kRows / kRowStep; ++it) {
    const bool valid = r0 + it * kRowStep < rows;
    cp_async_16_zfill(d + it * kRowStep * 128, valid ? src + it * kRowStep * g_ld : g, valid);
  }
}

template <class Elem, int kDim>
__global__ void __launch_bounds__(FwdWgmmaConfig<Elem, kDim>::kThreads)
    fwd_wgmma_kernel(const FwdParams p, int num_m_tiles, HeavyLast order) {
#ifdef FLASHATTN_WGMMA
  using Cfg = FwdWgmmaConfig<Elem, kDim>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kThreads = Cfg::kThreads;
  using Rows = FwdRows<Elem, kDim, kBN, kBM>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const tiles = align_1024(smem_raw);
  unsigned char* const sQ = tiles;
  auto sK = [&](int stage) { return tiles + Cfg::kQBytes + stage * Cfg::kKvBytes; };
  auto sV = [&](int stage) { return tiles + Cfg::kQBytes + (2 + stage) * Cfg::kKvBytes; };

  const FwdTile<kBM, kBN> tile(p, num_m_tiles, order);
  const Seq& sq = tile.sq;
  const int64_t h = tile.h, hk = tile.hk, m0 = tile.m0, m_last = tile.m_last, n_begin = tile.n_begin;
  const int rows = tile.rows, n_tiles = tile.n_tiles;

  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31, warp = (tid / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const int wrow = wg * 64 + warp * 16;  // the warp's first row in the tile

  const Elem* k = sq.k_rows<const Elem>(p.k, p.k_stride, hk, 0);
  const Elem* v = sq.k_rows<const Elem>(p.v, p.v_stride, hk, 0);
  auto key_rows = [&](int i) { return sq.k_tile_rows(n_begin + int64_t(i) * kBN, kBN); };
  auto load_k = [&](int i) {
    copy_panels<kBN, kDim, kThreads>(sK(i % 2), k + (n_begin + int64_t(i) * kBN) * p.k_stride.row, p.k_stride.row,
                                     key_rows(i), tid);
  };
  auto load_v = [&](int i) {
    copy_panels<kBN, kDim, kThreads>(sV(i % 2), v + (n_begin + int64_t(i) * kBN) * p.v_stride.row, p.v_stride.row,
                                     key_rows(i), tid);
  };

  const uint32_t q_at = smem_addr(sQ) + wg * 64 * 128;  // this warpgroup's Q rows
  Rows w;
  const float score_scale = Exp::score_scale(p.scale);
  auto issue_scores = [&](typename Rows::Scores& s, int i) { Rows::issue_scores(s, q_at, smem_addr(sK(i % 2))); };
  auto issue_pv = [&](const typename Rows::Probs& pa, int i) { w.issue_pv(pa, smem_addr(sV(i % 2))); };
  auto softmax = [&](typename Rows::Scores& s, int i, float (&alpha)[2]) {
    w.softmax(s, sq, m0, m_last, m0 + wrow + g, n_begin + int64_t(i) * kBN, t, score_scale, alpha);
  };

  // Copies: Q and K 0, then K 1 and V 0; then (after S 0) K 2 and V 1; the walk then loads K i + 3
  // and V i + 2 at the end of iteration i, into the stages that S i + 1 and P V i have left.
  if (n_tiles > 0) {
    copy_panels<kBM, kDim, kThreads>(sQ, sq.q_rows<const Elem>(p.q, p.q_stride, h, m0), p.q_stride.row, rows, tid);
    load_k(0);
  }
  cp_async_commit();
  if (n_tiles > 1) load_k(1);
  if (n_tiles > 0) load_v(0);
  cp_async_commit();

  // The copies committed before the last group landed, fenced for the async proxy, for all threads.
  auto landed = [] {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
  };
  typename Rows::Probs pa;
  float alpha[2] = {1.f, 1.f};  // rescales O before the next P V
  if (n_tiles > 0) {
    landed();  // Q and K 0
    typename Rows::Scores s;
    wgmma_fence();
    issue_scores(s, 0);
    wgmma_wait<0>();
    pin(s);
    softmax(s, 0, alpha);
    Rows::pack_p(s, pa);
  }
  __syncthreads();  // every warpgroup is done with K 0
  if (n_tiles > 2) load_k(2);
  if (n_tiles > 1) load_v(1);
  cp_async_commit();

  // Iteration i: S of tile i + 1 issued, O rescaled, P V of tile i issued; the softmax of tile i + 1
  // runs while they do, and P is packed once P V is done with its registers (FlashAttention-3's
  // order: no register of an in-flight product is written). The last tile has P V only.
  for (int i = 0; i + 1 < n_tiles; ++i) {
    landed();  // K i + 1 and V i
    typename Rows::Scores s;
    wgmma_fence();
    issue_scores(s, i + 1);
    w.rescale_o(alpha);
    pin(w.o);
    wgmma_fence();
    issue_pv(pa, i);
    wgmma_wait<1>();  // S i + 1 (P V i may still run)
    pin(s);
    softmax(s, i + 1, alpha);
    wgmma_wait<0>();
    pin(w.o);
    pin(pa);
    Rows::pack_p(s, pa);
    __syncthreads();  // every warpgroup is done with K i + 1 and V i
    if (i + 3 < n_tiles) load_k(i + 3);
    if (i + 2 < n_tiles) load_v(i + 2);
    cp_async_commit();
  }
  if (n_tiles > 0) {
    landed();  // V of the last tile
    w.rescale_o(alpha);
    pin(w.o);
    wgmma_fence();
    issue_pv(pa, n_tiles - 1);
    wgmma_wait<0>();
    pin(w.o);
  }

  w.store(sQ, p, Rows::dest(p, tile), wrow, lane);
#endif
}

}  // namespace flashattn::cuda::sm90
