// Global -> shared tile copies for the tensor-core kernels: 16-byte cp.async chunks, rows
// padded by 8 elements in smem or swizzled (either keeps ldmatrix and the fragment loads
// conflict-free; the tile configs say which), everything outside
// the valid rows and columns zero-filled so the products need no bounds checks and garbage
// (or NaN) past a ragged edge never meets a zero probability. The host checks that pointers,
// row strides and the valid column counts are multiples of 16 bytes.
#pragma once
#include <cstdint>

#include "cp_async.cuh"
#include "mma.cuh"

namespace flashattn::cuda {

template <class Elem>
__host__ __device__ constexpr int chunk_elems() { return 16 / int(sizeof(Elem)); }

// Calls chunk(r, c) for each 16-byte chunk c of each row r of a tile of kRows rows of kPerRow
// chunks, the block's kThreads threads walking the tile's chunks in order, kThreads at a time (a
// division by the constant kPerRow per chunk): the copies' layout where a row's chunks do not divide
// the block (dims 96, 192).
template <int kRows, int kPerRow, int kThreads, class Chunk>
__device__ __forceinline__ void for_each_tile_chunk(int tid, Chunk&& chunk) {
  constexpr int kIters = (kRows * kPerRow + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = tid + it * kThreads;
    if ((kRows * kPerRow) % kThreads != 0 && i >= kRows * kPerRow) break;
    chunk(i / kPerRow, i % kPerRow);
  }
}

// A thread's chunks of a tile in the layout where a row's chunks divide the block: column chunk c of rows r0, r0 +
// kRowStep, ... (kIters of them); at(it) the chunk's offset in the tile (pitch ld) for row r0 + it * kRowStep, padded
// or swizzled (kSwizzle: below). Swizzled, a thread's rows fall on chunk c ^ (r % 8): where kRowStep is a multiple of
// 4, r % 8 keeps its low bits from one row to the next and an odd multiple flips bit 2 (two column offsets in turn,
// even and odd); at steps of 1 or 2 rows (a warp copying a 16-row segment, whose rows of 16 or 32 chunks take 2 or
// 1 row a pass) each row's XOR is its own.
template <int kRows, int kCols, int kThreads, bool kSwizzle, class Elem>
struct TileRowChunks {
  static constexpr int kChunk = chunk_elems<Elem>(), kPerRow = kCols / kChunk, kRowStep = kThreads / kPerRow;
  static constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
  static constexpr bool kTwoOffsets = !kSwizzle || kRowStep % 4 == 0;  // even / odd serve every row
  static_assert(kThreads % kPerRow == 0, "a row's chunks divide the block");
  static_assert(!kSwizzle || (kCols * sizeof(Elem) % 128 == 0 && (kRowStep % 4 == 0 || 8 % kRowStep == 0)),
                "swizzled rows are whole 128-byte lines, and a thread's rows agree modulo 4 or step through the 8");
  int r0, c, even, odd;
  __device__ __forceinline__ TileRowChunks(int ld, int tid) : r0(tid / kPerRow), c((tid % kPerRow) * kChunk) {
    even = r0 * ld + (kSwizzle ? c ^ ((r0 & 7) * kChunk) : c);
    odd = kSwizzle && kRowStep % 8 != 0 ? r0 * ld + (c ^ (((r0 & 7) ^ 4) * kChunk)) : even;
  }
  __device__ __forceinline__ int at(int it, int ld) const {
    if constexpr (kTwoOffsets) {
      return (it % 2 ? odd : even) + it * kRowStep * ld;
    } else {
      // (r0 < kRowStep <= 2 and it kRowStep even where kRowStep is 2: (r0 + it kRowStep) % 8 is r0's bit XOR
      // (it kRowStep) % 8, so even's chunk XOR a constant)
      return (even ^ (((it * kRowStep) & 7) * kChunk)) + it * kRowStep * ld;
    }
  }
};

// Rows `kRows` x columns `kCols` from `g` (rows `g_ld` elements apart) into `s` (pitch `ld`).
// Where a row's chunks divide the block (dims 32, 64, 128, 256), a thread copies one 16-byte
// column chunk of every kThreads / kPerRow-th row: the trip count is a constant and the address
// arithmetic stays out of the unrolled loop (a strided loop from `tid` cost ~25 instructions per
// chunk). Otherwise (dims 96, 192) the block walks the tile's chunks in order, kThreads at a
// time (a division by the constant kPerRow per chunk).
// kFullTilePath (in the layout where a row's chunks divide the block): a full tile (every row
// and column valid: all but a sequence's last tile and padded head dims) takes a path without
// predicates, its source stepping by one stride. The per-chunk bounds tests and 64-bit selects
// cost ~14 instructions per chunk where that path needs ~3; whether it is faster depends on the
// kernel (FwdConfig::kFullTileCopies says where it is taken).
// kSwizzle: the tile is stored swizzled instead of padded: rows of exactly kCols elements (ld ==
// kCols, a multiple of 64 16-bit elements, so whole 128-byte lines), and 16-byte chunk c of row
// r at chunk c ^ (r % 8) of its line. A warp's copy of two rows then writes whole lines (with padded
// rows 272 bytes apart, the second row's chunks straddled lines: ncu counted 24 L2 sectors per
// 16 moved and 6.5 excess smem wavefronts per copy instruction), and ldmatrix's 8 rows of one
// chunk still hit 8 different banks. The tile starts 128-byte aligned; readers XOR their
// addresses the same way (SwizzledAddress below).
// A chunk outside the valid rows / columns is zero-filled with its source ignored (cp_async_16_zfill),
// so its address may lie past the tensor: it steps on with the others. kClampSource: such a chunk
// names `g` instead (a 64-bit select per chunk; the clamp the copies had before the ignore-src form).
// Without the select the backward measured +0.3..+4.5% on every row at dims 64 / 128 / 256, the
// forward -0.3..-1.8% (H200, bf16; its key loops' code placement moved): the forward clamps. The
// walk over a tile's chunks (dims 96, 192) always clamps: unclamped, those backward rows measured
// -0.3..-2%.
template <int kRows, int kCols, int kThreads, bool kFullTilePath = false, bool kSwizzle = false,
          bool kClampSource = false, class Elem>
__device__ __forceinline__ void copy_tile_async(Elem* s, int ld, const Elem* g, int64_t g_ld,
                                                int rows, int cols, int tid) {
  constexpr int kChunk = chunk_elems<Elem>();
  constexpr int kPerRow = kCols / kChunk;
  static_assert(kCols % kChunk == 0, "tile width is a whole number of 16-byte chunks");
  if constexpr (kThreads % kPerRow != 0) {
    static_assert(!kFullTilePath && !kSwizzle, "the full-tile path and the swizzle are written for the layout below");
    for_each_tile_chunk<kRows, kPerRow, kThreads>(tid, [&](int r, int chunk) {
      const int c = chunk * kChunk;
      const bool valid = c < cols && r < rows;
      cp_async_16_zfill(s + r * ld + c, valid ? g + r * g_ld + c : g, valid);
    });
  } else {
    using Rows = TileRowChunks<kRows, kCols, kThreads, kSwizzle, Elem>;
    constexpr int kRowStep = Rows::kRowStep, kIters = Rows::kIters;
    const Rows thread(ld, tid);
    const int r0 = thread.r0, c = thread.c;
    const Elem* src = g + r0 * g_ld + c;
    const int64_t src_step = kRowStep * g_ld;
    Elem* const dst_even = s + thread.even;
    Elem* const dst_odd = s + thread.odd;
    auto dst = [&](int it) {
      if constexpr (Rows::kTwoOffsets) {
        return (it % 2 ? dst_odd : dst_even) + it * kRowStep * ld;
      } else {
        return s + thread.at(it, ld);
      }
    };
    if (kFullTilePath && rows >= kRows && cols >= kCols) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        if (kRows % kRowStep != 0 && r0 + it * kRowStep >= kRows) break;
        cp_async_16(dst(it), src);
        src += src_step;
      }
      return;
    }
    const bool col_ok = c < cols;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = r0 + it * kRowStep;
      if (kRows % kRowStep != 0 && r >= kRows) break;
      const bool valid = col_ok && r < rows;
      cp_async_16_zfill(dst(it), kClampSource && !valid ? g : src + it * src_step, valid);
    }
  }
}

// The smem addresses the ldmatrix loaders read a swizzled tile of copy_tile_async at, rows
// kRowBytes apart. `base` once per tile and lane: the lane's row (the warp's first row plus the
// loader's lane row, fragments.cuh's LaneSpot) and 16-byte chunk. `at` per product step, `row0`
// rows and `chunk0` chunks further (compile-time constants in the unrolled loops). A step must
// not carry within the lane's line: row0 a multiple of 8 and chunk0's bits below 8 none of the
// lane chunk's. Then the step XORs the chunk bits of the address (1 instruction) and adds the
// rest as the ldmatrix's immediate offset; XORing a full address per load instead cost 2
// instructions per load and 16 bytes of spills (dims 64 and 128). Padded tiles are read through
// pointers (fragments.cuh).
template <int kRowBytes>
struct SwizzledAddress {
  static_assert(kRowBytes % 128 == 0, "swizzled rows are whole 128-byte lines");
  static __device__ __forceinline__ uint32_t base(const void* tile, int row, int chunk) {
    chunk = (chunk & ~7) | ((chunk ^ row) & 7);
    return smem_addr(tile) + uint32_t(row * kRowBytes + chunk * 16);
  }
  static __device__ __forceinline__ uint32_t at(uint32_t base, int row0, int chunk0) {
    return (base ^ uint32_t((chunk0 & 7) << 4)) + uint32_t(row0 * kRowBytes + (chunk0 >> 3) * 128);
  }
};

}  // namespace flashattn::cuda
