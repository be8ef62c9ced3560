// What a dK/dV launch hands its kernel, shared by the tensor-core families (sm80/, sm90/): where dQ
// goes (DqAccum), the rounds of key tiles of the deterministic path, and the orders and splits of a
// grid's last wave (causal_order.cuh, tail_split.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"
#include "../common/check.h"

namespace flashattn::cuda {

// Where the dK/dV kernels add dQ / scale, with atomics (accumulator type; fp32 in
// common/dq_layout.cuh's blocked layout, fp64 row-major), zeroed by the caller. slices == 0:
// one accumulator at `base`, one block per key tile, the atomics landing in any order.
// slices >= 1 (deterministic): `slices` accumulators `slice_elems` apart, key tiles g, g +
// slices, ... adding into accumulator g one after the other (for_key_tile_rounds), so each value
// sums in one order on every run; the dQ convert kernel adds the accumulators in order.
struct DqAccum {
  void* base;
  int slices;
  int64_t slice_elems;

  // The accumulator of the calling block in a launch of `groups` blocks per (batch, kv head)
  // (formed where it is used: a pointer kept through the kernel costs two registers).
  template <class Acc>
  __device__ __forceinline__ Acc* block_slice(int groups) const {
    Acc* a = static_cast<Acc*>(base);
    return slices ? a + int64_t(blockIdx.x % unsigned(groups)) * slice_elems : a;
  }
};

// The last, partial wave of a dK/dV grid spread over every SM (tail_split.cuh): blocks from
// `whole` on take a part each of the grid's last `walks` walks (those of blocks whole ... whole +
// walks - 1 of the plain grid, walk_iters query-tile iterations each, cut into `parts` parts),
// adding their dK / dV into `dkdv` (fp32: per walk [kBN][head_dim] dK, then [kBN][head_dim_v] dV).
struct TailSplit {
  unsigned whole = 0xffffffffu;  // blocks that take a whole walk: all of them without a split
  int walks = 0;
  int parts = 0;
  int walk_iters = 0;
  float* dkdv = nullptr;
};

// The order of a causal grid's last (batch, head) pairs (causal_order.cuh): blocks from `start`
// on, those of the last `pairs` pairs, run tile slowest across those pairs, each pair's heaviest
// tile first.
struct HeavyLast {
  unsigned start = 0xffffffffu;
  unsigned pairs = 1;
};

// One launch of a dK/dV kernel: block (g, kv head, batch) takes key tile first + g, bar the
// causal grid's last pairs (`heavy`).
struct KeyTileRound {
  int groups;  // blocks per (batch, kv head)
  int first;   // the key tile of block 0
  TailSplit tail{};
  HeavyLast heavy{};
};

// Where the fp32 dK / dV of split walks go (tail_split.cuh), zeroed by the launcher: room for
// `rows` keys of head_dim + head_dim_v columns; base == nullptr where the call takes no split.
struct DkDvTail {
  float* base;
  int64_t rows;
};

// Plain causal calls off the deterministic path, whose walks shorten with the key tile: their
// last pairs run heaviest first (causal_order.cuh).
inline bool heavy_last_serves(const BwdParams& p) { return !p.deterministic && p.causal && !p.has_features(); }

// Calls launch(blocks, round) for the launches of a dK/dV kernel with kBN-key tiles: one with a
// block per key tile (accum.slices == 0), or (deterministic) rounds of accum.slices blocks per
// (batch, kv head), block g of round r taking key tile r * slices + g into accumulator g.
// Launches on one stream run in order, so each accumulator takes its key tiles' adds one tile
// after the other.
template <class Launch>
void for_key_tile_rounds(const BwdParams& p, int kBN, const DqAccum& accum, Launch&& launch) {
  const int64_t tiles = (p.len_k + kBN - 1) / kBN;
  const int64_t groups = accum.slices > 0 && accum.slices < tiles ? accum.slices : tiles;
  const int64_t blocks = groups * p.heads_kv * p.batch;
  if (grid_too_large(blocks, "sm80 backward")) return;
  for (int64_t first = 0; first < tiles; first += groups) launch(unsigned(blocks), KeyTileRound{int(groups), int(first)});
}

}  // namespace flashattn::cuda
