// Warp-specialized dK/dV kernel (with dQ) on wgmma (sm_90a): fp16 / bf16 calls at head dims 64, 96, 128
// and 256 (head_dim == head_dim_v), plain or with a bias without its gradient (BiasForm), no other optional
// feature: with a key vector each consumer lane reads its two keys' bias values once (the block's keys are
// fixed); with bias rows (at 128 and 256) it loads its fragment's values per query tile while the tile's
// S^T product runs (key_bias.cuh: QueryTileWords); either adds their terms to the exponents of P^T.
// A block of three warpgroups owns a key tile of kBN = 128 keys and visits every query tile of kBM rows
// (128 at dim 64, 64 at 96 and 128) that sees one of its keys, over the kv head's query heads (the walk
// of the sm80/ kernels, query_walk.cuh):
//   warpgroup 0, warp 0   copies: K and V once, then per query tile Q and dO (TMA, one thread) and its
//                         LSE and D (loaded by the warp, the LSE stored in P^T's base-2 domain) into a
//                         two-stage ring of mbarriers;
//   warpgroup 0, warp 1   adds each finished dQ tile, staged in smem by the consumers, into the fp32
//                         accumulator with one bulk reduce-add (the TMA unit's atomics);
//   warpgroups 1 and 2    64 keys each:
//     S^T = K Q^T, dP^T = V dO^T   wgmma m64n(kBM), both from smem; the exponentials under dP^T
//     P^T, dS^T = P^T (dP^T - D)   in registers (LSE and D per column, from smem)
//     dV += P^T dO, dK += dS^T Q   wgmma m64n(E), P^T / dS^T from registers, dO / Q MN-major from smem
//                                  (kBM = 64: dV issued before dP^T's wait, the next tile's S^T after
//                                  dV / dK's, kOverlapped)
//     dQ = dS K                    dS^T of both through smem; wgmma m64n(E) over this warpgroup's 64 rows
//                                  (kBM = 128) or m64n(E/2) over its half of the dims, staged in smem
//                                  for the bulk add
// P and dS round to Elem before their products, as in the sm80/ kernels. Dim 256 (64-key blocks, the
// consumers splitting the dims): bwd_ws_split_consumer.
// The consumers take the producer's registers (setmaxnreg) and wait for each other only where dQ needs
// both halves of dS^T (a named barrier of their 256 threads; at dim 256 also where dV needs both halves
// of P^T); nobody issues a copy or an atomic but the producer warps. dQ tiles not 16-row aligned in the
// accumulator (lengths not a multiple of 16) are added with the consumers' atomics instead.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/barrier.cuh"
#include "../common/dq_atomics.cuh"
#include "../common/quad_transpose.cuh"
#include "../common/tma.cuh"
#include "../schedule/causal_order.cuh"
#include "../schedule/key_tile_rounds.h"
#include "fwd_rows.cuh"
#include "tile_config.h"
#include "tma_map.h"

namespace flashattn::cuda::sm90 {

// The query tiles a key tile [n0, n0 + rows_k) is seen by, in the order every warp of the block walks
// them: the rows of one head, then the next (query_walk.cuh's order).
struct QueryTileWalk {
  int64_t m_begin, m_end, iters, h, m0;
  __device__ QueryTileWalk(const Seq& sq, int64_t n0, int rows_k, int64_t h_first, int64_t group, int kBM) {
    m_begin = sq.row_begin(n0) / kBM * kBM;
    m_end = sq.row_end(n0 + rows_k - 1);
    const int64_t m_iters = m_end > m_begin ? (m_end - m_begin + kBM - 1) / kBM : 0;
    iters = m_iters * group;
    h = h_first;
    m0 = m_begin;
  }
  __device__ void advance(int kBM) {
    m0 += kBM;
    if (m0 >= m_end) {
      m0 = m_begin;
      ++h;
    }
  }
};

// Warpgroup 0 (the producer, after its register hand-over): warp 0 copies K and V once and each query
// tile's Q, dO, LSE and D into the two-stage ring; warp 1 adds each staged dQ tile into the accumulator
// with one bulk reduce-add.
template <class Elem, int kDim>
__device__ __forceinline__ void bwd_ws_producer(const BwdParams& p, const BwdPanelMaps& maps, const float* dsum_g,
                                                const DqAccum& accum, const KeyTileRound& round, const Seq& sq,
                                                int64_t n0, int rows_k, int64_t hk, int64_t group, bool dq_staged,
                                                unsigned char* tiles, int warp, int lane) {
  using Cfg = BwdWsConfig<Elem, kDim>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kPanels = Cfg::kPanels;
  unsigned char* const sK = tiles;
  unsigned char* const sV = tiles + Cfg::kKvBytes;
  auto sQ = [&](int s) { return tiles + 2 * Cfg::kKvBytes + s * Cfg::kQBytes; };
  auto sdO = [&](int s) { return tiles + 2 * Cfg::kKvBytes + (2 + s) * Cfg::kQBytes; };
  float* const sdQ = reinterpret_cast<float*>(tiles + Cfg::kDqOffset);
  float* const sStats = reinterpret_cast<float*>(tiles + Cfg::kStatsOffset);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);  // as bwd_ws_kernel names them
  uint64_t* const kv_full = bars;
  uint64_t* const q_full = bars + 1;
  uint64_t* const q_empty = bars + 3;
  uint64_t* const dq_full = bars + 5;
  uint64_t* const dq_empty = bars + 6;
  QueryTileWalk walk(sq, n0, rows_k, hk * group, group, kBM);
  if (warp == 0) {
    if (lane == 0) {
      tma_prefetch_map(&maps.q);
      tma_prefetch_map(&maps.dout);
      mbar_arrive_expect_tx(kv_full, 2 * Cfg::kKvBytes);
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn) {
        tma_load_4d(sK + pn * kBN * 128, &maps.k, kv_full, 64 * pn, int(n0), int(hk), int(sq.tb));
        tma_load_4d(sV + pn * kBN * 128, &maps.v, kv_full, 64 * pn, int(n0), int(hk), int(sq.tb));
      }
    }
    for (int64_t it = 0; it < walk.iters; ++it, walk.advance(kBM)) {
      const int s = int(it & 1);
      if (it >= 2) mbar_wait(q_empty + s, uint32_t((it >> 1) - 1) & 1);
      if (lane == 0) {
        mbar_arrive_expect_tx(q_full + s, 2 * Cfg::kQBytes);
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn) {
          tma_load_4d(sQ(s) + pn * kBM * 128, &maps.q, q_full + s, 64 * pn, int(walk.m0), int(walk.h), int(sq.tb));
          tma_load_4d(sdO(s) + pn * kBM * 128, &maps.dout, q_full + s, 64 * pn, int(walk.m0), int(walk.h),
                      int(sq.tb));
        }
      }
      // D, and the LSE as P's exponent subtracts it (bwd_ws_probs): base 2, and +inf for a row that sees no key
      // (LSE -inf), whose exponentials are then 0; done here, once per row, not by each consumer lane. Rows past
      // the sequence get 0 (with their zero Q and dO they add nothing).
      const int rows = sq.q_tile_rows(walk.m0, kBM);
      const int64_t r0 = sq.row_index(p.heads_q, walk.h, walk.m0);
#pragma unroll
      for (int i = 0; i < kBM / 32; ++i) {
        const int m = lane + 32 * i;
        float lse = 0.f, dsum = 0.f;
        if (m < rows) {
          lse = ExpDomain<float>::from_lse(static_cast<const float*>(p.lse)[r0 + m]);
          lse = lse == neg_inf<float>() ? -neg_inf<float>() : lse;
          dsum = dsum_g[r0 + m];
        }
        sStats[s * 2 * kBM + m] = lse;
        sStats[s * 2 * kBM + kBM + m] = dsum;
      }
      mbar_arrive(q_full + s);
    }
  } else if (warp == 1 && lane == 0 && dq_staged) {
    float* const acc = accum.block_slice<float>(round.groups);
    for (int64_t it = 0; it < walk.iters; ++it, walk.advance(kBM)) {
      mbar_wait(dq_full, uint32_t(it) & 1);
      const int rows16 = (sq.q_tile_rows(walk.m0, kBM) + 15) / 16 * 16;
      bulk_reduce_add(acc + sq.row_index(p.heads_q, walk.h, walk.m0) * kDim, sdQ, uint32_t(rows16 * kDim * 4));
      bulk_commit();
      bulk_wait_read<0>();
      mbar_arrive(dq_empty);
    }
    bulk_wait<0>();
  }
}

// The backward's mbarriers (bwd_ws_kernel names them).
__device__ __forceinline__ void bwd_ws_init_barriers(uint64_t* const kv_full, uint64_t* const q_full,
                                                     uint64_t* const q_empty, uint64_t* const dq_full,
                                                     uint64_t* const dq_empty) {
  mbar_init(kv_full, 1);
  for (int s = 0; s < 2; ++s) {
    mbar_init(q_full + s, 1 + 32);  // the TMA thread's expect_tx and the warp's LSE / D stores
    mbar_init(q_empty + s, 256);
  }
  mbar_init(dq_full, 256);
  mbar_init(dq_empty, 1);
  fence_mbar_init();
}

// S^T = K Q^T or dP^T = V dO^T (acc = a b^T) of the warpgroup's 64 keys (a_at: their lines of K or V) against
// kRows rows (b_at: their lines of Q or dO, panels of kBM lines); one commit group.
template <class Elem, int kDim, int kBM, int kBN, int kRows = kBM, int kRA>
__device__ __forceinline__ void bwd_ws_issue_score(float (&acc)[kRA][4], uint32_t a_at, uint32_t b_at) {
  // (K-major: K, V, Q and dO as the scores' operands; descriptors of common/wgmma.cuh)
  const uint64_t a = kmajor_desc(a_at), b = kmajor_desc(b_at);
  wgmma_fence();
  Wgmma<Elem, kRows>::template ss<0>(acc, a, b);
#pragma unroll
  for (int kk = 1; kk < kDim / 16; ++kk)
    Wgmma<Elem, kRows>::template ss<1>(acc, kmajor_step(a, kk, kBN), kmajor_step(b, kk, kBM));
  wgmma_commit();
}

// S^T and dP^T (bwd_ws_issue_score) in two commit groups: the exponentials run under dP^T's product.
template <class Elem, int kDim, int kBM, int kBN, int kRows = kBM, int kRA>
__device__ __forceinline__ void bwd_ws_issue_scores(float (&st)[kRA][4], float (&dpt)[kRA][4], uint32_t k_at,
                                                    uint32_t v_at, uint32_t q_at, uint32_t do_at) {
  bwd_ws_issue_score<Elem, kDim, kBM, kBN, kRows>(st, k_at, q_at);
  bwd_ws_issue_score<Elem, kDim, kBM, kBN, kRows>(dpt, v_at, do_at);
}

// dV += P^T dO, dK += dS^T Q: P^T and dS^T from registers, dO and Q MN-major from smem; one commit group.
template <class Elem, int kDim, int kBM, int kDA>
__device__ __forceinline__ void bwd_ws_issue_dkdv(float (&dk)[kDA][4], float (&dv)[kDA][4],
                                                  uint32_t (&pa)[kBM / 16][4], uint32_t (&dsa)[kBM / 16][4],
                                                  uint32_t q_at, uint32_t do_at) {
  pin(dk);
  pin(dv);
  pin(pa);
  pin(dsa);
  const uint64_t dO = mnmajor_desc(do_at, kBM), q = mnmajor_desc(q_at, kBM);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk) Wgmma<Elem, kDim>::rs(dv, pa[kk], mnmajor_step(dO, kk));
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk) Wgmma<Elem, kDim>::rs(dk, dsa[kk], mnmajor_step(q, kk));
  wgmma_commit();
}

// dV += P^T dO or dK += dS^T Q alone (acc += a b; bwd_ws_issue_dkdv's products one at a time); one commit group.
template <class Elem, int kDim, int kBM, int kDA>
__device__ __forceinline__ void bwd_ws_issue_key_grad(float (&acc)[kDA][4], uint32_t (&a)[kBM / 16][4],
                                                      uint32_t b_at) {
  pin(acc);
  pin(a);
  const uint64_t b = mnmajor_desc(b_at, kBM);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk) Wgmma<Elem, kDim>::rs(acc, a[kk], mnmajor_step(b, kk));
  wgmma_commit();
}

// dQ = dS K over the block's kBN keys, both operands MN-major (dq_a: dS^T's lines, dq_b: K's); one
// commit group.
template <class Elem, int kDqCols, int kBN, int kCA>
__device__ __forceinline__ void bwd_ws_issue_dq(float (&dq)[kCA][4], uint32_t dq_a, uint32_t dq_b) {
  const uint64_t a = mnmajor_desc(dq_a, kBN), b = mnmajor_desc(dq_b, kBN);
  wgmma_fence();
  Wgmma<Elem, kDqCols>::template ss<0, 1, 1>(dq, a, b);
#pragma unroll
  for (int kk = 1; kk < kBN / 16; ++kk)
    Wgmma<Elem, kDqCols>::template ss<1, 1, 1>(dq, mnmajor_step(a, kk), mnmajor_step(b, kk));
  wgmma_commit();
}

// Every score of a tile visible (bwd_ws_probs' `visible` where the tile is neither cut by the mask nor by the
// sequence: no compare per score).
struct AllVisible {
  __device__ __forceinline__ bool operator()(int /*key*/, int /*row*/) const { return true; }
};

// S^T -> P^T in place: the lane's keys key0 and key0 + 8 (r = 0, 1) against rows 8 j + 2 t + c, with
// the rows' LSE from smem (base 2, as the producer stores it) and the terms of a bias (key_terms.of(x, j, c,
// r), key_bias.cuh); keys a row does not see (visible(key, row) false) get 0.
template <int kRA, class Visible, class KeyTerms = NoKeyTerms>
__device__ __forceinline__ void bwd_ws_probs(float (&st)[kRA][4], const float* lse_s, float score_scale, int key0,
                                             int t, const Visible& visible, const KeyTerms& key_terms = {}) {
  using Exp = ExpDomain<float>;
#pragma unroll
  for (int j = 0; j < kRA; ++j) {
    const float2 lse_pair = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * t);  // rows 8 j + 2 t, + 1
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int row = 8 * j + 2 * t + c;
      const float lse = c == 0 ? lse_pair.x : lse_pair.y;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r, e = 2 * r + c;
        const float pr = Exp::exp(key_terms.of(st[j][e] * score_scale - lse, j, c, r));
        st[j][e] = visible(key, row) ? pr : 0.f;
      }
    }
  }
}

// bwd_ws_probs of a tile, without a visibility test per score where every score of the tile is visible.
template <int kRA, class Visible, class KeyTerms>
__device__ __forceinline__ void bwd_ws_tile_probs(float (&st)[kRA][4], const float* lse_s, float score_scale,
                                                  int key0, int t, bool all_visible, const Visible& visible,
                                                  const KeyTerms& key_terms) {
  if (all_visible) bwd_ws_probs(st, lse_s, score_scale, key0, t, AllVisible{}, key_terms);
  else bwd_ws_probs(st, lse_s, score_scale, key0, t, visible, key_terms);
}

// Bias rows (BiasForm::kRows): S^T -> P^T (bwd_ws_probs) after the S^T product's wait (wait_scores), with
// the query tile's bias words (rows m0 + ..., keys n0 + key0 and + 8 of head h) loaded before the wait, so
// that their latency hides behind the product. `read(r, row)`: the lane's (key, row) pairs to read
// (visible, in the sequence).
template <class Elem, int kRA, class WaitScores, class Visible, class Read>
__device__ __forceinline__ void bwd_ws_row_bias_probs(float (&st)[kRA][4], const FwdParams& p, const Seq& sq,
                                                      int64_t h, int64_t m0, int64_t n0, const float* lse_s,
                                                      float score_scale, int key0, int t,
                                                      const WaitScores& wait_scores, const Visible& visible,
                                                      const Read& read) {
  QueryTileWords<kRA> words;
  words.template load<Elem>(p, sq, h, m0, n0 + key0, t, read);
  wait_scores();
  with_query_tile_terms<Elem>(p, words, [&](const auto& terms) {
    bwd_ws_probs(st, lse_s, score_scale, key0, t, visible, terms);
  });
}

// dP^T -> dS^T = P^T (dP^T - D) in place, with the rows' D from smem.
template <int kRA>
__device__ __forceinline__ void bwd_ws_dscores(float (&dpt)[kRA][4], const float (&pt)[kRA][4], const float* d_s,
                                               int t) {
#pragma unroll
  for (int j = 0; j < kRA; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float dsum = d_s[8 * j + 2 * t + c];
#pragma unroll
      for (int r = 0; r < 2; ++r) dpt[j][2 * r + c] = pt[j][2 * r + c] * (dpt[j][2 * r + c] - dsum);
    }
}

// P^T or dS^T rounded to Elem as the A fragments of a register-sourced wgmma (one per 16 rows).
template <class Elem, int kKSteps, int kRA>
__device__ __forceinline__ void bwd_ws_a_fragments(uint32_t (&frag)[kKSteps][4], float (&acc)[kRA][4]) {
  using M = Mma<Elem>;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    typename M::A a;
    M::a_from_acc(a, &acc[2 * kk]);
#pragma unroll
    for (int e = 0; e < 4; ++e) frag[kk][e] = a.r[e];
  }
}

// The lane's dS^T (keys key0, key0 + 8) into the smem tile `sds` for dQ's product: kBN lines of the
// rows, 64 rows a panel, its 16-byte chunks swizzled by the line. word(i, r): the rounded pair of key r's
// row atom i (rows 8 (j0 + i) + 2 t, + 1).
template <int kBN, int kRA, class Word>
__device__ __forceinline__ void bwd_ws_stage_ds(unsigned char* sds, int key0, int t, int j0, const Word& word) {
  // Key0's line with its chunk bits (4..6) holding the swizzle key0 % 8 (that of key0 + 8 too): chunk j % 8 of
  // either line is then one XOR away, and key0 + 8's line and the panel constant offsets.
  const uint32_t line = uint32_t(key0 * 128 + (key0 % 8) * 16 + 4 * t);
#pragma unroll
  for (int i = 0; i < kRA; ++i) {
    const int j = j0 + i;
    unsigned char* const at = sds + (line ^ uint32_t((j % 8) * 16)) + (j / 8) * kBN * 128;
#pragma unroll
    for (int r = 0; r < 2; ++r) *reinterpret_cast<uint32_t*>(at + r * 8 * 128) = word(i, r);
  }
}
// ... from the fp32 values (rounded here).
template <class Elem, int kBN, int kRA>
__device__ __forceinline__ void bwd_ws_stage_ds(unsigned char* sds, const float (&dst)[kRA][4], int key0, int t,
                                                int j0) {
  bwd_ws_stage_ds<kBN, kRA>(sds, key0, t, j0,
                            [&](int i, int r) { return Mma<Elem>::pack(dst[i][2 * r], dst[i][2 * r + 1]); });
}
// ... from the A fragments of the same values (bwd_ws_a_fragments: fragment kk holds atoms 2 kk, 2 kk + 1, key
// r's pair of each in words r, 2 + r), which already hold them rounded.
template <int kBN, int kKSteps>
__device__ __forceinline__ void bwd_ws_stage_ds(unsigned char* sds, const uint32_t (&frag)[kKSteps][4], int key0,
                                                int t) {
  bwd_ws_stage_ds<kBN, 2 * kKSteps>(sds, key0, t, 0, [&](int j, int r) { return frag[j / 2][2 * (j % 2) + r]; });
}

// The epilogue: dK (scaled) and dV of the lane's keys key0 and key0 + 8 of the tile below rows_k. A lane holds dims
// col0 + 8 d + 2 t (+ 1) of each; the quad's lanes swap them (transpose_quad_words) so that each stores 16 contiguous
// bytes, dims col0 + 8 (d0 + t) ... + 7: a quarter of the store instructions and memory requests of pair stores, at the
// end of every block (dk / dv rows 16-byte aligned: bwd_dkdv_rows_aligned_16). Every lane of the warp takes part.
template <class Elem, int kDA>
__device__ __forceinline__ void bwd_ws_store_dkdv(const BwdParams& p, const Seq& sq, int64_t hk, int64_t n0, int rows_k,
                                                  int key0, int t, const float (&dk)[kDA][4],
                                                  const float (&dv)[kDA][4], int col0 = 0) {
  static_assert(kDA % 4 == 0, "dims in groups of 32");
  using M = Mma<Elem>;
  Elem* dk_g = sq.k_rows<Elem>(p.dk, p.dk_stride, hk, n0) + col0;
  Elem* dv_g = sq.k_rows<Elem>(p.dv, p.dv_stride, hk, n0) + col0;
  const float scale = float(p.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
#pragma unroll
    for (int d0 = 0; d0 < kDA; d0 += 4) {
      uint32_t wk[4], wv[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        wk[k] = M::pack(dk[d0 + k][2 * r] * scale, dk[d0 + k][2 * r + 1] * scale);
        wv[k] = M::pack(dv[d0 + k][2 * r], dv[d0 + k][2 * r + 1]);
      }
      transpose_quad_words(wk, t);
      transpose_quad_words(wv, t);
      if (key < rows_k) {
        *reinterpret_cast<uint4*>(dk_g + key * p.dk_stride.row + 8 * (d0 + t)) = make_uint4(wk[0], wk[1], wk[2], wk[3]);
        *reinterpret_cast<uint4*>(dv_g + key * p.dv_stride.row + 8 * (d0 + t)) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
      }
    }
  }
}

// The consumers at dim 256 (BwdWsConfig::kSplitDims): both walk the block's 64 keys. For the scores they
// split the query tile's rows: consumer c computes S^T and dP^T against rows [32 c, 32 c + 32), their P^T
// and dS^T, and stages both in smem; each adds dV, dK and dQ over its half of the dims, [128 c, 128 c + 128),
// with every row's P^T and dS^T from smem: dV after a named barrier of both on P^T (so that dV's product runs
// under the dS^T work), dK and dQ after a second one on dS^T.
template <class Elem, int kDim, BiasForm kBias>
__device__ __forceinline__ void bwd_ws_split_consumer(const BwdParams& p, const DqAccum& accum,
                                                      const KeyTileRound& round, const Seq& sq, int64_t n0,
                                                      int rows_k, int64_t hk, int64_t group, unsigned char* tiles,
                                                      int cwg, int warp, int lane) {
  using Cfg = BwdWsConfig<Elem, kDim>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kHalf = kDim / 2, kHalfPanels = kHalf / 64;
  constexpr int kRows = kBM / 2, kRA = kRows / 8, kDA = kHalf / 8;
  unsigned char* const sQ0 = tiles + 2 * Cfg::kKvBytes;
  auto sdS = [&](int b) { return tiles + Cfg::kDsOffset + b * Cfg::kDsBytes; };
  auto sP = [&](int b) { return tiles + Cfg::kPOffset + b * Cfg::kDsBytes; };
  const float* const sStats = reinterpret_cast<const float*>(tiles + Cfg::kStatsOffset);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);
  uint64_t* const q_full = bars + 1;
  uint64_t* const q_empty = bars + 3;
  const int g = lane / 4, t = lane % 4, key0 = warp * 16 + g, row0 = cwg * kRows;
  const float score_scale = Exp::score_scale(p.scale);
  const uint32_t k_at = smem_addr(tiles), v_at = k_at + Cfg::kKvBytes;
  // This consumer's dims of K (dQ's B operand), Q and dO: panels of 64 dims.
  const uint32_t k_half = k_at + cwg * kHalfPanels * kBN * 128;
  const auto key_terms = key_pair_terms<Elem, kBias>(p, sq, n0 + key0);

  float dk[kDA][4], dv[kDA][4];
#pragma unroll
  for (int d = 0; d < kDA; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;

  mbar_wait(bars, 0);  // K and V
  QueryTileWalk walk(sq, n0, rows_k, hk * group, group, kBM);
  for (int64_t it = 0; it < walk.iters; ++it, walk.advance(kBM)) {
    const int s = int(it & 1);
    const int64_t m0 = walk.m0;
    const uint32_t q_at = smem_addr(sQ0 + s * Cfg::kQBytes), do_at = smem_addr(sQ0 + (2 + s) * Cfg::kQBytes);
    const uint32_t q_half = q_at + cwg * kHalfPanels * kBM * 128, do_half = do_at + cwg * kHalfPanels * kBM * 128;
    const uint32_t ds_at = smem_addr(sdS(s)), p_at = smem_addr(sP(s));
    const float* lse_s = sStats + s * 2 * kBM + row0;
    const float* d_s = lse_s + kBM;
    mbar_wait(q_full + s, uint32_t(it >> 1) & 1);
    // S^T = K Q^T and dP^T = V dO^T against this consumer's rows (their lines of the Q / dO panels).
    float st[kRA][4], dpt[kRA][4];
    bwd_ws_issue_scores<Elem, kDim, kBM, kBN, kRows>(st, dpt, k_at, v_at, q_at + row0 * 128, do_at + row0 * 128);
    const bool all_visible = n0 >= sq.key_begin(m0 + kBM - 1) && n0 + kBN <= sq.key_end(m0);
    auto clamp_base = [](int64_t x) { return int(x < -kBM - 1 ? -kBM - 1 : x > kBN + 1 ? kBN + 1 : x); };
    const int lo0 = clamp_base(m0 + row0 - n0 + sq.band.lo), hi0 = clamp_base(m0 + row0 - n0 + sq.band.hi);
    const int k_lim = clamp_base(sq.len_k - n0);
    auto visible = [&](int key, int row) {
      return all_visible || (key - row >= lo0 && key - row <= hi0 && key < k_lim);
    };
    if constexpr (kBias == BiasForm::kRows) {
      const int rows = sq.q_tile_rows(m0, kBM) - row0;
      bwd_ws_row_bias_probs<Elem>(
          st, p, sq, walk.h, m0 + row0, n0, lse_s, score_scale, key0, t,
          [&] {
            wgmma_wait<1>();
            pin(st);
          },
          visible, [&](int r, int row) { return row < rows && visible(key0 + 8 * r, row); });
    } else {
      wgmma_wait<1>();
      pin(st);
      bwd_ws_tile_probs(st, lse_s, score_scale, key0, t, all_visible, visible, key_terms);
    }
    bwd_ws_stage_ds<Elem, kBN>(sP(s), st, key0, t, row0 / 8);
    fence_proxy_async();
    bar_sync(1, 256);  // every row's P^T in smem
    // dV += P^T dO over this half's dims, issued before dP^T's wait so that it runs under dS^T; then dK += dS^T Q
    // and dQ = dS K over them, the latter in two products of 64 dims: the second runs under the first's atomics.
    const uint64_t pt = kmajor_desc(p_at), dst = kmajor_desc(ds_at);
    const uint64_t dO = mnmajor_desc(do_half, kBM), q = mnmajor_desc(q_half, kBM);
    pin(dv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<Elem, kHalf>::template ss<1, 0, 1>(dv, kmajor_step(pt, kk, kBN), mnmajor_step(dO, kk));
    wgmma_commit();
    wgmma_wait<1>();  // dP^T (committed before dV)
    pin(dpt);
    bwd_ws_dscores(dpt, st, d_s, t);
    bwd_ws_stage_ds<Elem, kBN>(sdS(s), dpt, key0, t, row0 / 8);
    fence_proxy_async();
    bar_sync(2, 256);  // every row's dS^T in smem
    pin(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<Elem, kHalf>::template ss<1, 0, 1>(dk, kmajor_step(dst, kk, kBN), mnmajor_step(q, kk));
    wgmma_commit();
    float dq[2][1][kDA / 2][4];
    bwd_ws_issue_dq<Elem, kHalf / 2, kBN>(dq[0][0], ds_at, k_half);
    bwd_ws_issue_dq<Elem, kHalf / 2, kBN>(dq[1][0], ds_at, k_half + kBN * 128);
    wgmma_wait<1>();
    pin(dk);
    pin(dv);
    pin(dq[0][0]);
    float* const acc = accum.block_slice<float>(round.groups);
    const int64_t row = sq.row_index(p.heads_q, walk.h, m0);
    const int rows = sq.q_tile_rows(m0, kBM);
    add_dq_atoms(acc, row, dq[0], warp * 16, cwg * kHalf, rows, kDim, lane);
    wgmma_wait<0>();
    pin(dq[1][0]);
    mbar_arrive(q_empty + s);  // Q, dO, LSE, D, P^T and dS^T of this stage are read
    add_dq_atoms(acc, row, dq[1], warp * 16, cwg * kHalf + kHalf / 2, rows, kDim, lane);
  }
  bwd_ws_store_dkdv<Elem>(p, sq, hk, n0, rows_k, key0, t, dk, dv, cwg * kHalf);
}

// kBias: kNone (plain calls, and a key-vector bias: its values are read at run time) or kRows.
template <class Elem, int kDim, BiasForm kBias = BiasForm::kNone>
__global__ void __launch_bounds__(BwdWsConfig<Elem, kDim>::kThreads, 1)
    bwd_ws_kernel(const BwdParams p, const __grid_constant__ BwdPanelMaps maps, const float* dsum_g,
                  const DqAccum accum, KeyTileRound round) {
#ifdef FLASHATTN_WGMMA
  using Cfg = BwdWsConfig<Elem, kDim>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN;
  constexpr int kRA = kBM / 8, kDA = kDim / 8;  // S^T / dP^T atoms (over the rows), dK / dV atoms

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const tiles = align_1024(smem_raw);
  unsigned char* const sK = tiles;
  unsigned char* const sV = tiles + Cfg::kKvBytes;
  auto sQ = [&](int s) { return tiles + 2 * Cfg::kKvBytes + s * Cfg::kQBytes; };
  auto sdO = [&](int s) { return tiles + 2 * Cfg::kKvBytes + (2 + s) * Cfg::kQBytes; };
  auto sdS = [&](int b) { return tiles + Cfg::kDsOffset + b * Cfg::kDsBytes; };  // dS^T: kBN lines of kBM rows
  float* const sdQ = reinterpret_cast<float*>(tiles + Cfg::kDqOffset);           // blocked, as the accumulator
  float* const sStats = reinterpret_cast<float*>(tiles + Cfg::kStatsOffset);     // [stage][LSE, D][kBM]
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);
  uint64_t* const kv_full = bars;       // K and V landed
  uint64_t* const q_full = bars + 1;    // [stage]: Q, dO, LSE and D of a tile landed
  uint64_t* const q_empty = bars + 3;   // [stage]: the consumers are done with them
  uint64_t* const dq_full = bars + 5;   // the consumers staged a dQ tile in sdQ
  uint64_t* const dq_empty = bars + 6;  // the bulk add has read it

  const unsigned block =
      blockIdx.x >= round.heavy.start ? heavy_last_block(round.heavy, round.groups, blockIdx.x) : blockIdx.x;
  const TileBlock blk = tile_block(round.groups, 1, p.heads_kv, /*heaviest_first=*/false, block);
  const int64_t hk = blk.head, b = blk.batch, group = p.heads_q / p.heads_kv;
  const Seq sq = plain_sequence(p, b);
  const int64_t n0 = int64_t(round.first + blk.tile) * kBN;
  if (n0 >= sq.len_k) return;
  const int rows_k = sq.k_tile_rows(n0, kBN);
  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31, warp = (tid / 32) % 4;
  // A dQ tile goes through smem where its rows start a 16-row group of the blocked accumulator.
  const bool dq_staged = !Cfg::kSplitDims && sq.rows_per_head % 16 == 0;

  if (tid == 0) bwd_ws_init_barriers(kv_full, q_full, q_empty, dq_full, dq_empty);
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    bwd_ws_producer<Elem, kDim>(p, maps, dsum_g, accum, round, sq, n0, rows_k, hk, group, dq_staged, tiles, warp,
                                lane);
    return;
  }

  setmaxnreg_inc<Cfg::kConsumerRegs>();
  // The consumer warpgroup, and the same broadcast from lane 0 for the products' smem addresses: ptxas then
  // knows that it is the same across the warp and builds their descriptors in uniform registers, not per lane.
  const int cwg = wg - 1, uniform_cwg = __shfl_sync(0xffffffffu, cwg, 0);
  if constexpr (Cfg::kSplitDims) {
    bwd_ws_split_consumer<Elem, kDim, kBias>(p, accum, round, sq, n0, rows_k, hk, group, tiles, uniform_cwg, warp,
                                             lane);
  } else {
    const int g = lane / 4, t = lane % 4;
    const int wkey = cwg * 64 + warp * 16;  // the warp's first key in the tile
    const float score_scale = Exp::score_scale(p.scale);

    const uint32_t k_at = smem_addr(sK), v_at = smem_addr(sV);
    const auto key_terms = key_pair_terms<Elem, kBias>(p, sq, n0 + wkey + g);

    float dk[kDA][4], dv[kDA][4];
#pragma unroll
    for (int d = 0; d < kDA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;

    // dQ = dS K over the block's keys, both operands MN-major: with 128-row tiles this warpgroup's 64 rows
    // (its panel of dS^T's lines) x every dim, with 64-row tiles every row x its panel of the dims (a panel
    // further into K's lines for the second warpgroup). At dim 96 that panel's last 32 dims are TMA's zero
    // fill: the second warpgroup adds only the first kLastCols columns of its product.
    constexpr bool kSplitRows = kBM == 128;
    constexpr int kDqCols = kSplitRows ? kDim : kDim == 96 ? 64 : kDim / 2;
    constexpr int kLastCols = kSplitRows ? kDim : kDim - kDqCols;  // the second warpgroup's
    const int dq_row0 = (kSplitRows ? cwg * 64 : 0) + warp * 16, dq_col0 = kSplitRows ? 0 : cwg * kDqCols;
    const uint32_t dq_b =
        kSplitRows ? k_at : k_at + (kDim == 128 || kDim == 96 ? uniform_cwg * kBN * 128 : uniform_cwg * kDqCols * 2);
    float dq[1][kDqCols / 8][4];
    // Adds a finished dQ tile: into sdQ in the accumulator's blocked layout (dq_layout.cuh: the warp's 16
    // rows x 8 columns per atom, a lane's 4 values together) once the bulk add has read the one before,
    // or with atomics.
    auto add_dq = [&](int64_t it, int64_t h, int64_t m0) {
      pin(dq[0]);
      if (dq_staged) {
        if (it > 0) mbar_wait(dq_empty, uint32_t(it - 1) & 1);
        float* dst = sdQ + dq_row0 * kDim + (dq_col0 / 8) * 128 + 4 * lane;
#pragma unroll
        for (int d = 0; d < kDqCols / 8; ++d)
          if (kLastCols == kDqCols || cwg == 0 || d < kLastCols / 8)
            *reinterpret_cast<float4*>(dst + 128 * d) =
                make_float4(dq[0][d][0], dq[0][d][1], dq[0][d][2], dq[0][d][3]);
        fence_proxy_async();
        mbar_arrive(dq_full);
      } else {
        add_dq_atoms(accum.block_slice<float>(round.groups), sq.row_index(p.heads_q, h, m0), dq, dq_row0, dq_col0,
                     sq.q_tile_rows(m0, kBM), kDim, lane);
      }
    };

    mbar_wait(kv_full, 0);
    QueryTileWalk walk(sq, n0, rows_k, hk * group, group, kBM);
    // With 64-row tiles (dims 96, 128) and no bias rows the products overlap more (kOverlapped): S^T of a query
    // tile is issued at the end of the tile before, once its dV / dK are done, so that it runs while the lanes add
    // that tile's dQ (past the last tile the last one's again, its product discarded: a conditional issue would
    // make the waits' counts run-time, and ptxas then serializes every product), and dV's product is issued
    // before the wait for dP^T, so that it runs while the lanes compute dS^T. With 128-row tiles (dim 64) the
    // early S^T ran 2-4% slower at 512 keys (H200) and dV first serializes the products (too few registers); with
    // bias rows both spill more.
    constexpr bool kOverlapped = kBM == 64 && kBias != BiasForm::kRows;
    float st[kRA][4];
    auto issue_st = [&](int64_t it) {
      const int64_t i = it < walk.iters ? it : walk.iters - 1;
      const int s = int(i & 1);
      mbar_wait(q_full + s, uint32_t(i >> 1) & 1);
      bwd_ws_issue_score<Elem, kDim, kBM, kBN>(st, k_at + uniform_cwg * 64 * 128, smem_addr(sQ(s)));
    };
    // One query tile (with kOverlapped its S^T already issued); the first one peeled off the loop: ptxas then
    // schedules the loop's body without the first tile's cases (at dim 128 the backward ran 15-18% faster on an
    // H200 at L >= 4096 than with one loop over every tile; dim 64 the same).
    auto tile = [&](int64_t it) {
      const int s = int(it & 1);
      const int64_t m0 = walk.m0;
      const uint32_t q_at = smem_addr(sQ(s)), do_at = smem_addr(sdO(s));
      float dpt[kRA][4];
      if constexpr (kOverlapped) {
        bwd_ws_issue_score<Elem, kDim, kBM, kBN>(dpt, v_at + uniform_cwg * 64 * 128, do_at);
      } else {
        mbar_wait(q_full + s, uint32_t(it >> 1) & 1);
        bwd_ws_issue_scores<Elem, kDim, kBM, kBN>(st, dpt, k_at + uniform_cwg * 64 * 128,
                                                  v_at + uniform_cwg * 64 * 128, q_at, do_at);
      }
      const float* lse_s = sStats + s * 2 * kBM;
      const float* d_s = lse_s + kBM;
      const bool all_visible = n0 >= sq.key_begin(m0 + kBM - 1) && n0 + kBN <= sq.key_end(m0);
      auto clamp_base = [](int64_t x) { return int(x < -kBM - 1 ? -kBM - 1 : x > kBN + 1 ? kBN + 1 : x); };
      const int lo0 = clamp_base(m0 - n0 + sq.band.lo), hi0 = clamp_base(m0 - n0 + sq.band.hi);
      const int k_lim = clamp_base(sq.len_k - n0);
      auto visible = [&](int key, int row) {
        return all_visible || (key - row >= lo0 && key - row <= hi0 && key < k_lim);
      };
      if constexpr (kBias == BiasForm::kRows) {
        const int rows = sq.q_tile_rows(m0, kBM);
        bwd_ws_row_bias_probs<Elem>(
            st, p, sq, walk.h, m0, n0, lse_s, score_scale, wkey + g, t,
            [&] {
              wgmma_wait<1>();
              pin(st);
            },
            visible, [&](int r, int row) { return row < rows && visible(wkey + g + 8 * r, row); });
      } else {
        wgmma_wait<1>();
        pin(st);
        bwd_ws_tile_probs(st, lse_s, score_scale, wkey + g, t, all_visible, visible, key_terms);
      }
      uint32_t pa[kBM / 16][4], dsa[kBM / 16][4];
      if constexpr (kOverlapped) {  // dV's product before the wait for dP^T
        bwd_ws_a_fragments<Elem>(pa, st);
        bwd_ws_issue_key_grad<Elem, kDim, kBM>(dv, pa, do_at);
        wgmma_wait<1>();  // dP^T (committed before dV)
        pin(dpt);
        bwd_ws_dscores(dpt, st, d_s, t);
        bwd_ws_a_fragments<Elem>(dsa, dpt);
        bwd_ws_issue_key_grad<Elem, kDim, kBM>(dk, dsa, q_at);
      } else {
        wgmma_wait<0>();
        pin(dpt);
        bwd_ws_dscores(dpt, st, d_s, t);
        bwd_ws_a_fragments<Elem>(pa, st);
        bwd_ws_a_fragments<Elem>(dsa, dpt);
        bwd_ws_issue_dkdv<Elem, kDim, kBM>(dk, dv, pa, dsa, q_at, do_at);
      }

      // dS^T to smem (buffer it % 2: the other warpgroup may still read the previous tile's for its dQ).
      bwd_ws_stage_ds<kBN>(sdS(s), dsa, wkey + g, t);
      fence_proxy_async();
      // dQ is issued behind dV / dK, so that the tensor cores do not drain at the barrier.
      bar_sync(1, 256);  // both halves of dS^T in smem
      bwd_ws_issue_dq<Elem, kDqCols, kBN>(dq[0], smem_addr(sdS(s)) + (kSplitRows ? uniform_cwg * kBN * 128 : 0), dq_b);
      wgmma_wait<1>();
      pin(dk);
      pin(dv);
      pin(pa);
      pin(dsa);
      mbar_arrive(q_empty + s);  // Q, dO, LSE and D of this stage are read (the discarded S^T's Q: nothing loads after)
      if constexpr (kOverlapped) {
        issue_st(it + 1);
        wgmma_wait<1>();
        add_dq(it, walk.h, m0);
        wgmma_wait<0>();
        pin(st);
      } else {
        wgmma_wait<0>();
        add_dq(it, walk.h, m0);
      }
      walk.advance(kBM);
    };
    if (walk.iters > 0) {
      if constexpr (kOverlapped) issue_st(0);
      tile(0);
      for (int64_t it = 1; it < walk.iters; ++it) tile(it);
    }

    bwd_ws_store_dkdv<Elem>(p, sq, hk, n0, rows_k, wkey + g, t, dk, dv);
  }
#endif
}

}  // namespace flashattn::cuda::sm90
