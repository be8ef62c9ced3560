// Tile sizes of the CPU kernels; the geometry of a sequence (common/sequence.h) they share.
#pragma once
#include <algorithm>
#include <cstdint>

#include "../common/sequence.h"
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

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
