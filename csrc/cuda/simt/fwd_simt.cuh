// Forward SIMT kernel: one block per (batch, query head, query tile, output-column slice).
// Query and key tiles are streamed through smem in head-dim chunks to form the score tile in
// registers; the online softmax turns it into probabilities (kept transposed in smem), which
// multiply value chunks into the output accumulator held in registers. O and LSE are written
// once at the end. The optional features (common/features.cuh) act on the score tile in the
// kFeatures variant only, so that the plain one keeps its registers; a variable-length batch
// runs one block per tile of its longest sequence, and blocks past the end of their sequence
// exit.
#pragma once
#include <cstdint>

#include "../common/check.h"
#include "../common/features.cuh"
#include "../common/grid.cuh"
#include "../common/online_softmax.cuh"
#include "launch.h"
#include "tile_config.cuh"
#include "tile_gemm.cuh"
#include "tile_load.cuh"

namespace flashattn::cuda::simt {

template <class T, int kTier>
struct FwdTraits : SimtTraits<T, kTier> {
  using Base = SimtTraits<T, kTier>;
  using Acc = typename Base::Acc;
  static constexpr int kChunkK = Base::Tile::kChunkK;
  static constexpr int kLdK = kChunkK + Base::kPad;
  // Q and K chunks while scoring; the V chunk reuses that space.
  static constexpr int kChunkElems =
      cmax(2 * Base::kBlock * kLdK, Base::kBlock * Base::kLdChunk);
  static constexpr size_t kSmemBytes =
      size_t(kChunkElems + Base::kBlock * Base::kLdP) * sizeof(Acc);
};

template <class T, int kTier, bool kFeatures>
__global__ void __launch_bounds__(FwdTraits<T, kTier>::kThreads, 2)
    fwd_simt_kernel(const FwdParams p, int num_m_tiles, int num_splits) {
  using Tr = FwdTraits<T, kTier>;
  using Acc = typename Tr::Acc;
  using Exp = ExpDomain<Acc>;
  constexpr int kB = Tr::kBlock, kTN = Tr::kTN, kVec = Tr::kVec, kNC = Tr::kNumChunks;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* sQ = reinterpret_cast<Acc*>(smem_raw);
  Acc* sK = sQ + kB * Tr::kLdK;
  Acc* sV = sQ;
  Acc* sPt = sQ + Tr::kChunkElems;

  const TileBlock blk = tile_block(num_m_tiles, num_splits, p.heads_q, /*heaviest_first=*/true);
  const int mt = blk.tile, split = blk.split;
  const int64_t h = blk.head, hk = kv_head(p, h);
  const Seq sq = kFeatures ? sequence(p, blk.batch) : plain_sequence(p, blk.batch);
  const int64_t m0 = int64_t(mt) * kB;
  if (m0 >= sq.len_q) return;  // past the end of a shorter sequence (the whole block)

  const int tid = threadIdx.x, r = tid >> 4, c = tid & 15;
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const int d0 = split * kTier;
  const int rows_q = int(sq.len_q - m0 < kB ? sq.len_q - m0 : kB);
  const Acc score_scale = Exp::score_scale(p.scale);
  const Acc to_domain = Exp::score_scale(1.0);  // natural-log scores -> the exponent domain
  const ScoreMods<Acc> mods(p, sq, h);
  const DropoutMask<Acc> drop(p, sq, h);

  const T* q = sq.q_rows<const T>(p.q, p.q_stride, h, m0);
  const T* k = sq.k_rows<const T>(p.k, p.k_stride, hk, 0);
  const T* v = sq.k_rows<const T>(p.v, p.v_stride, hk, 0);

  Acc acc[kNC][4][kVec];
  Acc row_max[4], row_sum[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    row_max[i] = neg_inf<Acc>();
    row_sum[i] = 0;
#pragma unroll
    for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[ch][i][e] = 0;
  }

  // The band of visible keys moves right with the row; key tiles outside it are skipped.
  const int64_t n_end = sq.key_end(m0 + rows_q - 1);
  for (int64_t n0 = sq.key_begin(m0) / kB * kB; n0 < n_end; n0 += kB) {
    const int rows_k = int(sq.len_k - n0 < kB ? sq.len_k - n0 : kB);
    Acc s[4][kTN];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j) s[i][j] = 0;

    for (int kc = 0; kc < E; kc += Tr::kChunkK) {
      __syncthreads();  // previous users of sQ/sK (and sV, sPt) are done
      load_tile<kB, Tr::kChunkK, Tr::kThreads>(sQ, Tr::kLdK, q + kc, p.q_stride.row, rows_q,
                                               E - kc, tid);
      load_tile<kB, Tr::kChunkK, Tr::kThreads>(sK, Tr::kLdK, k + n0 * p.k_stride.row + kc,
                                               p.k_stride.row, rows_k, E - kc, tid);
      __syncthreads();
      gemm_rows_x_rows<Tr::kChunkK>(s, sQ, Tr::kLdK, sK, Tr::kLdK, E - kc, r, c);
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t m = m0 + r * 4 + i;
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const int64_t n = n0 + c + 16 * j;
        const bool vis = n < sq.len_k && sq.band.visible(m, n);
        if (!kFeatures || !mods.any) {
          s[i][j] = vis ? s[i][j] * score_scale : neg_inf<Acc>();
        } else {
          Acc th;
          const bool in = vis && m < sq.len_q;  // the bias is read only in range
          s[i][j] = in ? mods.score(s[i][j], m, n, &th) * to_domain : neg_inf<Acc>();
        }
      }
      const Acc alpha = online_softmax_step<16>(s[i], row_max[i], row_sum[i]);
      if (kFeatures && drop.on) {  // row_sum keeps every probability; only P V sees the dropped ones as 0
#pragma unroll
        for (int j = 0; j < kTN; ++j)
          if (!drop.keep(m, n0 + c + 16 * j)) s[i][j] = 0;
      }
#pragma unroll
      for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[ch][i][e] *= alpha;
    }
#pragma unroll
    for (int j = 0; j < kTN; ++j) sts4(sPt + (c + 16 * j) * Tr::kLdP + r * 4, s[0][j], s[1][j], s[2][j], s[3][j]);

#pragma unroll
    for (int ch = 0; ch < kNC; ++ch) {
      const int dc = d0 + ch * Tr::kChunkCols;
      if (dc < Ev) {
        __syncthreads();  // sPt written, scoring reads of sQ/sK (or the last chunk) done
        load_tile<kB, Tr::kChunkCols, Tr::kThreads>(sV, Tr::kLdChunk, v + n0 * p.v_stride.row + dc,
                                                    p.v_stride.row, rows_k, Ev - dc, tid);
        __syncthreads();
        gemm_cols_x_rows<kB, kVec>(acc[ch], sPt, Tr::kLdP, sV, Tr::kLdChunk, r, c);
      }
    }
  }

  T* out = sq.q_rows<T>(p.out, p.out_stride, h, 0);
  Acc* lse = static_cast<Acc*>(p.lse) + sq.row_index(p.heads_q, h, 0);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const Acc l = sq.row_sum(reduce_sum_lanes<16>(row_sum[i]));
    const int64_t m = m0 + r * 4 + i;
    if (m >= sq.len_q) continue;
    // l == 0 only when no key is visible: out = 0, lse = -inf. A NaN l (an invalid sequence's
    // too) propagates.
    const bool empty = l == Acc(0);
    const Acc inv = empty ? Acc(0) : (kFeatures && drop.on ? drop.inv_keep : Acc(1)) / l;
    T* o = out + m * p.out_stride.row;
#pragma unroll
    for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int d = d0 + ch * Tr::kChunkCols + c * kVec + e;
        if (d < Ev) o[d] = from_acc<T>(acc[ch][i][e] * inv);
      }
    if (split == 0 && c == 0) lse[m] = empty ? neg_inf<Acc>() : Exp::lse(row_max[i], l);
  }
}

template <class T, int kTier>
void fwd(const FwdParams& p, int num_splits, cudaStream_t stream) {
  using Tr = FwdTraits<T, kTier>;
  const int64_t num_m_tiles = (p.len_q + Tr::kBlock - 1) / Tr::kBlock;
  const int64_t blocks = num_m_tiles * num_splits * p.heads_q * p.batch;
  if (grid_too_large(blocks, "fwd_simt_kernel")) return;
  auto kernel = p.has_features() ? fwd_simt_kernel<T, kTier, true> : fwd_simt_kernel<T, kTier, false>;
  set_smem(kernel, Tr::kSmemBytes, "fwd_simt_kernel");
  kernel<<<unsigned(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, int(num_m_tiles), num_splits);
  check_launch("fwd_simt_kernel");
}

}  // namespace flashattn::cuda::simt
