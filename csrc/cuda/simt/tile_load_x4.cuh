// Global -> shared copy of a tile of rows into fp32 smem, four columns per thread: one 16-byte
// (fp32) or 8-byte (fp16/bf16) global access and one 16-byte smem store per group, instead of
// four scalar ones. Everything outside the valid rows/columns is zero-filled, so the products
// need no bounds checks.
#pragma once
#include <cstdint>

#include <type_traits>

#include "../common/cp_async.cuh"
#include "../common/numeric.cuh"

namespace flashattn::cuda::simt {

__device__ __forceinline__ float4 load4(const float* g) {
  return *reinterpret_cast<const float4*>(g);
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* g) {
  const uint2 raw = *reinterpret_cast<const uint2*>(g);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 load4(const __half* g) {
  const uint2 raw = *reinterpret_cast<const uint2*>(g);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// Which groups of four columns thread `tid` copies: column `col`, rows row0 + i * kRowsPerStep
// for i < kSteps (also what the fp32 forward's TF32 split of V walks, pv_tf32x3.cuh).
template <int kRows, int kCols, int kThreads>
struct TileX4Share {
  static constexpr int kGroups = kCols / 4;
  static_assert(kCols % 4 == 0 && kThreads % kGroups == 0 && kRows % (kThreads / kGroups) == 0,
                "tile must split evenly over the block");
  static constexpr int kRowsPerStep = kThreads / kGroups, kSteps = kRows / kRowsPerStep;
  int col, row0;
  __device__ __forceinline__ explicit TileX4Share(int tid) : col(tid % kGroups * 4), row0(tid / kGroups) {}
};

// `g` points at element (row 0, col 0); rows are `row_stride` elements apart. `vec` says every
// row start is aligned to four elements (checked on the host), so whole in-bounds groups can be
// read as one vector; groups that straddle `cols_valid` fall back to scalar reads. Whole fp32
// groups go through cp.async where the arch has it (the caller commits and waits); everything
// else is stored synchronously.
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_tile_x4(float* s, int ld, const T* g, int64_t row_stride,
                                             int rows_valid, int cols_valid, bool vec, int tid) {
  using Share = TileX4Share<kRows, kCols, kThreads>;
  const Share mine(tid);
  const int col = mine.col;
  if constexpr (std::is_same_v<T, float> && cp_async_available()) {
    // A whole tile (the common case) is copied without a test per group: with them, every
    // group took ~25 instructions and three branches.
    if (vec && rows_valid >= kRows && cols_valid >= kCols) {
#pragma unroll
      for (int it = 0; it < Share::kSteps; ++it) {
        const int row = mine.row0 + it * Share::kRowsPerStep;
        cp_async_16(s + row * ld + col, g + row * row_stride + col);
      }
      return;
    }
  }
#pragma unroll
  for (int it = 0; it < Share::kSteps; ++it) {
    const int row = mine.row0 + it * Share::kRowsPerStep;
    const T* src = g + row * row_stride + col;
    float* dst = s + row * ld + col;
    if constexpr (std::is_same_v<T, float> && cp_async_available()) {
      if (vec && row < rows_valid && col + 4 <= cols_valid) {
        cp_async_16(dst, src);
        continue;
      }
    }
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < rows_valid) {
      if (vec && col + 4 <= cols_valid) {
        x = load4(src);
      } else {
        if (col < cols_valid) x.x = to_acc(src[0]);
        if (col + 1 < cols_valid) x.y = to_acc(src[1]);
        if (col + 2 < cols_valid) x.z = to_acc(src[2]);
        if (col + 3 < cols_valid) x.w = to_acc(src[3]);
      }
    }
    *reinterpret_cast<float4*>(dst) = x;
  }
}

// Whether every row of a [batch][head][row][col] tensor starts on a four-element boundary.
template <class T>
inline bool rows_aligned_x4(const void* ptr, int64_t batch_stride, int64_t head_stride,
                            int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(ptr) % (4 * sizeof(T)) == 0 && batch_stride % 4 == 0 &&
         head_stride % 4 == 0 && row_stride % 4 == 0;
}

}  // namespace flashattn::cuda::simt
