// The causal / window / sequence-end mask on one row of an mma accumulator tile: the forwards'
// (sm80/, sm90/) scores of a row outside its band -> -inf.
#pragma once
#include <cstdint>

#include "../../common/sequence.h"
#include "numeric.cuh"

namespace flashattn::cuda {

// Row half r (elements 2r, 2r + 1 of each 8-column atom: row g + 8r of the atoms) of the scores s of
// a kBN-key tile; lane column offset 2t. Columns outside [lo, hi) -> -inf.
template <int kBN, int kNA, class Acc>
__device__ __forceinline__ void mask_columns(Acc (&s)[kNA][4], int r, int lo, int hi, int t) {
#pragma unroll
  for (int j = 0; j < kNA; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 8 * j + 2 * t + c;
      if (col < lo || col >= hi) s[j][2 * r + c] = neg_inf<Acc>();
    }
}

// The same (0 <= lo, hi <= kBN) by bit masks: column 8 j + 2 t + c lies in [lo, hi) for the atoms j in
// [ceil((lo - 2t - c) / 8), ceil((hi - 2t - c) / 8)), one mask per c, then a bit test per score (ptxas moves
// the bits into predicates, R2P: about one instruction a score against three comparing both bounds).
// The wgmma forward's; in the sm80/ forward's register budget the masks spilled.
template <int kBN, int kNA, class Acc>
__device__ __forceinline__ void mask_columns_by_bits(Acc (&s)[kNA][4], int r, int lo, int hi, int t) {
  static_assert(kNA < 32, "one bit per atom");
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int first = (lo - 2 * t - c + 7) >> 3, end = (hi - 2 * t - c + 7) >> 3;  // (numerators >= 0)
    const uint32_t keep = end > first ? (1u << end) - (1u << first) : 0u;
#pragma unroll
    for (int j = 0; j < kNA; ++j)
      if (!(keep >> j & 1u)) s[j][2 * r + c] = neg_inf<Acc>();
  }
}

// The scores of row half r of the kBN-key tile at n0 that query row m sees: keys outside
// [key_begin(m), key_end(m)) -> -inf, compared as 32-bit columns of the tile.
template <int kBN, int kNA, class Acc>
__device__ __forceinline__ void mask_row_band(Acc (&s)[kNA][4], int r, const Seq& sq, int64_t m, int64_t n0, int t) {
  auto column = [](int64_t x) { return int(x < 0 ? 0 : x > kBN ? kBN : x); };
  mask_columns<kBN>(s, r, column(sq.key_begin(m) - n0), column(sq.key_end(m) - n0), t);
}

}  // namespace flashattn::cuda
