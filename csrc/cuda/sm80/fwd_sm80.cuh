// Tensor-core forward (sm_80+), one kernel for fp16, bf16 and fp64 (DMMA) through the per-type
// product steps of fragments.cuh.
//
// One block per (batch, query head, kBM-row query tile), the last tiles (under causal masking the
// heaviest) first, and a causal grid's last heads tile slowest (causal_order.cuh); a grid's last,
// partial wave of alike walks in parts over the keys, a block each (key_split.cuh). Each warp owns
// 16 * kMW query rows.
// Q stays in smem; K and V tiles of kBN keys (and the mask/bias tile when the call has one) are
// double-buffered and prefetched with cp.async while the current ones are used; or
// (FwdConfig::kStaggered, large dims) one buffer each, V loading while S and the softmax run
// and the next K while P V runs. Per key tile a
// warp forms S = Q K^T in registers, applies the causal / ragged-edge mask only on tiles that
// need it, runs the online softmax on its rows (row statistics reduce over a quad) and adds P V
// into the O accumulators, P taken straight from the S registers. O and the LSE are written
// once at the end (O staged through smem for 16-byte stores where it can).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"
#include "../common/band_mask.cuh"
#include "../common/bias_tile.cuh"
#include "../common/check.h"
#include "../common/features.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "../common/online_softmax.cuh"
#include "../common/opaque.cuh"
#include "../common/tile_copy.cuh"
#include "../plan.h"
#include "../schedule/causal_order.cuh"
#include "../schedule/key_split.cuh"
#include "decode_launch.cuh"
#include "fwd_steps.cuh"
#include "launch.h"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// kFeatures: the variant for calls with optional features (masks, window, ALiBi, softcap,
// dropout, varlen), with the per-score math of csrc/common/ (as the SIMT kernels and the CPU);
// the plain variant keeps its registers and its per-tile mask test.
// One piece of a block's work (`piece`: a whole walk, or with kSplit part of one where the grid's
// last wave is split, key_split.cuh). The steps on a warp's fragments are in fwd_steps.cuh.
template <class Elem, int kDim, bool kFeatures, bool kSplit>
__device__ __forceinline__ void fwd_piece(const FwdParams& p, int num_m_tiles, const KeySplit& split,
                                          const KeyPiece& piece) {
  using F = FwdShape<Elem, kDim, kFeatures>;
  using Cfg = typename F::Cfg;
  using M = typename F::M;
  using Acc = typename F::Acc;
  using Exp = typename F::Exp;
  constexpr int kBM = F::kBM, kBN = F::kBN, kMW = F::kMW, kLd = F::kLd, kThreads = F::kThreads;
  constexpr bool kSw = F::kSw, kQInRegs = F::kQInRegs;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + kBM * kLd;
  Elem* sV = sK + F::kKvBufs * kBN * kLd;
  unsigned char* sBias = reinterpret_cast<unsigned char*>(sV + F::kKvBufs * kBN * kLd);  // [2] bias tiles

  // The piece's query tile: the last tiles first, a causal grid's last heads tile slowest
  // (fwd_kernel).
  const TileBlock blk = tile_block(num_m_tiles, 1, p.heads_q, /*heaviest_first=*/true, piece.block);
  const int64_t tile_m0 = int64_t(blk.tile) * kBM;
  const int64_t h = blk.head, b = blk.batch, hk = kv_head(p, h);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16 * kMW;  // first row of this warp in the tile
  // Rows and keys are counted within the sequence (a varlen batch: from its cumulative
  // offsets; the grid covers the longest one). Only the feature variant's tile can lie past its
  // sequence: the plain variant's grid covers len_q.
  const Seq sq = kFeatures ? sequence(p, b) : plain_sequence(p, b);
  if (tile_m0 >= sq.len_q) return;
  // The query tile, with the key tiles any of its rows sees (causal and window bands; tiles
  // outside are skipped).
  FwdQueryTile tile = query_tile(sq, tile_m0, kBM, kBN);
  if constexpr (kSplit) {  // a part of the walk (a whole one: first 0, count past its end)
    const int64_t end = tile.n_begin + int64_t(piece.first + piece.count) * kBN;
    tile.n_begin += int64_t(piece.first) * kBN;
    tile.n_end = end < tile.n_end ? end : tile.n_end;
  }
  const Acc score_scale = Exp::score_scale(p.scale);
  const ScoreMods<Acc> mods(p, sq, h);
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);

  const Elem* k = sq.k_rows<const Elem>(p.k, p.k_stride, hk, 0);
  const Elem* v = sq.k_rows<const Elem>(p.v, p.v_stride, hk, 0);

  const BiasTileLayout bias_tile = kFeatures ? bias_tile_layout<kBM, kBN>(p) : BiasTileLayout{};
  const bool bias_chunked = kFeatures && bias_rows_chunked(p);
  const FwdTileLoads<F, Elem> load{p, sq, tile, h, sQ, sK, sV, sBias, bias_tile, bias_chunked, k, v, E, Ev, tid};

  typename F::O o;
  typename F::RowStat row_max, row_sum;
  const FwdOperandReads<F, Elem> read(sQ, sK, sV, wrow, lane);
  typename M::A qa[kQInRegs ? F::kKSteps : 1][kMW];

  // A key offset from n0, clamped to the tile: the row's band as 32-bit column bounds.
  auto tile_column = [](int64_t x) { return int(x < 0 ? 0 : x > kBN ? kBN : x); };
  const DropoutMask<Acc> drop(p, sq, h);
  auto row_of = [&](int mw, int r) { return tile.m0 + wrow + 16 * mw + g + 8 * r; };
  // Tiles every row of the block sees in full (most of them) skip the per-element mask.
  auto all_visible = [&](int64_t n0) { return n0 >= sq.key_begin(tile.m_last) && n0 + kBN <= sq.key_end(tile.m0); };

  // The online softmax of tile n0's scores and O = alpha O + P V with V from buffer vb. Staggered,
  // the next K tile's copy starts where every warp is done with Q and K.
  auto softmax_pv = [&](typename F::S& s, int vb, int64_t n0) {
    typename F::RowStat alpha;
    const bool grow =
        online_softmax_tile<F>(s, row_max, row_sum, alpha, FwdDropout<F>{drop, tile.m0, n0, wrow, g, t});
    if constexpr (Cfg::kStaggered) {
      cp_async_wait<0>();
      __syncthreads();  // V landed for all; every warp is done with Q and K
      if (n0 + kBN < tile.n_end) load.k_tile(n0 + kBN, 0);  // lands while P V runs
      cp_async_commit();
    }
    // Without the staggered loads O is rescaled on every tile (alpha is exactly 1 where no row
    // grew): without the branch the FMULs fill the gaps between the P V HMMAs (forward +4-8% at
    // dim 64, +2-5% at 128 for L <= 4096; H200, bf16). The staggered kernels (dims 192, 256)
    // measured -1..-3% with it.
    add_pv<F>(o, s, alpha, !Cfg::kStaggered || grow, read, vb);
  };

  // The first copies, Q to registers (kQInRegs), the key loop and the output.
  int buf = 0;
  if (tile.has_keys()) {
    load.q();
    load.k_tile(tile.n_begin, buf);
    if (!Cfg::kStaggered) load.v_tile(tile.n_begin, buf);
  }
  cp_async_commit();
  init_rows<F>(o, row_max, row_sum);
  if (kQInRegs && tile.has_keys()) q_to_registers<F>(qa, read);

  for (int64_t n0 = tile.n_begin; n0 < tile.n_end; n0 += kBN, buf = Cfg::kStaggered ? 0 : buf ^ 1) {
    cp_async_wait<0>();
    __syncthreads();  // this K (and V) landed for all; every warp is done with the other buffer
    if constexpr (Cfg::kStaggered) {
      load.v_tile(n0, 0);  // lands while S and the softmax run
    } else if (n0 + kBN < tile.n_end) {
      load.k_tile(n0 + kBN, buf ^ 1);
      load.v_tile(n0 + kBN, buf ^ 1);
    }
    cp_async_commit();

    typename F::S s;
    tile_scores<F>(s, qa, read, buf);
    // Scores -> exponent domain (masked ones -inf). The scale is applied before the max, not
    // folded into the exp2 argument (s * c - max * c as one FFMA): that leaves the row's
    // largest P at 2^(rounding error) instead of exactly 1, and a one-hot row then loses O = V
    // exactly to the bf16/fp16 rounding of P in P V.
    // Softcap and ALiBi take the general path of ScoreMods; a bias alone is one add per score.
    const unsigned char* bias_s = sBias + buf * bias_tile.buffer_bytes();
    if (kFeatures && mods_beyond_bias(p)) {
      tile_scores_with_mods<F>(s, mods, sq, tile, n0, all_visible(n0), wrow, g, t, tile_column, bias_s, bias_tile);
    } else {
      tile_scores_scaled<F, Elem>(s, score_scale, p, bias_s, bias_tile, wrow, g, t);
      // Scores outside each row's band (causal, window, sequence ends) -> -inf; a masked tile
      // compares 32-bit column indices against each row's band.
      if (!all_visible(n0)) {
#pragma unroll
        for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
          for (int r = 0; r < 2; ++r) mask_row_band<kBN>(s[mw], r, sq, row_of(mw, r), n0, t);
      }
    }

    softmax_pv(s, buf, n0);
  }

  // A part of a split walk: its rows go to the workspace, and the walk's last part to finish
  // writes the merged rows.
  if constexpr (kSplit) {
    // (the part's slot from blockIdx: a register held across the key loop for it moved the loop's
    // allocation, 16 -> 84 B of spills at dim 96)
    if (blockIdx.x >= split.whole && !settle_piece(split, tile.rows - wrow, tid, kThreads, o, row_max, row_sum))
      return;
  }
  // The tile's output: staged through smem (plain swizzled kernels), or from the registers.
  if constexpr (kSw && !kFeatures)
    store_rows_staged<F>(o, row_max, row_sum, p, sq, tile, h, smem_raw, sQ, wrow, g, t, Ev);
  else
    store_rows<F, Elem>(o, row_max, row_sum, p, sq, tile, h, drop, wrow, g, t, Ev);
}

// The block's piece: a whole walk (block `order` places), or a part of one (a split grid's last
// blocks: key_split.cuh).
// kSplit: the kernel with the split's code (FwdConfig::kKeySplit, or kSplitKernel's second one).
template <class Elem, int kDim, bool kFeatures, bool kSplit = FwdConfig<Elem, kDim, kFeatures>::kKeySplit>
__global__ void __launch_bounds__(FwdConfig<Elem, kDim, kFeatures>::kThreads)
    fwd_kernel(const FwdParams p, int num_m_tiles, HeavyLast order, KeySplit split) {
  fwd_piece<Elem, kDim, kFeatures, kSplit>(p, num_m_tiles, split,
                                           key_piece<kSplit>(split, ordered_block<!kFeatures>(order, num_m_tiles)));
}

// The key tiles that each block of the plain variant's grid walks, where all walks are alike
// (non-causal calls, or causal ones with one query tile per head); else 0.
template <class Cfg>
int64_t uniform_walk_tiles(const FwdParams& p, int64_t num_m_tiles) {
  if (p.causal && num_m_tiles > 1) return 0;
  return query_tile(plain_sequence(p, 0), 0, Cfg::kBM, Cfg::kBN).key_tiles(Cfg::kBN);
}

// The plain variant's grid: the kernel to launch (smem set; kSplitKernel's second one for a split
// grid), shared memory and blocks, and the split of its last wave (key_split.cuh; without workspace
// pointers) where it takes one.
template <class Elem, int kDim, bool kFeatures>
struct FwdLaunch {
  using Cfg = FwdConfig<Elem, kDim, kFeatures>;
  static constexpr size_t kSlotFloats = PartialRows<Cfg::kMW, kDim / 8>::floats(Cfg::kThreads);
  decltype(&fwd_kernel<Elem, kDim, kFeatures>) kernel = fwd_kernel<Elem, kDim, kFeatures>;  // (the one launched)
  size_t smem = 0;
  int64_t num_m_tiles = 0, blocks = 0;
  int per_sm = 0;  // blocks per SM where a plan needs it
  KeySplit split;
  bool usable = false;

  explicit FwdLaunch(const FwdParams& p) {
    // The bias tiles (when the call has a bias) take smem beside the operands; where they do
    // not fit (fp64 at dim 128), the portable kernel serves the call.
    smem = Cfg::kSmemBytes + 2 * size_t(bias_tile_layout<Cfg::kBM, Cfg::kBN>(p).buffer_bytes());
    if (!tensor_cores_usable(smem)) return;
    num_m_tiles = (p.len_q + Cfg::kBM - 1) / Cfg::kBM;
    blocks = num_m_tiles * p.heads_q * p.batch;
    if (grid_too_large(blocks, "sm80::fwd_kernel")) return;
    usable = true;
    set_smem(kernel, smem, "sm80::fwd_kernel");
    constexpr bool kSplits = Cfg::kKeySplit || Cfg::kSplitKernel;
    if (!kFeatures && (p.causal || kSplits)) per_sm = plain_blocks_per_sm();
    if (kSplits) split = plan_key_split(blocks, uniform_walk_tiles<Cfg>(p, num_m_tiles), per_sm);
    if (Cfg::kSplitKernel && split.whole != 0) split = KeySplit{};  // whole walks: the plain kernel
    if constexpr (Cfg::kSplitKernel) {
      if (split.walks > 0) {
        kernel = fwd_kernel<Elem, kDim, kFeatures, true>;
        set_smem(kernel, smem, "sm80::fwd_kernel (split)");
      }
    }
  }
  size_t workspace_bytes() const { return key_split_bytes(split, kSlotFloats); }

  // The plain variant's blocks per SM (its smem is the same for every call), asked once per device
  // and thread.
  int plain_blocks_per_sm() const {
    return blocks_per_sm_cached<fwd_kernel<Elem, kDim, kFeatures>>(Cfg::kThreads, smem, "sm80::fwd_kernel");
  }
};

template <class Elem, int kDim, bool kFeatures>
bool launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdConfig<Elem, kDim, kFeatures>;
  FwdLaunch<Elem, kDim, kFeatures> l(p);
  if (!l.usable) return false;
  KeySplit& split = l.split;
  unsigned blocks = unsigned(l.blocks);
  if (split.walks > 0 && p.workspace != nullptr && p.workspace_bytes >= l.workspace_bytes()) {
    char* ws = static_cast<char*>(p.workspace);
    split.counters = reinterpret_cast<unsigned*>(ws);
    split.partial = reinterpret_cast<float*>(ws + key_split_counter_bytes(split));
    check_cuda(cudaMemsetAsync(split.counters, 0, size_t(split.walks) * sizeof(unsigned), stream),
               "cudaMemsetAsync(forward split counters)");
    blocks = split.whole + unsigned(split.walks * split.parts);
  } else {
    split = KeySplit{};
  }
  // Causal calls of the plain variant: the last heads' tiles heaviest first across them
  // (causal_order.cuh; H200, bf16: +8-10% at dims 192 / 256, +2.3-6.6% at 64 / 96 / 128 and
  // +0.3-2.6% at 32 over pairs of a heavy and a light query tile per block, which this kernel
  // took at dims <= 128 before: docs/kernels/sm80_forward.md). Not with a split (one
  // query tile per head: every block's walk the same).
  HeavyLast order;
  if (!kFeatures && p.causal && split.walks == 0) order = plan_heavy_last(l.blocks, l.num_m_tiles, l.per_sm);
  l.kernel<<<blocks, Cfg::kThreads, l.smem, stream>>>(p, int(l.num_m_tiles), order, split);
  check_launch("sm80::fwd_kernel");
  return true;
}

// Workspace of the call on `kernel` (kSm80Decode: its walks' parts; kSm80Plain: the split of its grid's
// last wave), 0 where it takes none.
template <class Elem, int kDim>
size_t fwd_workspace_bytes(const FwdParams& p, FwdKernel kernel) {
  if constexpr (DecodeConfig<Elem, kDim>::kServed) {
    if (kernel == FwdKernel::kSm80Decode) {
      const DecodeLaunch<Elem, kDim> d(p);
      return d.usable ? d.workspace_bytes() : 0;
    }
  }
  if (kernel != FwdKernel::kSm80Plain) return 0;
  const FwdLaunch<Elem, kDim, false> l(p);
  return l.usable ? l.workspace_bytes() : 0;
}

template <class Elem, int kDim>
bool fwd(const FwdParams& p, FwdKernel kernel, cudaStream_t stream) {
  switch (kernel) {
    case FwdKernel::kSm80Decode:
      if constexpr (DecodeConfig<Elem, kDim>::kServed) return launch_decode<Elem, kDim>(p, stream);
      return false;
    case FwdKernel::kSm80Plain: return launch_fwd<Elem, kDim, false>(p, stream);
    case FwdKernel::kSm80Features: return launch_fwd<Elem, kDim, true>(p, stream);
    default: return false;
  }
}

}  // namespace flashattn::cuda::sm80
