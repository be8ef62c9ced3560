// Forward SIMT kernel with the query tile resident in smem, for fp32 accumulation and head dims up
// to kDim (64 or 128) on both Q/K and V. One block of 256 threads per (batch, query head, 128-row
// query tile): Q is loaded once; per key tile (kKeys: 64, or 128 for fp32 at dim 64, see fwd_qres),
// S = Q K^T is formed in registers, the online softmax turns it into P (kept in smem) and O += P V
// accumulates in registers. K and V have a buffer each, so the next K loads (cp.async) during P V
// and the next V during Q K^T.
//
// Thread (r, c) = (tid / 16, tid % 16) owns query rows r + 16i (i < 8), key columns c + 16j (j <
// kKeys / 16) and output columns g*64 + c*4 + e. Eight rows per thread make both products FMA-bound
// rather than smem-bound (12 16-byte loads per 128 FMAs while scoring); interleaving the rows (r +
// 16i rather than 8r + i) puts the two row groups of a warp on different banks, so the broadcast
// loads of Q and P are single wavefronts. Row statistics reduce over one half-warp.
//
// kTf32Pv (fp32 on sm_80+): O += P V runs on the tensor cores at fp32 accuracy instead
// (pv_tf32x3.cuh: three TF32 products per tile), each warp owning 32 rows x kDim / 2 columns of O;
// the scores stay on the FMA product above; the rows' rescale factors and final 1 / l reach the
// warps through smem. (At dim 128 fp32 takes fwd_simt_ws.cuh instead, which puts the two
// products on different warps; this file keeps the dim-64 variants and the FMA P V.)
//
// Wider dims, fp64, and devices with too little smem use the chunked kernel of fwd_simt.cuh.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../common/sequence.h"
#include "../common/check.h"
#include "../common/grid.cuh"
#include "../common/online_softmax.cuh"
#include "../plan.h"
#include "fwd_simt_ws.cuh"
#include "launch.h"
#include "pv_tf32x3.cuh"
#include "resident_config.h"
#include "scale_scores.cuh"
#include "smem_vec.cuh"
#include "tile_gemm.cuh"
#include "tile_load_x4.cuh"

namespace flashattn::cuda::simt {

template <class T, int kDim, bool kTf32Pv, int kKeys>
__global__ void __launch_bounds__(QresTraits<kDim, kTf32Pv, kKeys>::kThreads, 1)
    fwd_qres_kernel(const FwdParams p, int num_m_tiles, bool vec) {
  using Tr = QresTraits<kDim, kTf32Pv, kKeys>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Tr::kBlockM, kBN = Tr::kBlockN, kTM = Tr::kTM, kTN = Tr::kTN;
  constexpr int kCG = Tr::kCG, kLd = Tr::kLd, kLdP = Tr::kLdP, kNT = Tr::kThreads;
  constexpr int kRG = Tr::kRowGroups;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);
  float* sK = sQ + kBM * kLd;
  float* sV = sK + kBN * kLd;
  float* sVlo = sV + kBN * kLd;                       // kTf32Pv
  float* sP = sVlo + (kTf32Pv ? kBN * kLd : 0);
  float* sRow = sP + kBM * kLdP;                      // kTf32Pv: alpha per row, then 1 / l

  const TileBlock blk = tile_block(num_m_tiles, 1, p.heads_q, /*heaviest_first=*/true);
  const int mt = blk.tile;
  const int64_t h = blk.head, b = blk.batch, hk = kv_head(p, h);

  const int tid = threadIdx.x, r = tid >> 4, c = tid & 15, warp = tid >> 5, lane = tid & 31;
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const int64_t m0 = int64_t(mt) * kBM;
  const int rows_q = int(p.len_q - m0 < kBM ? p.len_q - m0 : kBM);
  const Seq sq = plain_sequence(p, b);  // this kernel serves calls without optional features
  const float score_scale = Exp::score_scale(p.scale);

  const T* q = sq.q_rows<const T>(p.q, p.q_stride, h, m0);
  const T* k = sq.k_rows<const T>(p.k, p.k_stride, hk, 0);
  const T* v = sq.k_rows<const T>(p.v, p.v_stride, hk, 0);

  const int64_t n_end = sq.key_end(m0 + rows_q - 1);
  auto load_k = [&](int64_t n0) {
    const int rows_k = int(p.len_k - n0 < kBN ? p.len_k - n0 : kBN);
    load_tile_x4<kBN, kDim, kNT>(sK, kLd, k + n0 * p.k_stride.row, p.k_stride.row, rows_k, E,
                                 vec, tid);
    cp_async_commit();
  };
  auto load_v = [&](int64_t n0) {
    const int rows_k = int(p.len_k - n0 < kBN ? p.len_k - n0 : kBN);
    load_tile_x4<kBN, kDim, kNT>(sV, kLd, v + n0 * p.v_stride.row, p.v_stride.row, rows_k, Ev,
                                 vec, tid);
    cp_async_commit();
  };
  // Copy groups in flight, oldest first: [Q, K0] [V0], then per tile [K next] [V next] (empty
  // groups past the last tile), so waiting for all but the newest one always means "the
  // buffer about to be read has landed".
  if (n_end > 0) {
    load_tile_x4<kBM, kDim, kNT>(sQ, kLd, q, p.q_stride.row, rows_q, E, vec, tid);
    load_k(0);
    load_v(0);
  }

  // O: per thread (FMA P V) or as the warp's accumulator atoms (kTf32Pv, pv_tf32x3.cuh).
  using Pv = PvTf32x3<kBN, kDim, kLd, kLdP>;
  float acc[kTf32Pv ? 1 : kTM][kTf32Pv ? 1 : 4 * kCG];
  float o[2][kTf32Pv ? Pv::kNA : 1][4];
  float row_max[kTM], row_sum[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    row_max[i] = neg_inf<float>();
    row_sum[i] = 0.f;
#pragma unroll
    for (int d = 0; d < 4 * kCG; ++d)
      if constexpr (!kTf32Pv) acc[i][d] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int n = 0; n < (kTf32Pv ? Pv::kNA : 0); ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][n][e] = 0.f;

  for (int64_t n0 = 0; n0 < n_end; n0 += kBN) {
    cp_async_wait<1>();
    __syncthreads();  // Q and this K visible to all

    float s[kTM][kTN];
#pragma unroll
    for (int i = 0; i < kTM; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j) s[i][j] = 0.f;
    // Where the block's first kBM / 2 rows see no key of the tile (the second of the causal
    // diagonal's two 64-key tiles), their scores (i < kTM / 2) and their warps' P V are skipped:
    // the mask below makes those scores -inf, so their P is 0 and alpha 1.
    const bool first_half_blind = n0 >= sq.key_end(m0 + kBM / 2 - 1);
    if (first_half_blind)
      gemm_rows_x_rows_interleaved<kTM, kTN, kLd, kRG, kDim, kTM / 2>(s, sQ, sK, r, c);
    else
      gemm_rows_x_rows_interleaved<kTM, kTN, kLd, kRG, kDim>(s, sQ, sK, r, c);
    __syncthreads();  // sK free; the previous P V product is done with sP
    if (n0 + kBN < n_end) load_k(n0 + kBN); else cp_async_commit();

    scale_scores<kRG, 16, kBN>(s, score_scale, p, sq, m0, n0, r, c);  // (-inf where not visible)
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const float alpha = online_softmax_step<16>(s[i], row_max[i], row_sum[i]);
      if constexpr (kTf32Pv) {
        if (c == 0) sRow[r + kRG * i] = alpha;
      } else {
#pragma unroll
        for (int d = 0; d < 4 * kCG; ++d) acc[i][d] *= alpha;
      }
#pragma unroll
      for (int j = 0; j < kTN; ++j) sP[(r + kRG * i) * kLdP + c + 16 * j] = s[i][j];
    }

    cp_async_wait<1>();
    if constexpr (kTf32Pv) {
      // This thread's part of V (landed for it) split in place; then P, alpha and V visible to all.
      const bool exact = __syncthreads_or(split_tile_tf32<kBN, kDim, kNT>(sV, sVlo, kLd, tid));
      if (!first_half_blind || Pv::row0(warp) >= kBM / 2) Pv::run(o, sP, sV, sVlo, sRow, exact, warp, lane);
    } else {
      __syncthreads();  // P and this V visible to all
      const float* a0 = sP + r * kLdP;
      const float* b0 = sV + c * 4;
#pragma unroll 2
      for (int n = 0; n < kBN; n += 4) {
        float a[kTM][4];
#pragma unroll
        for (int i = 0; i < kTM; ++i) lds(a[i], a0 + kRG * i * kLdP + n);
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          float bv[kCG][4];
#pragma unroll
          for (int g = 0; g < kCG; ++g) lds(bv[g], b0 + (n + nn) * kLd + 64 * g);
#pragma unroll
          for (int i = 0; i < kTM; ++i)
#pragma unroll
            for (int g = 0; g < kCG; ++g)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[i][4 * g + e] = fmaf(a[i][nn], bv[g][e], acc[i][4 * g + e]);
        }
      }
    }
    __syncthreads();  // sV free
    if (n0 + kBN < n_end) load_v(n0 + kBN); else cp_async_commit();
  }

  T* out = sq.q_rows<T>(p.out, p.out_stride, h, 0);
  float* lse = static_cast<float*>(p.lse) + (b * p.heads_q + h) * p.len_q;
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const float l = reduce_sum_lanes<16>(row_sum[i]);
    const int64_t m = m0 + r + kRG * i;
    // l == 0 only when no key is visible: out = 0, lse = -inf. A NaN l propagates.
    const bool empty = l == 0.f;
    const float inv = empty ? 0.f : 1.f / l;
    if constexpr (kTf32Pv) {
      if (c == 0) sRow[r + kRG * i] = inv;  // (the last P V has read the alphas: barrier above)
    } else if (m < p.len_q) {
      T* orow = out + m * p.out_stride.row;
#pragma unroll
      for (int g = 0; g < kCG; ++g)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = 64 * g + c * 4 + e;
          if (d < Ev) orow[d] = from_acc<T>(acc[i][4 * g + e] * inv);
        }
    }
    if (c == 0 && m < p.len_q) lse[m] = empty ? neg_inf<float>() : Exp::lse(row_max[i], l);
  }
  if constexpr (kTf32Pv) {
    static_assert(kBM == 128 && kNT == 256, "8 warps as 4 x 2 cover 128 rows of O");
    __syncthreads();  // 1 / l of every row visible to all
    Pv::store(o, [&](int, int, int row) { return sRow[row]; }, out + m0 * p.out_stride.row, p.out_stride.row,
              p.len_q - m0, Ev, warp, lane);
  }
}

template <class T, int kDim, bool kTf32Pv, int kKeys = 64>
bool launch_fwd_qres(const FwdParams& p, cudaStream_t stream) {
  using Tr = QresTraits<kDim, kTf32Pv, kKeys>;
  if (Tr::kSmemBytes > device_limits().smem_optin) return false;
  const int64_t num_m_tiles = (p.len_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t blocks = num_m_tiles * p.heads_q * p.batch;
  if (grid_too_large(blocks, "fwd_simt_qres_kernel")) return true;
  const bool vec = rows_aligned_x4<T>(p.q, p.q_stride.batch, p.q_stride.head, p.q_stride.row) &&
                   rows_aligned_x4<T>(p.k, p.k_stride.batch, p.k_stride.head, p.k_stride.row) &&
                   rows_aligned_x4<T>(p.v, p.v_stride.batch, p.v_stride.head, p.v_stride.row);
  auto kernel = fwd_qres_kernel<T, kDim, kTf32Pv, kKeys>;
  set_smem(kernel, Tr::kSmemBytes, "fwd_qres_kernel");
  kernel<<<unsigned(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, int(num_m_tiles), vec);
  check_launch("fwd_qres_kernel");
  return true;
}

// The plan's kSimtWs / kSimtQres (tf32_keys: the key tile of the TF32 P V, 0 for FMA products). fp32
// on sm_80+ (unless FLASHATTN_CUDA_KERNELS=simt) takes the TF32x3 P V: at dim 128 in the
// warp-specialized kernel (fwd_simt_ws.cuh: 202 KB of smem, so sm_90 / sm_100; +6-8% over this
// kernel's TF32x3 variant on the H200, which it replaces: no GPU has smem for one and not the
// other), at dim 64 here (H200: +-1% over the FMA P V with the score loop unrolled by 2, +10% by 4,
// where ptxas allocates the FMA variant differently), with 128-key tiles where 209 KB of smem fit
// (sm_90, sm_100: +4-10% over 64-key tiles on the H200: twice the FMAs per K load, half the
// barriers and row reductions per key), else 64-key ones (124 KB: sm_80); fp16/bf16 (here only
// for calls the tensor-core kernels decline) the FMA one at dim 128. (At dim 64 fp16 / bf16 take the
// general kernel, fwd_simt.cuh: 1.09-1.16x this one's speed on the H100, E = 36.)
template <class T, int kDim>
bool fwd_qres(const FwdParams& p, FwdKernel kernel, int tf32_keys, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (kDim == 128) {
      if (kernel == FwdKernel::kSimtWs) return launch_fwd_ws<kDim>(p, stream);
    } else {
      if (tf32_keys == 128) return launch_fwd_qres<T, kDim, true, 128>(p, stream);
      if (tf32_keys == 64) return launch_fwd_qres<T, kDim, true>(p, stream);
    }
  }
  return kernel == FwdKernel::kSimtQres && tf32_keys == 0 && launch_fwd_qres<T, kDim, false>(p, stream);
}

}  // namespace flashattn::cuda::simt
