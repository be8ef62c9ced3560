// Tile sizes of the CPU kernels and the causal geometry they share.
#pragma once
#include <algorithm>
#include <cstdint>

#include "../params.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// Query rows and key columns per tile; multiples of the panel width of every type. The
// forward takes larger tiles (measured: 256 x 128 is 25% faster than 64 x 64 on Zen 4): each
// key tile is transposed once per query tile, and the per-row softmax bookkeeping (row max,
// rescaling O) is amortized over more columns. The backward is indifferent to its tile
// shape (64 to 128 measured the same). Working sets stay inside a 1 MiB L2.
constexpr int64_t kFwdTileQ = 256;
constexpr int64_t kFwdTileK = 128;
constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

// Keys [0, n) visible to query row `row` (n may be 0: a fully masked row).
inline int64_t row_visible_keys(const FwdParams& p, int64_t row) {
  if (!p.causal) return p.len_k;
  return std::clamp<int64_t>(row + p.causal_offset + 1, 0, p.len_k);
}

// Number of keys (from 0) that any of query rows [.., row_end) can see: the last row sees most.
inline int64_t visible_keys(const FwdParams& p, int64_t row_end) { return row_visible_keys(p, row_end - 1); }

// First query row that sees key `key` under the causal mask.
inline int64_t first_row_seeing(const FwdParams& p, int64_t key) {
  if (!p.causal) return 0;
  return std::clamp<int64_t>(key - p.causal_offset, 0, p.len_q);
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
