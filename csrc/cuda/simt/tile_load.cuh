// Global -> shared copy of a tile of rows, converting to the accumulator type and zero-filling
// everything outside the valid rows/columns, so that the products need no bounds checks.
#pragma once
#include <cstdint>

#include "../common/numeric.cuh"

namespace flashattn::cuda::simt {

// `g` points at element (row 0, col 0) of the tile; rows are `row_stride` elements apart.
// Consecutive threads take consecutive columns, so a warp reads whole row segments.
template <int kRows, int kCols, int kThreads, class T, class Acc>
__device__ __forceinline__ void load_tile(Acc* s, int ld, const T* g, int64_t row_stride,
                                          int rows_valid, int cols_valid, int tid) {
  static_assert((kRows * kCols) % kThreads == 0, "tile must split evenly over the block");
#pragma unroll
  for (int it = 0; it < kRows * kCols / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int row = idx / kCols, col = idx % kCols;
    Acc x = 0;
    if (row < rows_valid && col < cols_valid) x = to_acc(g[row * row_stride + col]);
    s[row * ld + col] = x;
  }
}

}  // namespace flashattn::cuda::simt
