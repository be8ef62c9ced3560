// The order of a causal grid's blocks. A (batch, head) pair's tiles differ in work under causal
// masking: in the backward key tile 0 walks every query tile and the last one a few, in the
// forward (one query tile per block) the last query tile sees every key and the first a few. In
// the plain order (tile fastest, heaviest first, then head: neighbouring blocks share a head's
// operands in L2) the last pair's heaviest tiles start near the end of the grid and run on alone:
// 3-7% above the ideal for the backward at L <= 8192, 11-15% for the forward at dim 256, by a
// list-scheduling model of the benchmark grid (132 SMs; scripts/grid_model.py). The last ~two waves' pairs run tile
// slowest instead, the heaviest tiles of those pairs first and the lightest last (the model:
// 0.5-4%). Measured (H200, bf16): backward +1.5-2% at dim 64, +4.5-5.5% at 128, +2-4% at 256,
// +9-10% at 192 (L = 1024-8192); forward +8-10% at 192 / 256, and +2-7% at dims 64 / 96 / 128 over
// the pairs of a heavy and a light query tile per block that those took before. The whole grid in
// that order by groups of pairs measured -5..+3% (docs/kernels/sm80_backward.md): the
// blocks in flight then span several heads, whose operands (and the backward's dQ accumulators)
// compete for L2.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/check.h"
#include "key_tile_rounds.h"

namespace flashattn::cuda {

// The order of a causal grid of `blocks` blocks, `tiles` per (batch, head) pair, on S = SMs x
// `per_sm` slots: its last pairs, enough for two waves, heaviest tile first across them. Only
// where a pair has at most S / 2 tiles: a longer pair's own blocks span a wave, and the plain
// order's tail is short (the model: <= 0.6%); there the backward's order measured 0 / -1.2%
// (H200, bf16, dims 128 / 256 at 128 and 256 key tiles; one wave of pairs instead of two the
// same).
inline HeavyLast plan_heavy_last(int64_t blocks, int64_t tiles, int per_sm) {
  HeavyLast order;
  const int64_t slots = int64_t(device_limits().sms) * per_sm, pairs = blocks / tiles;
  if (per_sm < 1 || 2 * tiles > slots) return order;
  const int64_t heavy = std::min<int64_t>(pairs, (2 * slots + tiles - 1) / tiles);
  if (heavy < 2) return order;
  order.start = unsigned((pairs - heavy) * tiles);
  order.pairs = unsigned(heavy);
  return order;
}

// The block of the plain grid (`tiles` blocks per pair) that block `b` (>= order.start) runs: the
// last pairs' pair i % pairs, its tile i / pairs in the plain order (the heaviest first).
__device__ __forceinline__ unsigned heavy_last_block(const HeavyLast& order, int tiles, unsigned b) {
  const unsigned i = b - order.start;
  return order.start + i % order.pairs * unsigned(tiles) + i / order.pairs;
}

// The block of the plain grid that this block runs, where `kOrdered` (the kernel serves calls that
// plan_heavy_last orders).
template <bool kOrdered>
__device__ __forceinline__ unsigned ordered_block(const HeavyLast& order, int tiles) {
  const unsigned b = blockIdx.x;
  return kOrdered && b >= order.start ? heavy_last_block(order, tiles, b) : b;
}

// The order of the Hopper forward's work items (sm90/fwd_rows.cuh: FwdTile): on a grid of a block
// per item, a causal grid's last pairs tile slowest (`heavy`); on a persistent causal grid, where a
// block walks items index = blockIdx.x, + gridDim.x, ..., paired_walk_block's pairs of a heavy and a
// light tile (`paired`).
struct FwdOrder {
  HeavyLast heavy{};
  bool paired = false;
};

// Where a causal forward grid goes persistent with paired_walk_block's order: grids larger than the
// GPU's slots whose (batch, head) pairs have at most `max_tiles` query tiles (the kernel's measured
// bound, sm90/tile_config.h: FwdWsConfig::kPairedMaxTiles).
inline bool plan_paired_walk(int64_t items, int64_t tiles, int64_t slots, int64_t max_tiles) {
  return items > slots && tiles <= max_tiles;
}

// The block of the plain grid (`tiles` query tiles per (batch, head) pair, the heaviest first; `pairs`
// pairs) that work item `s` of a persistent grid of `grid` blocks runs, block b taking s = b, b + grid,
// .... A causal pair's tile j and tile tiles - 1 - j together see as many keys as any other two so
// paired (their rows see the keys up to them), so a block takes such a unit's heavy tile and then its
// light one: the blocks' shares are equal. Units go pair by pair (the blocks in flight share a few
// pairs' K / V in L2); two pairs of an odd tile count pair their middle tiles. The units that do not
// fill a round of the grid end it, each tile on its own (the heavy ones first), and an odd last pair's
// tiles after them.
__host__ __device__ __forceinline__ unsigned paired_walk_block(unsigned tiles, unsigned pairs, unsigned grid,
                                                               unsigned s) {
  const unsigned half = tiles / 2, units = pairs / 2 * tiles, full = units / grid * grid;
  auto unit_tile = [&](unsigned u, bool heavy) {
    const unsigned two = u / tiles, r = u % tiles;  // (units of two pairs: `tiles` of them)
    if (r < 2 * half) {
      const unsigned j = r % half;
      return (2 * two + r / half) * tiles + (heavy ? j : tiles - 1 - j);
    }
    return (2 * two + (heavy ? 0 : 1)) * tiles + half;  // the two pairs' middle tiles
  };
  if (s < 2 * full) return unit_tile(s / grid / 2 * grid + s % grid, s / grid % 2 == 0);
  if (s < 2 * units) {
    const unsigned t = s - 2 * full, rest = units - full;
    return t < rest ? unit_tile(full + t, true) : unit_tile(full + 2 * rest - 1 - t, false);
  }
  return (pairs - 1) * tiles + (s - 2 * units);
}

// The block of the plain grid that work item `index` of a forward grid in `order` runs; `kPairs`: the
// kernel takes paired walks (the others' code stays without them).
template <bool kPairs>
__device__ __forceinline__ unsigned fwd_ordered_block(const FwdOrder& order, int tiles, unsigned pairs,
                                                      unsigned index) {
  if constexpr (kPairs) {
    if (order.paired) return paired_walk_block(unsigned(tiles), pairs, gridDim.x, index);
  }
  return index >= order.heavy.start ? heavy_last_block(order.heavy, tiles, index) : index;
}

}  // namespace flashattn::cuda
