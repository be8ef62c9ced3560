// Block coordinates of the attention grids: blockIdx.x enumerates (batch, head, split, tile)
// with the tile fastest, so neighbouring blocks share a head's K/V (query-tile grids) or Q/dO
// (key-tile grids) in L2.
#pragma once
#include <cstdint>

namespace flashattn::cuda {

struct TileBlock {
  int tile;       // query or key tile
  int split;      // column slice of the head dims (0 where the grid has none)
  int64_t head;   // query head (query-tile grids) or kv head (key-tile grids)
  int64_t batch;  // batch index, or sequence index of a varlen batch
};

// `heaviest_first`: tiles run last to first. Under causal masking the last query tiles see
// the most keys, and starting them first keeps them off the tail of the grid.
// `block`: the block's index in that enumeration (blockIdx.x, or another block's where one block
// does the work of several, schedule/tail_split.cuh, or runs another's, schedule/causal_order.cuh).
__device__ __forceinline__ TileBlock tile_block(int num_tiles, int num_splits, int64_t heads,
                                                bool heaviest_first, unsigned block) {
  int64_t bid = block;
  TileBlock blk;
  const int tile = int(bid % num_tiles);
  blk.tile = heaviest_first ? num_tiles - 1 - tile : tile;
  bid /= num_tiles;
  blk.split = int(bid % num_splits);
  bid /= num_splits;
  blk.head = bid % heads;
  blk.batch = bid / heads;
  return blk;
}
__device__ __forceinline__ TileBlock tile_block(int num_tiles, int num_splits, int64_t heads,
                                                bool heaviest_first) {
  return tile_block(num_tiles, num_splits, heads, heaviest_first, blockIdx.x);
}

// The kv head that query head h reads (GQA/MQA groups of heads_q / heads_kv query heads).
template <class Params>
__device__ __forceinline__ int64_t kv_head(const Params& p, int64_t h) {
  return h / (p.heads_q / p.heads_kv);
}

}  // namespace flashattn::cuda
