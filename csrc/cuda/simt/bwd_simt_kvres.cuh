// dK/dV SIMT kernel with the key tile resident in smem, for fp32 accumulation and head dims up
// to kDim (64 or 128) on both Q/K and V. One block of 256 threads per (batch, kv head, key
// tile): K and V are loaded once; for every query head of the GQA group and every 64-row query
// tile that sees the key tile, S^T = K Q^T and dP^T = V dO^T are formed in registers, turned
// into P^T and dS^T (kept in smem, [key][query]), and dV += P^T dO, dK += dS^T Q accumulate in
// registers; on the atomic path dQ += dS K is added into the fp32 accumulator (at dim 64 on the
// tensor cores, add_dq_tf32x3).
//
// Thread (r, c) = (tid / 16, tid % 16) owns key rows r + 16i (i < kTK), query columns c + 16j
// (j < 4) of the score tiles, output columns g*64 + c*4 + e of dK/dV and, for dQ, query rows
// r*4 .. r*4+3. Rows interleaved by 16 keep the two row groups of a warp on different banks
// (broadcast loads are single wavefronts) and every operand is read 16 bytes at a time.
// At kDim 64 a thread owns 8 key rows, so the products are FMA-bound rather than smem-bound; at
// 128 it owns 6 (96-key tiles, 230 KB of smem; H200: +3..+13% over 4 rows, which were bound by
// smem reads; 10 rows at dim 64 measured -6..+2%).
//
// Q and dO have one buffer each, refilled by cp.async as soon as their last reader is done:
// the next dO loads during dK/dQ and the next Q during dP^T = V dO^T.
//
// Wider dims, fp64, and devices with too little smem use the chunked kernel of bwd_simt.cuh.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../common/sequence.h"
#include "../common/check.h"
#include "../common/grid.cuh"
#include "../common/mma.cuh"
#include "../common/online_softmax.cuh"
#include "launch.h"
#include "pv_tf32x3.cuh"
#include "resident_config.h"
#include "smem_vec.cuh"
#include "tile_gemm.cuh"
#include "tile_load_x4.cuh"

namespace flashattn::cuda::simt {

// acc[i][4g + e] += sum_q At[r + 16i][q] * B[q][64g + 4c + e] over the whole query tile, for the
// key rows i < kRows.
template <class Tr, int kRows = Tr::kTK>
__device__ __forceinline__ void kvres_grad(float (&acc)[Tr::kTK][4 * Tr::kCG], const float* At,
                                           const float* B, int r, int c) {
  const float* a0 = At + r * Tr::kLdP;
  const float* b0 = B + c * 4;
#pragma unroll 4  // (than 2: +2% with the score loops at full width; H200, fp32)
  for (int q = 0; q < Tr::kBlockM; q += 4) {
    float a[Tr::kTK][4];
#pragma unroll
    for (int i = 0; i < kRows; ++i) lds(a[i], a0 + 16 * i * Tr::kLdP + q);
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
      float b[Tr::kCG][4];
#pragma unroll
      for (int g = 0; g < Tr::kCG; ++g) lds(b[g], b0 + (q + qq) * Tr::kLd + 64 * g);
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int g = 0; g < Tr::kCG; ++g)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[i][4 * g + e] = fmaf(a[i][qq], b[g][e], acc[i][4 * g + e]);
    }
  }
}

// Adds dQ[row][d .. d + 3] (dq_row: the row in the fp32 accumulator) with atomics.
__device__ __forceinline__ void add_dq4(float* dq_row, int d, int E, const float (&x)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // One 16-byte reduction instead of four (accumulator rows are 16-byte aligned when E % 4 == 0).
  if (E % 4 == 0 && d + 4 <= E) {
    atomicAdd(reinterpret_cast<float4*>(dq_row + d), make_float4(x[0], x[1], x[2], x[3]));
    return;
  }
#endif
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (d + e < E) atomicAdd(dq_row + d + e, x[e]);
}

// dQ += dS K for the block's query tile (m0) over its first kKeys keys on the tensor cores
// (Tr::kTf32Dq): 8 warps as 4 x 2, warp w owning rows 16 (w / 2) .. + 16 and columns 32 (w % 2)
// .. + 32 (four m16n8k8 atoms). dS is split into TF32 halves as read, K's halves are K - K_lo and
// K_lo (sKlo). The product is summed from zero (the MMA truncates into its accumulator;
// pv_tf32x3.cuh) and added with one 16-byte reduction per atom and lane: quad neighbours swap
// half their values so that each lane holds four adjacent columns of one row.
template <class Tr, int kKeys>
__device__ __forceinline__ void add_dq_tf32x3(float* dq_h, const float* sdSt, const float* sK, const float* sKlo,
                                              int64_t m0, int64_t len_q, int E, int tid) {
  static_assert(Tr::kBlockM == 64 && Tr::kThreads == 256 && Tr::kCG == 1, "warp grid of 4 x 2 over 64 x 64");
  constexpr int kLdP = Tr::kLdP, kLdK = Tr::kLdK;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = 16 * (warp >> 1), col0 = 32 * (warp & 1);
  float acc[4][4];
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll 4
  for (int kb = 0; kb < kKeys; kb += 8) {
    // A = dS (rows x keys), stored transposed: a0..a3 = (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4).
    const float* a = sdSt + (kb + t) * kLdP + row0 + g;
    const float av[4] = {a[0], a[8], a[4 * kLdP], a[4 * kLdP + 8]};
    uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // (a NaN dS stays NaN in lo and reaches dQ)
      const float r = round_tf32(av[e]);
      a_hi[e] = __float_as_uint(r);
      a_lo[e] = __float_as_uint(av[e] - r);
    }
    // B = K (keys x dims): b0, b1 = (t, g), (t + 4, g).
    const float* kh = sK + (kb + t) * kLdK + col0 + g;
    const float* kl = sKlo + (kb + t) * kLdK + col0 + g;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float l0 = kl[8 * n], l1 = kl[4 * kLdK + 8 * n];
      const uint32_t b_lo[2] = {__float_as_uint(l0), __float_as_uint(l1)};
      const uint32_t b_hi[2] = {__float_as_uint(kh[8 * n] - l0), __float_as_uint(kh[4 * kLdK + 8 * n] - l1)};
      mma_tf32(acc[n], a_lo, b_hi);
      mma_tf32(acc[n], a_hi, b_lo);
      mma_tf32(acc[n], a_hi, b_hi);
    }
  }
  // Lane (g, t) holds rows g, g + 8 at columns 2t, 2t + 1 of each atom. Even t keeps row g and
  // takes its right neighbour's; odd t keeps row g + 8 and takes its left neighbour's.
  const bool even = (t & 1) == 0;
  const int row = row0 + g + (even ? 0 : 8);
  float* dq_row = dq_h + (m0 + row) * E;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const float x0 = __shfl_xor_sync(0xffffffffu, even ? acc[n][2] : acc[n][0], 1);
    const float x1 = __shfl_xor_sync(0xffffffffu, even ? acc[n][3] : acc[n][1], 1);
    const int d = col0 + 8 * n + 2 * (t & ~1);
    if (m0 + row < len_q) {
      if (even) add_dq4(dq_row, d, E, {acc[n][0], acc[n][1], x0, x1});
      else add_dq4(dq_row, d, E, {x0, x1, acc[n][2], acc[n][3]});
    }
  }
}

// dQ of the query tile at m0 in fp32 FMAs: dQ[r*4 + i][64g + 4c + e] += sum_n dS^T[n][r*4 + i]
// K[n][64g + 4c + e] over the keys that see the tile (over_seen_rows: the kernel's count of key rows
// per thread; the blind half's dS is 0), added into the head's accumulator dq_h (E columns, p.len_q rows).
template <class Tr, class OverSeenRows>
__device__ __forceinline__ void add_dq_fp32(float* dq_h, const float* sdSt, const float* sK, int64_t m0,
                                            const BwdParams& p, int E, int r, int c, OverSeenRows&& over_seen_rows) {
  constexpr int kTQ = Tr::kTQ, kCG = Tr::kCG, kLdK = Tr::kLdK, kLdP = Tr::kLdP;
  float dq[kTQ][4 * kCG];
#pragma unroll
  for (int i = 0; i < kTQ; ++i)
#pragma unroll
    for (int d = 0; d < 4 * kCG; ++d) dq[i][d] = 0.f;
  over_seen_rows([&](auto rows) {
    constexpr int kKeys = 16 * decltype(rows)::value;
#pragma unroll 4
    for (int n = 0; n < kKeys; ++n) {
      float a[kTQ], bk[kCG][4];
      lds(a, sdSt + n * kLdP + r * kTQ);
#pragma unroll
      for (int g = 0; g < kCG; ++g) lds(bk[g], sK + n * kLdK + 64 * g + 4 * c);
#pragma unroll
      for (int i = 0; i < kTQ; ++i)
#pragma unroll
        for (int g = 0; g < kCG; ++g)
#pragma unroll
          for (int e = 0; e < 4; ++e) dq[i][4 * g + e] = fmaf(a[i], bk[g][e], dq[i][4 * g + e]);
    }
  });
#pragma unroll
  for (int i = 0; i < kTQ; ++i) {
    const int64_t m = m0 + r * kTQ + i;
    if (m >= p.len_q) continue;
#pragma unroll
    for (int g = 0; g < kCG; ++g)
      add_dq4(dq_h + m * E, 64 * g + 4 * c, E, {dq[i][4 * g], dq[i][4 * g + 1], dq[i][4 * g + 2], dq[i][4 * g + 3]});
  }
}

template <class T, int kDim>
__global__ void __launch_bounds__(KvresTraits<kDim>::kThreads, 1)
    bwd_dkdv_kvres_kernel(const BwdParams p, const float* dsum_g, float* dq_accum,
                          int num_n_tiles, bool vec) {
  using Tr = KvresTraits<kDim>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Tr::kBlockM, kBN = Tr::kBlockN, kTK = Tr::kTK, kTQ = Tr::kTQ;
  constexpr int kCG = Tr::kCG, kLd = Tr::kLd, kLdK = Tr::kLdK, kLdP = Tr::kLdP, kNT = Tr::kThreads;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sK = reinterpret_cast<float*>(smem_raw);
  float* sV = sK + kBN * kLdK;
  float* sQ = sV + kBN * kLd;
  float* sdO = sQ + kBM * kLd;
  float* sPt = sdO + kBM * kLd;
  float* sdSt = sPt + kBN * kLdP;
  float* sKlo = sdSt + kBN * kLdP;  // kTf32Dq

  // Key tiles seen by the most query tiles (the first ones, under causal masking) go first.
  const TileBlock blk = tile_block(num_n_tiles, 1, p.heads_kv, /*heaviest_first=*/false);
  const int nt = blk.tile;
  const int64_t hk = blk.head, b = blk.batch;
  const int64_t group = p.heads_q / p.heads_kv;

  const int tid = threadIdx.x, r = tid >> 4, c = tid & 15;
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const int64_t n0 = int64_t(nt) * kBN;
  const int rows_k = int(p.len_k - n0 < kBN ? p.len_k - n0 : kBN);
  const Seq sq = plain_sequence(p, b);  // this kernel serves calls without optional features
  const float score_scale = Exp::score_scale(p.scale);

  const int64_t first_row = sq.row_begin(n0);  // len_q when no row sees key n0
  const int64_t m_begin = first_row / kBM * kBM;
  const int64_t tiles_per_head = first_row < p.len_q ? (p.len_q - m_begin + kBM - 1) / kBM : 0;
  const int64_t num_iters = tiles_per_head * group;
  // The walk: the query tiles m_begin, m_begin + kBM, ... of head hk * group, then of the next
  // head, advanced by addition (as a 64-bit division per tile it cost a call to the division
  // routine in each of the three places that needed it).
  const int64_t m_end = m_begin + tiles_per_head * kBM;
  auto advance = [&](int64_t& h, int64_t& m0) {
    m0 += kBM;
    if (m0 == m_end) {
      m0 = m_begin;
      ++h;
    }
  };
  auto load_q = [&](int64_t h, int64_t m0) {
    const int rows_q = int(p.len_q - m0 < kBM ? p.len_q - m0 : kBM);
    load_tile_x4<kBM, kDim, kNT>(sQ, kLd, sq.q_rows<const T>(p.q, p.q_stride, h, m0),
                                 p.q_stride.row, rows_q, E, vec, tid);
    cp_async_commit();
  };
  auto load_do = [&](int64_t h, int64_t m0) {
    const int rows_q = int(p.len_q - m0 < kBM ? p.len_q - m0 : kBM);
    load_tile_x4<kBM, kDim, kNT>(sdO, kLd, sq.q_rows<const T>(p.dout, p.dout_stride, h, m0),
                                 p.dout_stride.row, rows_q, Ev, vec, tid);
    cp_async_commit();
  };
  // Copy groups in flight, oldest first: [K, V, dO 0] [Q 0], then per tile [dO next] [Q next]
  // (empty groups past the last tile), so waiting for all but the newest one means "dO has
  // landed" and waiting for all means "Q has landed".
  if (num_iters > 0) {
    const T* k = sq.k_rows<const T>(p.k, p.k_stride, hk, n0);
    const T* v = sq.k_rows<const T>(p.v, p.v_stride, hk, n0);
    load_tile_x4<kBN, kDim, kNT>(sK, kLdK, k, p.k_stride.row, rows_k, E, vec, tid);
    load_tile_x4<kBN, kDim, kNT>(sV, kLd, v, p.v_stride.row, rows_k, Ev, vec, tid);
    load_do(hk * group, m_begin);
    load_q(hk * group, m_begin);
    if constexpr (Tr::kTf32Dq) {
      // K's low TF32 halves, by each thread for the part it copied (0 where K is not finite, so
      // that hi = K - lo keeps inf and NaN); the first tile's barrier publishes them.
      cp_async_wait<1>();
      split_tile_tf32<kBN, kDim, kNT, /*kKeepX=*/true>(sK, sKlo, kLdK, tid);
    }
  }

  float dk[kTK][4 * kCG], dv[kTK][4 * kCG];
#pragma unroll
  for (int i = 0; i < kTK; ++i)
#pragma unroll
    for (int d = 0; d < 4 * kCG; ++d) dk[i][d] = dv[i][d] = 0.f;

  int64_t h = hk * group, m0 = m_begin;  // this tile
  int64_t h_next = h, m_next = m0;       // the next one
  advance(h_next, m_next);
  for (int64_t it = 0; it < num_iters; ++it) {
    const int64_t bh = b * p.heads_q + h;
    // LSE (exponent domain) and D of the thread's query columns; rows past len_q get
    // LSE = -inf, which masks them.
    float lse[kTQ], dsum[kTQ];
#pragma unroll
    for (int j = 0; j < kTQ; ++j) {
      const int64_t m = m0 + c + 16 * j;
      const bool ok = m < p.len_q;
      lse[j] = ok ? Exp::from_lse(static_cast<const float*>(p.lse)[bh * p.len_q + m])
                  : neg_inf<float>();
      dsum[j] = ok ? dsum_g[bh * p.len_q + m] : 0.f;
    }

    float s[kTK][kTQ], dp[kTK][kTQ];
#pragma unroll
    for (int i = 0; i < kTK; ++i)
#pragma unroll
      for (int j = 0; j < kTQ; ++j) s[i][j] = dp[i][j] = 0.f;
    // Keys of the tile that some row of the query tile sees: fewer than kBN in a ragged last tile
    // (e.g. 32 of 96 at L = 2048) and, with key tiles taller than query tiles, on the causal
    // diagonal. The products skip the key rows past them (the mask below makes their P and dS 0).
    const int64_t band_keys = sq.key_end(m0 + kBM - 1) - n0;
    const int seen_keys = band_keys < rows_k ? int(band_keys) : rows_k;
    // Calls f with the number of key rows per thread that cover the seen keys: kTK / 2 or kTK
    // (H200, fp32: +0.2..+1.8% over the causal-only half; a third count, 4 of 6 rows for 64-key
    // tails at dim 128, measured +2.8% at L = 1024 but -1.6..-4.9% causal at L <= 2048).
    auto over_seen_rows = [&](auto f) {
      if (seen_keys <= 16 * (kTK / 2)) f(std::integral_constant<int, kTK / 2>{});
      else f(std::integral_constant<int, kTK>{});
    };
    cp_async_wait<1>();
    __syncthreads();  // K, V and this dO visible to all
    over_seen_rows([&](auto rows) {
      constexpr int kRows = decltype(rows)::value;
      gemm_rows_x_rows_interleaved<kTK, kTQ, kLd, 16, kDim, 0, kRows>(dp, sV, sdO, r, c);
      cp_async_wait<0>();
      __syncthreads();  // this Q visible to all
      gemm_rows_x_rows_interleaved<kTK, kTQ, kLdK, 16, kDim, 0, kRows, 16, 4, kLd>(s, sK, sQ, r, c);
    });

    // P = exp(scale S - LSE), dS = P (dP - D); both 0 wherever the key is not visible, so
    // values there (even NaN/inf) never reach a gradient. Tiles every row sees in full (most
    // of them) take a copy of the loop without the per-element mask (with a run-time test
    // instead, ptxas if-converted the mask's 64-bit compares into every element: 792 -> 261
    // instructions per query tile at dim 64, 409 -> 133 at 128).
    auto p_and_ds = [&](auto masked) {
#pragma unroll
      for (int i = 0; i < kTK; ++i) {
#pragma unroll
        for (int j = 0; j < kTQ; ++j) {
          bool vis = lse[j] != neg_inf<float>();
          if constexpr (decltype(masked)::value) {
            const int64_t n = n0 + r + 16 * i;
            vis = vis && n < p.len_k && sq.band.visible(m0 + c + 16 * j, n);
          }
          const float pr = Exp::exp_if(vis, fmaf(s[i][j], score_scale, -lse[j]));
          sPt[(r + 16 * i) * kLdP + c + 16 * j] = pr;
          sdSt[(r + 16 * i) * kLdP + c + 16 * j] = vis ? pr * (dp[i][j] - dsum[j]) : 0.f;
        }
      }
    };
    if (n0 + kBN <= sq.key_end(m0)) p_and_ds(std::false_type{}); else p_and_ds(std::true_type{});
    __syncthreads();  // P^T and dS^T visible to all
    over_seen_rows([&](auto rows) { kvres_grad<Tr, decltype(rows)::value>(dv, sPt, sdO, r, c); });
    __syncthreads();  // sdO free
    if (it + 1 < num_iters) load_do(h_next, m_next); else cp_async_commit();
    over_seen_rows([&](auto rows) { kvres_grad<Tr, decltype(rows)::value>(dk, sdSt, sQ, r, c); });
    if (dq_accum) {
      float* dq_h = dq_accum + bh * p.len_q * E;
      if constexpr (Tr::kTf32Dq) {
        over_seen_rows([&](auto rows) {
          add_dq_tf32x3<Tr, 16 * decltype(rows)::value>(dq_h, sdSt, sK, sKlo, m0, p.len_q, E, tid);
        });
      } else {
        add_dq_fp32<Tr>(dq_h, sdSt, sK, m0, p, E, r, c, over_seen_rows);
      }
    }
    __syncthreads();  // sQ, sdSt free
    if (it + 1 < num_iters) load_q(h_next, m_next); else cp_async_commit();
    h = h_next;
    m0 = m_next;
    advance(h_next, m_next);
  }

  T* dk_g = sq.k_rows<T>(p.dk, p.dk_stride, hk, 0);
  T* dv_g = sq.k_rows<T>(p.dv, p.dv_stride, hk, 0);
  const float scale = float(p.scale);
#pragma unroll
  for (int i = 0; i < kTK; ++i) {
    const int64_t n = n0 + r + 16 * i;
    if (n >= p.len_k) continue;
#pragma unroll
    for (int g = 0; g < kCG; ++g)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = 64 * g + 4 * c + e;
        if (d < E) dk_g[n * p.dk_stride.row + d] = from_acc<T>(dk[i][4 * g + e] * scale);
        if (d < Ev) dv_g[n * p.dv_stride.row + d] = from_acc<T>(dv[i][4 * g + e]);
      }
  }
}

template <class T, int kDim>
bool bwd_dkdv_kvres(const BwdParams& p, const void* dsum, void* dq_accum, cudaStream_t stream) {
  using Tr = KvresTraits<kDim>;
  if (p.has_features()) return false;  // the optional features are in the general SIMT kernels only
  if (Tr::kSmemBytes > device_limits().smem_optin) return false;
  const int64_t num_n_tiles = (p.len_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const int64_t blocks = num_n_tiles * p.heads_kv * p.batch;
  if (grid_too_large(blocks, "bwd_dkdv_kvres_kernel")) return true;
  const bool vec =
      rows_aligned_x4<T>(p.q, p.q_stride.batch, p.q_stride.head, p.q_stride.row) &&
      rows_aligned_x4<T>(p.k, p.k_stride.batch, p.k_stride.head, p.k_stride.row) &&
      rows_aligned_x4<T>(p.v, p.v_stride.batch, p.v_stride.head, p.v_stride.row) &&
      rows_aligned_x4<T>(p.dout, p.dout_stride.batch, p.dout_stride.head, p.dout_stride.row);
  auto kernel = bwd_dkdv_kvres_kernel<T, kDim>;
  set_smem(kernel, Tr::kSmemBytes, "bwd_dkdv_kvres_kernel");
  kernel<<<unsigned(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(
      p, static_cast<const float*>(dsum), static_cast<float*>(dq_accum), int(num_n_tiles), vec);
  check_launch("bwd_dkdv_kvres_kernel");
  return true;
}

}  // namespace flashattn::cuda::simt
