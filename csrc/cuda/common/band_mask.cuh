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

// The scores of row half r of the kBN-key tile at n0 that query row m sees: keys outside
// [key_begin(m), key_end(m)) -> -inf, compared as 32-bit columns of the tile.
template <int kBN, int kNA, class Acc>
__device__ __forceinline__ void mask_row_band(Acc (&s)[kNA][4], int r, const Seq& sq, int64_t m, int64_t n0, int t) {
  auto column = [](int64_t x) { return int(x < 0 ? 0 : x > kBN ? kBN : x); };
  mask_columns<kBN>(s, r, column(sq.key_begin(m) - n0), column(sq.key_end(m) - n0), t);
}

}  // namespace flashattn::cuda
