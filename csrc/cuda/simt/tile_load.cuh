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
  static_assert(kThreads % kCols == 0 && kRows % (kThreads / kCols) == 0,
                "tile must split evenly over the block");
  constexpr int kRowsPerStep = kThreads / kCols;
  const int col = tid % kCols;
  int row = tid / kCols;
  const bool col_ok = col < cols_valid;
  const T* src = g + row * row_stride + col;
  const int64_t src_step = kRowsPerStep * row_stride;
  Acc* dst = s + row * ld + col;
#pragma unroll
  for (int it = 0; it < kRows / kRowsPerStep; ++it) {
    Acc x = 0;
    if (col_ok && row < rows_valid) x = to_acc(*src);
    *dst = x;
    row += kRowsPerStep;
    src += src_step;
    dst += kRowsPerStep * ld;
  }
}

}  // namespace flashattn::cuda::simt
