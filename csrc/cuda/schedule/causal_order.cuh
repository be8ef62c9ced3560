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
#include "../common/fast_divide.h"
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
// block walks items index = blockIdx.x, + gridDim.x, ..., fwd_paired_block's pairs of a heavy and a
// light tile (`paired`).
struct FwdOrder {
  HeavyLast heavy{};
  bool paired = false;
  // The launch's divisors of a work item's decode (a persistent block decodes one per item, at the item's
  // boundary, where nvcc's 32- and 64-bit division sequences cost ~600 clocks): query tiles per (batch, head) pair,
  // query heads, query heads per kv head, the heavy pairs; a paired walk's half tile count and grid size, its
  // units and full rounds' units (fwd_paired_block).
  FastDivisor tiles, heads, group, heavy_pairs, half, grid;
  unsigned pairs = 0, units = 0, full = 0;
};

// Where a causal forward grid goes persistent with fwd_paired_block's order: grids larger than the
// GPU's slots whose (batch, head) pairs have at most `max_tiles` query tiles (the kernel's measured
// bound, sm90/tile_config.h: FwdWsConfig::kPairedMaxTiles).
inline bool plan_paired_walk(int64_t items, int64_t tiles, int64_t slots, int64_t max_tiles) {
  return items > slots && tiles <= max_tiles;
}

// A forward grid's order for `tiles` query tiles per (batch, head) pair, `pairs` pairs and `blocks` blocks
// (the persistent grid's size where it walks paired units).
inline FwdOrder fwd_order(bool paired, HeavyLast heavy, int64_t tiles, int64_t heads_q, int64_t heads_kv,
                          int64_t pairs, int64_t blocks) {
  FwdOrder order;
  order.paired = paired;
  order.heavy = heavy;
  order.tiles = FastDivisor(uint32_t(std::max<int64_t>(tiles, 1)));
  order.heads = FastDivisor(uint32_t(heads_q));
  order.group = FastDivisor(uint32_t(heads_q / heads_kv));
  order.heavy_pairs = FastDivisor(std::max<uint32_t>(heavy.pairs, 1));
  order.half = FastDivisor(uint32_t(std::max<int64_t>(tiles / 2, 1)));
  order.grid = FastDivisor(uint32_t(std::max<int64_t>(blocks, 1)));
  order.pairs = unsigned(pairs);
  order.units = unsigned(pairs / 2 * tiles);
  order.full = order.units / order.grid.d * order.grid.d;
  return order;
}

// The block of the plain grid (`tiles` query tiles per (batch, head) pair, the heaviest first; `pairs`
// pairs) that work item `s` of a persistent grid of `grid` blocks runs (the order's divisors and counts),
// block b taking s = b, b + grid, .... A causal pair's tile j and tile tiles - 1 - j together see as
// many keys as any other two so paired (their rows see the keys up to them), so a block takes such a
// unit's heavy tile and then its light one: the blocks' shares are equal. Units go pair by pair (the
// blocks in flight share a few pairs' K / V in L2); two pairs of an odd tile count pair their middle
// tiles. The units that do not fill a round of the grid end it, each tile on its own (the heavy ones
// first), and an odd last pair's tiles after them.
__host__ __device__ __forceinline__ unsigned fwd_paired_block(const FwdOrder& o, unsigned s) {
  const unsigned tiles = o.tiles.d, half = tiles / 2;
  auto unit_tile = [&](unsigned u, bool heavy) {
    const unsigned two = o.tiles.div(u), r = u - two * tiles;  // (units of two pairs: `tiles` of them)
    if (r < 2 * half) {
      const unsigned side = o.half.div(r), j = r - side * half;
      return (2 * two + side) * tiles + (heavy ? j : tiles - 1 - j);
    }
    return (2 * two + (heavy ? 0 : 1)) * tiles + half;  // the two pairs' middle tiles
  };
  if (s < 2 * o.full) {
    const unsigned round = o.grid.div(s);
    return unit_tile(round / 2 * o.grid.d + (s - round * o.grid.d), round % 2 == 0);
  }
  if (s < 2 * o.units) {
    const unsigned t = s - 2 * o.full, rest = o.units - o.full;
    return t < rest ? unit_tile(o.full + t, true) : unit_tile(o.full + 2 * rest - 1 - t, false);
  }
  return (o.pairs - 1) * tiles + (s - 2 * o.units);
}

// The block of the plain grid that work item `index` of a forward grid in `order` runs (heavy_last_block's
// or fwd_paired_block's); `kPairs`: the kernel takes paired walks (the others' code stays without them).
template <bool kPairs>
__device__ __forceinline__ unsigned fwd_ordered_block(const FwdOrder& order, unsigned index) {
  if constexpr (kPairs) {
    if (order.paired) return fwd_paired_block(order, index);
  }
  if (index < order.heavy.start) return index;
  const unsigned i = index - order.heavy.start, tile = order.heavy_pairs.div(i);
  return order.heavy.start + (i - tile * order.heavy.pairs) * order.tiles.d + tile;
}

}  // namespace flashattn::cuda
