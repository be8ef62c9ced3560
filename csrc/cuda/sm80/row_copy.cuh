// Global -> shared tile copy whose rows come one by one from a function (a paged KV cache's rows
// sit in whatever blocks its table names), in the smem layout of copy_tile_async (tile_copy.cuh):
// 16-byte cp.async chunks, padded or swizzled rows, everything outside the valid rows and
// columns zero-filled.
#pragma once
#include <cstdint>

#include "../common/cp_async.cuh"
#include "../common/tile_copy.cuh"

namespace flashattn::cuda::sm80 {

// Rows `kRows` x columns `kCols` into `s` (pitch `ld`): row r < rows from row_at(r) (called only
// for such rows), columns c < cols. A chunk outside them is zero-filled and names `any`, a valid
// address it does not read.
template <int kRows, int kCols, int kThreads, bool kSwizzle, class Elem, class RowAt>
__device__ __forceinline__ void copy_rows_async(Elem* s, int ld, RowAt row_at, const Elem* any, int rows, int cols,
                                                int tid) {
  constexpr int kChunk = chunk_elems<Elem>();
  constexpr int kPerRow = kCols / kChunk;
  static_assert(kCols % kChunk == 0, "tile width is a whole number of 16-byte chunks");
  if constexpr (kThreads % kPerRow != 0) {
    static_assert(!kSwizzle, "the swizzle is written for the layout below");
    constexpr int kIters = (kRows * kPerRow + kThreads - 1) / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = tid + it * kThreads;
      if ((kRows * kPerRow) % kThreads != 0 && i >= kRows * kPerRow) break;
      const int r = i / kPerRow, c = (i % kPerRow) * kChunk;
      const bool valid = c < cols && r < rows;
      cp_async_16_zfill(s + r * ld + c, valid ? row_at(r) + c : any, valid);
    }
  } else {
    // A thread copies chunk c of rows r0, r0 + kRowStep, ... (as copy_tile_async).
    constexpr int kRowStep = kThreads / kPerRow;
    constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
    const int r0 = tid / kPerRow, c = (tid % kPerRow) * kChunk;
    static_assert(!kSwizzle || (kCols * sizeof(Elem) % 128 == 0 && kRowStep % 4 == 0),
                  "swizzled rows are whole 128-byte lines, and a thread's rows agree modulo 4");
    Elem* const dst_even = s + r0 * ld + (kSwizzle ? c ^ ((r0 & 7) * kChunk) : c);
    Elem* const dst_odd = kSwizzle && kRowStep % 8 != 0 ? s + r0 * ld + (c ^ (((r0 & 7) ^ 4) * kChunk)) : dst_even;
    const bool col_ok = c < cols;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = r0 + it * kRowStep;
      if (kRows % kRowStep != 0 && r >= kRows) break;
      const bool valid = col_ok && r < rows;
      cp_async_16_zfill((it % 2 ? dst_odd : dst_even) + it * kRowStep * ld, valid ? row_at(r) + c : any, valid);
    }
  }
}

}  // namespace flashattn::cuda::sm80
