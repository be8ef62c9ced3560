// Backward SIMT kernels.
//
// bwd_dkdv_simt_kernel: one block per (batch, kv head, key tile, output-column slice). It keeps
// dK and dV of its key tile in registers and loops over every query head of its GQA group and
// every query tile that sees the key tile: scores S and dP = dO V^T are recomputed from
// streamed head-dim chunks, P = exp(S - LSE), dS = P (dP - D); P and dS go to smem transposed
// ([key][query]) and multiply streamed chunks of dO, Q (dV += P^T dO, dK += dS^T Q) and, on the
// atomic path, K (dQ += dS K, added with atomics into an accumulator).
//
// bwd_dq_simt_kernel (deterministic path): one block per (batch, query head, query tile,
// slice) loops over key tiles and keeps dQ in registers, so no atomics are needed.
//
// The optional features (common/features.cuh) act in bwd_probs, in the kFeatures variants
// only (so that the plain ones keep their registers); blocks of a variable-length batch past
// the end of their sequence exit.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../common/check.h"
#include "../common/features.cuh"
#include "../common/grid.cuh"
#include "../common/online_softmax.cuh"
#include "launch.h"
#include "tile_config.cuh"
#include "tile_gemm.cuh"
#include "tile_load.cuh"

namespace flashattn::cuda::simt {

// kWide: 16-byte output vectors (fast, needs > 64 KB of smem for fp32). The narrow variant
// (8-byte vectors, smaller chunks) fits the 64 KB of sm_75.
template <class T, int kTier, bool kWide>
struct BwdTraits : SimtTraits<T, kTier, kWide ? 4 : 2> {
  using Base = SimtTraits<T, kTier, kWide ? 4 : 2>;
  using Acc = typename Base::Acc;
  static constexpr int kBlock = Base::kBlock;
  // Four chunk buffers while scoring, so the chunk is narrower than the forward one.
  static constexpr int kChunkK = cmin(kWide ? 32 : 16, Base::Tile::kChunkK);
  static constexpr int kLdK = kChunkK + Base::kPad;
  // Scoring: Q, K, dO, V chunks. Gradients: dO, Q, K column chunks (same space).
  static constexpr int kScoreElems = 4 * kBlock * kLdK;
  static constexpr int kChunkElems = cmax(kScoreElems, 3 * kBlock * Base::kLdChunk);
  static constexpr int kTileElems = kBlock * Base::kLdP;
  static constexpr size_t kDkdvSmemBytes = size_t(kChunkElems + 2 * kTileElems) * sizeof(Acc);
  static constexpr size_t kDqSmemBytes =
      size_t(cmax(kScoreElems, kBlock * Base::kLdChunk) + kTileElems) * sizeof(Acc);
};

// The dK/dV kernel's variant for the arch being compiled: wide from sm_80 on (and always for fp64,
// whose tiles fit everywhere), narrow below; one kernel per (dtype, tier, features), whose image holds
// the one variant that arch can run. The host picks the same way from the PTX version of its image.
template <class Acc>
__device__ constexpr bool bwd_wide_compiled() {
#ifdef __CUDA_ARCH__
  return std::is_same_v<Acc, double> || __CUDA_ARCH__ >= 800;
#else
  return true;
#endif
}

// S = Q K^T and dP = dO V^T for one (query tile, key tile), over head-dim chunks.
template <class Tr, class T, class Acc = typename Tr::Acc>
__device__ __forceinline__ void bwd_scores(Acc (&s)[4][Tr::kTN], Acc (&dp)[4][Tr::kTN],
                                           Acc* smem, const T* q, int64_t q_row,
                                           const T* dout, int64_t do_row, int rows_q,
                                           const T* k, int64_t k_row, const T* v,
                                           int64_t v_row, int rows_k, int E, int Ev, int tid) {
  constexpr int kB = Tr::kBlock, kKC = Tr::kChunkK, kLd = Tr::kLdK, kNT = Tr::kThreads;
  Acc* sQ = smem;
  Acc* sK = sQ + kB * kLd;
  Acc* sdO = sK + kB * kLd;
  Acc* sV = sdO + kB * kLd;
  const int r = tid >> 4, c = tid & 15;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < Tr::kTN; ++j) s[i][j] = dp[i][j] = 0;
  const int e_max = E > Ev ? E : Ev;
  for (int kc = 0; kc < e_max; kc += kKC) {
    __syncthreads();  // earlier readers of the chunk buffers (and of P/dS) are done
    if (kc < E) {
      load_tile<kB, kKC, kNT>(sQ, kLd, q + kc, q_row, rows_q, E - kc, tid);
      load_tile<kB, kKC, kNT>(sK, kLd, k + kc, k_row, rows_k, E - kc, tid);
    }
    if (kc < Ev) {
      load_tile<kB, kKC, kNT>(sdO, kLd, dout + kc, do_row, rows_q, Ev - kc, tid);
      load_tile<kB, kKC, kNT>(sV, kLd, v + kc, v_row, rows_k, Ev - kc, tid);
    }
    __syncthreads();
    if (kc < E) gemm_rows_x_rows<kKC>(s, sQ, kLd, sK, kLd, E - kc, r, c);
    if (kc < Ev) gemm_rows_x_rows<kKC>(dp, sdO, kLd, sV, kLd, Ev - kc, r, c);
  }
}

// The features of one (sequence, query head) that the backward applies to its tiles; dbias
// (dL/dS of a float bias, (len_q, len_k) row-major for this head) is null unless the block
// writes it.
template <class Acc>
struct BwdFeatures {
  const Seq& sq;
  ScoreMods<Acc> mods;
  DropoutMask<Acc> drop;
  Acc* dbias;
};

// Turns s into P = exp(scale S - LSE) and dp into dS = P (dP - D); both 0 wherever the key is
// not visible (masked, past len_k, row past len_q, or a fully masked row with LSE = -inf), so
// that values there (even NaN/inf) never reach a gradient. With features: S is the score the
// softmax took (softcap, ALiBi, bias), s becomes the probability as P V used it (dropped ones
// 0, kept ones / (1 - p)), dP is masked and scaled the same way, dS goes to dbias before the
// softcap's derivative enters it.
template <class Tr, bool kFeatures, class Acc>
__device__ __forceinline__ void bwd_probs(Acc (&s)[4][Tr::kTN], Acc (&dp)[4][Tr::kTN],
                                          const Acc (&lse)[4], const Acc (&dsum)[4],
                                          int64_t m0, int64_t n0, const BwdFeatures<Acc>& f,
                                          Acc score_scale, int tid) {
  const int r = tid >> 4, c = tid & 15;
  const Seq& sq = f.sq;
  const bool plain = !kFeatures || (!f.mods.any && !f.drop.on && f.dbias == nullptr);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + r * 4 + i;
#pragma unroll
    for (int j = 0; j < Tr::kTN; ++j) {
      const int64_t n = n0 + c + 16 * j;
      const bool vis = lse[i] != neg_inf<Acc>() && n < sq.len_k && sq.band.visible(m, n);
      if (plain) {
        const Acc pr = ExpDomain<Acc>::exp_if(vis, fma(s[i][j], score_scale, -lse[i]));
        dp[i][j] = vis ? pr * (dp[i][j] - dsum[i]) : Acc(0);
        s[i][j] = pr;
        continue;
      }
      Acc th = 0;
      const Acc x = vis ? f.mods.score(s[i][j], m, n, &th) : neg_inf<Acc>();
      feature_grad(s[i][j], dp[i][j], x, vis, th, lse[i], dsum[i], m, n, sq, f.mods, f.drop, f.dbias);
    }
  }
}

// LSE (in the kernel's exponent domain) and D of the thread's 4 query rows; rows past len_q
// get LSE = -inf, which masks them.
template <class Acc>
__device__ __forceinline__ void load_row_stats(Acc (&lse)[4], Acc (&dsum)[4], const Acc* lse_g,
                                               const Acc* d_g, int64_t m0, int64_t len_q,
                                               int tid) {
  const int r = tid >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + r * 4 + i;
    const bool ok = m < len_q;
    lse[i] = ok ? ExpDomain<Acc>::from_lse(lse_g[m]) : neg_inf<Acc>();
    dsum[i] = ok ? d_g[m] : Acc(0);
  }
}

template <class Tr, class Acc>
__device__ __forceinline__ void store_transposed(Acc* dst, const Acc (&x)[4][Tr::kTN], int tid) {
  const int r = tid >> 4, c = tid & 15;
#pragma unroll
  for (int j = 0; j < Tr::kTN; ++j)
    sts4(dst + (c + 16 * j) * Tr::kLdP + r * 4, x[0][j], x[1][j], x[2][j], x[3][j]);
}

template <class T, int kTier, bool kFeatures>
__global__ void __launch_bounds__(BwdTraits<T, kTier, true>::kThreads, 2)
    bwd_dkdv_simt_kernel(const BwdParams p, const acc_t<T>* dsum_g, acc_t<T>* dq_accum,
                         int num_n_tiles, int num_splits) {
  using Tr = BwdTraits<T, kTier, bwd_wide_compiled<acc_t<T>>()>;
  using Acc = typename Tr::Acc;
  constexpr int kB = Tr::kBlock, kTN = Tr::kTN, kVec = Tr::kVec, kNC = Tr::kNumChunks;
  constexpr int kCW = Tr::kChunkCols, kLdC = Tr::kLdChunk, kLdP = Tr::kLdP;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* smem = reinterpret_cast<Acc*>(smem_raw);
  Acc* sdO = smem;  // gradient-phase chunks
  Acc* sQ = sdO + kB * kLdC;
  Acc* sK = sQ + kB * kLdC;
  Acc* sPt = smem + Tr::kChunkElems;
  Acc* sdSt = sPt + Tr::kTileElems;

  const TileBlock blk = tile_block(num_n_tiles, num_splits, p.heads_kv, /*heaviest_first=*/false);
  const int nt = blk.tile, split = blk.split;
  const int64_t hk = blk.head;
  const Seq sq = kFeatures ? sequence(p, blk.batch) : plain_sequence(p, blk.batch);
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n0 = int64_t(nt) * kB;
  if (n0 >= sq.len_k) return;  // past the end of a shorter sequence (the whole block)

  const int tid = threadIdx.x, r = tid >> 4, c = tid & 15;
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const int e_max = E > Ev ? E : Ev;
  const int d0 = split * kTier;
  const int rows_k = sq.k_tile_rows(n0, kB);
  const Acc score_scale = ExpDomain<Acc>::score_scale(p.scale);

  const T* k = sq.k_rows<const T>(p.k, p.k_stride, hk, n0);
  const T* v = sq.k_rows<const T>(p.v, p.v_stride, hk, n0);

  Acc dk[kNC][4][kVec], dv[kNC][4][kVec];
#pragma unroll
  for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < kVec; ++e) dk[ch][i][e] = dv[ch][i][e] = 0;

  // Query rows that see some key of the tile (the band moves right with the row).
  const int64_t m_begin = sq.row_begin(n0) / kB * kB;
  const int64_t m_end = sq.row_end(n0 + rows_k - 1);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    const int64_t row0 = sq.row_index(p.heads_q, h, 0);
    const T* q_h = sq.q_rows<const T>(p.q, p.q_stride, h, 0);
    const T* do_h = sq.q_rows<const T>(p.dout, p.dout_stride, h, 0);
    const Acc* lse_h = static_cast<const Acc*>(p.lse) + row0;
    const Acc* dsum_h = dsum_g + row0;
    Acc* dq_h = dq_accum ? dq_accum + row0 * E : nullptr;
    // Every split recomputes the same dS; the first one writes the bias gradient.
    const BwdFeatures<Acc> f{sq, ScoreMods<Acc>(p, sq, h), DropoutMask<Acc>(p, sq, h),
                             split == 0 ? dbias_rows<Acc>(p, sq, h) : nullptr};

    for (int64_t m0 = m_begin; m0 < m_end; m0 += kB) {
      const int rows_q = sq.q_tile_rows(m0, kB);
      const T* q = q_h + m0 * p.q_stride.row;
      const T* dout = do_h + m0 * p.dout_stride.row;
      Acc s[4][kTN], dp[4][kTN], lse[4], dsum[4];
      bwd_scores<Tr>(s, dp, smem, q, p.q_stride.row, dout, p.dout_stride.row, rows_q, k,
                     p.k_stride.row, v, p.v_stride.row, rows_k, E, Ev, tid);
      load_row_stats(lse, dsum, lse_h, dsum_h, m0, sq.len_q, tid);
      bwd_probs<Tr, kFeatures>(s, dp, lse, dsum, m0, n0, f, score_scale, tid);
      store_transposed<Tr>(sPt, s, tid);
      store_transposed<Tr>(sdSt, dp, tid);

#pragma unroll
      for (int ch = 0; ch < kNC; ++ch) {
        const int dc = d0 + ch * kCW;
        if (dc < e_max) {
          __syncthreads();  // P/dS stored; scoring reads of the chunk buffers done
          if (dc < Ev) load_tile<kB, kCW, Tr::kThreads>(sdO, kLdC, dout + dc, p.dout_stride.row, rows_q, Ev - dc, tid);
          if (dc < E) {
            load_tile<kB, kCW, Tr::kThreads>(sQ, kLdC, q + dc, p.q_stride.row, rows_q, E - dc, tid);
            if (dq_h) load_tile<kB, kCW, Tr::kThreads>(sK, kLdC, k + dc, p.k_stride.row, rows_k, E - dc, tid);
          }
          __syncthreads();
          if (dc < Ev) gemm_rows_x_cols<kB, kVec>(dv[ch], sPt, kLdP, sdO, kLdC, r, c);
          if (dc < E) {
            gemm_rows_x_cols<kB, kVec>(dk[ch], sdSt, kLdP, sQ, kLdC, r, c);
            if (dq_h) {
              Acc dq[4][kVec];
#pragma unroll
              for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < kVec; ++e) dq[i][e] = 0;
              gemm_cols_x_rows<kB, kVec>(dq, sdSt, kLdP, sK, kLdC, r, c);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int64_t m = m0 + r * 4 + i;
                if (m >= sq.len_q) continue;
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                  const int d = dc + c * kVec + e;
                  if (d < E) atomicAdd(dq_h + m * E + d, dq[i][e]);
                }
              }
            }
          }
        }
      }
    }
  }

  T* dk_g = sq.k_rows<T>(p.dk, p.dk_stride, hk, 0);
  T* dv_g = sq.k_rows<T>(p.dv, p.dv_stride, hk, 0);
  const Acc scale = Acc(p.scale);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t n = n0 + r * 4 + i;
    if (n >= sq.len_k) continue;
#pragma unroll
    for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int d = d0 + ch * kCW + c * kVec + e;
        if (d < E) dk_g[n * p.dk_stride.row + d] = from_acc<T>(dk[ch][i][e] * scale);
        if (d < Ev) dv_g[n * p.dv_stride.row + d] = from_acc<T>(dv[ch][i][e]);
      }
  }
}

template <class T, int kTier, bool kFeatures>
__global__ void __launch_bounds__(BwdTraits<T, kTier, true>::kThreads, 2)
    bwd_dq_simt_kernel(const BwdParams p, const acc_t<T>* dsum_g, int num_m_tiles,
                       int num_splits) {
  using Tr = BwdTraits<T, kTier, true>;
  using Acc = typename Tr::Acc;
  constexpr int kB = Tr::kBlock, kTN = Tr::kTN, kVec = Tr::kVec, kNC = Tr::kNumChunks;
  constexpr int kCW = Tr::kChunkCols, kLdC = Tr::kLdChunk;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* smem = reinterpret_cast<Acc*>(smem_raw);
  Acc* sK = smem;  // gradient-phase chunk
  Acc* sdSt = smem + cmax(Tr::kScoreElems, kB * kLdC);

  const TileBlock blk = tile_block(num_m_tiles, num_splits, p.heads_q, /*heaviest_first=*/true);
  const int mt = blk.tile, split = blk.split;
  const int64_t h = blk.head, hk = kv_head(p, h);
  const Seq sq = kFeatures ? sequence(p, blk.batch) : plain_sequence(p, blk.batch);
  const int64_t m0 = int64_t(mt) * kB;
  if (m0 >= sq.len_q) return;  // past the end of a shorter sequence (the whole block)
  const int64_t row0 = sq.row_index(p.heads_q, h, 0);

  const int tid = threadIdx.x, r = tid >> 4, c = tid & 15;
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const int d0 = split * kTier;
  const int rows_q = sq.q_tile_rows(m0, kB);
  const Acc score_scale = ExpDomain<Acc>::score_scale(p.scale);
  const BwdFeatures<Acc> f{sq, ScoreMods<Acc>(p, sq, h), DropoutMask<Acc>(p, sq, h), nullptr};

  const T* q = sq.q_rows<const T>(p.q, p.q_stride, h, m0);
  const T* dout = sq.q_rows<const T>(p.dout, p.dout_stride, h, m0);
  const T* k_h = sq.k_rows<const T>(p.k, p.k_stride, hk, 0);
  const T* v_h = sq.k_rows<const T>(p.v, p.v_stride, hk, 0);

  Acc lse[4], dsum[4];
  load_row_stats(lse, dsum, static_cast<const Acc*>(p.lse) + row0, dsum_g + row0, m0, sq.len_q, tid);

  Acc dq[kNC][4][kVec];
#pragma unroll
  for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < kVec; ++e) dq[ch][i][e] = 0;

  const int64_t n_end = sq.key_end(m0 + rows_q - 1);
  for (int64_t n0 = sq.key_begin(m0) / kB * kB; n0 < n_end; n0 += kB) {
    const int rows_k = sq.k_tile_rows(n0, kB);
    const T* k = k_h + n0 * p.k_stride.row;
    const T* v = v_h + n0 * p.v_stride.row;
    Acc s[4][kTN], dp[4][kTN];
    bwd_scores<Tr>(s, dp, smem, q, p.q_stride.row, dout, p.dout_stride.row, rows_q, k,
                   p.k_stride.row, v, p.v_stride.row, rows_k, E, Ev, tid);
    bwd_probs<Tr, kFeatures>(s, dp, lse, dsum, m0, n0, f, score_scale, tid);
    store_transposed<Tr>(sdSt, dp, tid);
#pragma unroll
    for (int ch = 0; ch < kNC; ++ch) {
      const int dc = d0 + ch * kCW;
      if (dc < E) {
        __syncthreads();  // dS stored; scoring reads of the chunk buffers done
        load_tile<kB, kCW, Tr::kThreads>(sK, kLdC, k + dc, p.k_stride.row, rows_k, E - dc, tid);
        __syncthreads();
        gemm_cols_x_rows<kB, kVec>(dq[ch], sdSt, Tr::kLdP, sK, kLdC, r, c);
      }
    }
  }

  T* dq_g = sq.q_rows<T>(p.dq, p.dq_stride, h, 0);
  const Acc scale = Acc(p.scale);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + r * 4 + i;
    if (m >= sq.len_q) continue;
#pragma unroll
    for (int ch = 0; ch < kNC; ++ch)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int d = d0 + ch * kCW + c * kVec + e;
        if (d < E) dq_g[m * p.dq_stride.row + d] = from_acc<T>(dq[ch][i][e] * scale);
      }
  }
}

inline unsigned grid_size(int64_t blocks, const char* what) {
  return grid_too_large(blocks, what) ? 0u : unsigned(blocks);  // (an empty grid fails to launch: recorded)
}

template <class T, int kTier, bool kWide>
void launch_dkdv(const BwdParams& p, const void* dsum, void* dq_accum, int num_splits,
                 cudaStream_t stream) {
  using Tr = BwdTraits<T, kTier, kWide>;
  using Acc = typename Tr::Acc;
  const int64_t num_n_tiles = (p.len_k + Tr::kBlock - 1) / Tr::kBlock;
  const unsigned blocks =
      grid_size(num_n_tiles * num_splits * p.heads_kv * p.batch, "bwd_dkdv_simt_kernel");
  auto kernel = p.has_features() ? bwd_dkdv_simt_kernel<T, kTier, true> : bwd_dkdv_simt_kernel<T, kTier, false>;
  set_smem(kernel, Tr::kDkdvSmemBytes, "bwd_dkdv_simt_kernel");
  kernel<<<blocks, Tr::kThreads, Tr::kDkdvSmemBytes, stream>>>(
      p, static_cast<const Acc*>(dsum), static_cast<Acc*>(dq_accum), int(num_n_tiles),
      num_splits);
  check_launch("bwd_dkdv_simt_kernel");
}

template <class T, int kTier>
void bwd_dkdv(const BwdParams& p, const void* dsum, void* dq_accum, int num_splits,
              cudaStream_t stream) {
  if constexpr (std::is_same_v<T, double>) {
    launch_dkdv<T, kTier, true>(p, dsum, dq_accum, num_splits, stream);
  } else {
    cudaFuncAttributes attr{};
    check_cuda(cudaFuncGetAttributes(&attr, bwd_dkdv_simt_kernel<T, kTier, false>),
               "cudaFuncGetAttributes(bwd_dkdv_simt_kernel)");
    if (attr.ptxVersion >= 80)
      launch_dkdv<T, kTier, true>(p, dsum, dq_accum, num_splits, stream);
    else
      launch_dkdv<T, kTier, false>(p, dsum, dq_accum, num_splits, stream);
  }
}

template <class T, int kTier>
void bwd_dq(const BwdParams& p, const void* dsum, int num_splits, cudaStream_t stream) {
  using Tr = BwdTraits<T, kTier, true>;
  using Acc = typename Tr::Acc;
  const int64_t num_m_tiles = (p.len_q + Tr::kBlock - 1) / Tr::kBlock;
  const unsigned blocks =
      grid_size(num_m_tiles * num_splits * p.heads_q * p.batch, "bwd_dq_simt_kernel");
  auto kernel = p.has_features() ? bwd_dq_simt_kernel<T, kTier, true> : bwd_dq_simt_kernel<T, kTier, false>;
  set_smem(kernel, Tr::kDqSmemBytes, "bwd_dq_simt_kernel");
  kernel<<<blocks, Tr::kThreads, Tr::kDqSmemBytes, stream>>>(
      p, static_cast<const Acc*>(dsum), int(num_m_tiles), num_splits);
  check_launch("bwd_dq_simt_kernel");
}

}  // namespace flashattn::cuda::simt
