// The last wave of a dK/dV grid spread over every SM. A grid of B blocks whose walks all take the
// same time (plain non-causal calls: every key tile sees every query tile) runs in waves of
// S = SMs x blocks per SM; with B % S = R > 0 the last wave keeps R of the S slots busy for a
// whole walk and the rest idle (H200, 132 SMs, L = 16384, bf16: 2048 blocks, 15.5 waves, ran 3.3%
// below a grid of exactly 32 waves at the same work per block; 4096 blocks at dim 64, 31.03
// waves: 2.8%). Split, the first B - R blocks take their walks whole, and each of the last R
// walks is cut into `parts` runs of query tiles, a block each, so that the last wave's blocks are
// shorter and more of the slots take one. A part's dK / dV go by fp32 atomics into the tail area
// (DkDvTail), which store_tail_dkdv_kernel then writes out. dQ is unchanged (its atomics land in
// any order already); the deterministic path keeps its rounds, without a split.
// (A block taking a run across two walks, so that every slot gets the same share, made ptxas
// spill 28-32 B in the dim-64 kernels: the loop over a block's segments around the walk.)
// Causal grids have the opposite tail, met by their order instead (causal_order.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/check.h"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "causal_order.cuh"
#include "key_tile_rounds.h"

namespace flashattn::cuda {

// A part takes at least this many query tiles, and is reckoned to cost this many more (its K / V
// copies, the walk's start, the dK / dV atomics) in the choice of `parts`. Walks shorter than
// kMinSplitWalkIters are not split: their grids are short, and the split's fixed costs (the tail
// area's memset and write-out: ~1% at L = 2048 - 4096) took what it saved (L = 512: -3..-4%
// where the model below promised +1..2%; H200, bf16).
constexpr int64_t kMinPartIters = 2, kPartOverheadIters = 1, kMinSplitWalkIters = 16;

// The split of a launch of `blocks` blocks (kBN keys, kBM-row query tiles, `per_sm` resident per
// SM) where it serves: only calls given a tail area (the plan's tail_rows, ../plan.cpp: not the
// deterministic rounds, causal calls or the feature variants, whose walks differ in length). The number of
// parts minimises the last wave's estimated time: ceil(R x parts / S) rounds of a part's
// iterations plus its overhead (in iterations).
inline TailSplit plan_tail_split(const BwdParams& p, const DkDvTail& area, int kBM, int kBN, int64_t blocks,
                                 int per_sm) {
  TailSplit t;
  if (area.base == nullptr || per_sm < 1) return t;
  const int64_t slots = int64_t(device_limits().sms) * per_sm;
  const int64_t walks = blocks % slots;
  if (walks == 0 || walks * kBN > area.rows) return t;
  const int64_t iters = (p.len_q + kBM - 1) / kBM * p.group();
  if (iters < kMinSplitWalkIters || iters * 64 > 0x7fffffff) return t;  // (parts' bounds: 32 bits)
  int64_t best_parts = 1, best_time = iters + kPartOverheadIters;
  for (int64_t parts = 2; parts <= 64 && iters / parts >= kMinPartIters; ++parts) {
    const int64_t rounds = (walks * parts + slots - 1) / slots;
    const int64_t time = rounds * ((iters + parts - 1) / parts + kPartOverheadIters);
    if (time < best_time) best_parts = parts, best_time = time;
  }
  // Worth it only where it saves 2% of the grid's time (by this model, which measured ~1% above
  // the gain at L = 2048 - 4096: dim 128 at L = 2048 saved 1.8% by it and gained nothing).
  const int64_t grid_time = blocks / slots * iters + iters + kPartOverheadIters;
  if (best_parts == 1 || 50 * (iters + kPartOverheadIters - best_time) < grid_time) return t;
  t.whole = unsigned(blocks - walks);
  t.walks = int(walks);
  t.parts = int(best_parts);
  t.walk_iters = int(iters);
  t.dkdv = area.base;
  return t;
}

// What a block of a dK/dV grid takes: the walk of block `block` of the plain grid (its key tile,
// kv head and batch), that walk's iterations [first, first + count) (count < 0: all), and
// `tail`, the walk's index among the split ones (-1: a whole walk, dK / dV stored directly).
struct WalkSegment {
  unsigned block;
  int first, count;
  int tail;
};

__device__ __forceinline__ WalkSegment walk_segment(const KeyTileRound& round) {
  const unsigned b = blockIdx.x;
  if (b >= round.heavy.start) return WalkSegment{heavy_last_block(round.heavy, round.groups, b), 0, -1, -1};
  const TailSplit& t = round.tail;
  if (b < t.whole) return WalkSegment{b, 0, -1, -1};
  const int i = int(b - t.whole), w = i / t.parts, part = i - w * t.parts;
  const int first = part * t.walk_iters / t.parts, last = (part + 1) * t.walk_iters / t.parts;
  return WalkSegment{t.whole + w, first, last - first, w};
}

// Writes the split walks' dK / dV (summed in the tail area, dK already scaled) to dk / dv: one
// block per split walk (tail_split.cu: its kernel is compiled once for the build, not in every tier's
// translation unit). Elem: __half or __nv_bfloat16.
template <class Elem>
void store_tail_dkdv(const BwdParams& p, const KeyTileRound& round, int kBN, cudaStream_t stream);

// Launches `kernel` (a dK/dV kernel of config C: kBM, kBN, kThreads, kTailSplit) over `round`'s
// blocks, with C's last-wave plan where it has one (kTailSplit): for causal calls the last pairs
// heaviest first, else the tail split where plan_tail_split takes one, the tail area zeroed
// before and the split walks' dK / dV written after.
template <class C, class Elem, class Kernel>
void launch_with_tail_split(Kernel kernel, size_t smem, const BwdParams& p, const float* dsum, const DqAccum& accum,
                            const DkDvTail& area, unsigned blocks, KeyTileRound round, cudaStream_t stream,
                            const char* name) {
  const int per_sm =
      C::kTailSplit && (area.base != nullptr || heavy_last_serves(p)) ? blocks_per_sm(kernel, C::kThreads, smem) : 0;
  round.tail = plan_tail_split(p, area, C::kBM, C::kBN, blocks, per_sm);
  if (C::kTailSplit && heavy_last_serves(p)) round.heavy = plan_heavy_last(blocks, round.groups, per_sm);
  const TailSplit& t = round.tail;
  if (t.parts > 0) {
    blocks = unsigned(t.whole + int64_t(t.walks) * t.parts);
    check_cuda(cudaMemsetAsync(t.dkdv, 0, size_t(t.walks) * C::kBN * (p.head_dim + p.head_dim_v) * sizeof(float), stream),
               "cudaMemsetAsync(tail dK / dV)");
  }
  kernel<<<blocks, C::kThreads, smem, stream>>>(p, dsum, accum, round);
  check_launch(name);
  if (t.parts > 0) {
    store_tail_dkdv<Elem>(p, round, C::kBN, stream);
  }
}

}  // namespace flashattn::cuda
