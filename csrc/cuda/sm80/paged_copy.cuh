// Global -> shared copy of a K and a V tile from a paged KV cache (FwdParams::block_table), in the
// smem layout of copy_tile_async (common/tile_copy.cuh): 16-byte cp.async chunks, padded or swizzled rows,
// everything outside the valid rows and columns zero-filled. The rows sit in whatever blocks the
// table names, so each row's address is looked up; one lookup serves K and V.
#pragma once
#include <cstdint>

#include "../../common/pages.h"
#include "../../params.h"
#include "../common/cp_async.cuh"
#include "../common/fast_divide.h"
#include "../common/tile_copy.cuh"

namespace flashattn::cuda::sm80 {

// Key rows j0 .. j0 + kRows - 1 of kv head h of sequence b (counted from the start of its cache)
// into sK / sV (pitch ld): rows below `rows` (which must lie within the sequence's pages), columns
// below cols_k / cols_v; bad_block set where the table names a block outside the cache for a page
// of those rows (common/pages.h: read clamped all the same). Where a thread's rows are evenly spaced
// (a row's chunks divide the block: dims 32, 64, 128, 256), only its first row divides by the page
// size; the next ones step through the pages, and a page's block is loaded once per thread (a
// division and a table load per row cost the kernel twice its time when measured).
template <int kRows, int kCols, int kThreads, bool kSwizzle, class Elem>
__device__ __forceinline__ void copy_paged_kv_async(Elem* sK, Elem* sV, int ld, const FwdParams& p, int64_t b,
                                                    int64_t h, int64_t j0, int rows, int cols_k, int cols_v,
                                                    int tid, const FastDivisor& by_page, bool& bad_block) {
  constexpr int kChunk = chunk_elems<Elem>();
  constexpr int kPerRow = kCols / kChunk;
  static_assert(kCols % kChunk == 0, "tile width is a whole number of 16-byte chunks");
  // (the page of key row j: by the grid's magic divisor where the rows allow, every cache in practice)
  auto page_of_row = [&](int64_t j) {
    return p.len_k <= INT32_MAX ? int64_t(by_page.div(uint32_t(j))) : j / p.page_size;
  };
  const Elem* k = static_cast<const Elem*>(p.k) + h * p.k_stride.head;
  const Elem* v = static_cast<const Elem*>(p.v) + h * p.v_stride.head;
  // Chunk c of row `row` of block `block` into smem offset `at` of both tiles.
  auto copy = [&](int at, int64_t block, int64_t row, int c, bool row_ok) {
    const bool k_ok = row_ok && c < cols_k, v_ok = row_ok && c < cols_v;
    cp_async_16_zfill(sK + at, k_ok ? k + block * p.k_stride.batch + row * p.k_stride.row + c : k, k_ok);
    cp_async_16_zfill(sV + at, v_ok ? v + block * p.v_stride.batch + row * p.v_stride.row + c : v, v_ok);
  };
  if constexpr (kThreads % kPerRow != 0) {
    static_assert(!kSwizzle, "the swizzle is written for the layout below");
    for_each_tile_chunk<kRows, kPerRow, kThreads>(tid, [&](int r, int chunk) {
      const int c = chunk * kChunk;
      const bool row_ok = r < rows;
      int64_t page = 0, block = 0;
      if (row_ok) {
        page = page_of_row(j0 + r);
        block = block_of(p, b, page, bad_block);
      }
      copy(r * ld + c, block, j0 + r - page * p.page_size, c, row_ok);
    });
  } else {
    // A thread copies chunk c of rows r0, r0 + kRowStep, ... (as copy_tile_async).
    constexpr int kRowStep = kThreads / kPerRow;
    constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
    const int r0 = tid / kPerRow, c = (tid % kPerRow) * kChunk;
    static_assert(!kSwizzle || (kCols * sizeof(Elem) % 128 == 0 && kRowStep % 4 == 0),
                  "swizzled rows are whole 128-byte lines, and a thread's rows agree modulo 4");
    const int at_even = r0 * ld + (kSwizzle ? c ^ ((r0 & 7) * kChunk) : c);
    const int at_odd = kSwizzle && kRowStep % 8 != 0 ? r0 * ld + (c ^ (((r0 & 7) ^ 4) * kChunk)) : at_even;
    int64_t page = page_of_row(j0 + r0);
    int64_t row = j0 + r0 - page * p.page_size;  // within the page
    int64_t loaded = -1, block = 0;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = r0 + it * kRowStep;
      if (kRows % kRowStep != 0 && r >= kRows) break;
      if (it > 0) {
        row += kRowStep;
        while (row >= p.page_size) {  // once at most for pages of kRowStep keys or more
          row -= p.page_size;
          ++page;
        }
      }
      const bool row_ok = r < rows;
      if (row_ok && page != loaded) {
        loaded = page;
        block = block_of(p, b, page, bad_block);
      }
      copy((it % 2 ? at_odd : at_even) + it * kRowStep * ld, block, row, c, row_ok);
    }
  }
}

}  // namespace flashattn::cuda::sm80
