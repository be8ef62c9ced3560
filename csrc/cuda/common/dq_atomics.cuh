// The backward's dQ accumulation: a warp adds its accumulator atoms of a dQ tile into the fp32
// (fp64) accumulator in global memory with atomics, where dq_layout.cuh places them: fp32 atoms
// of 16-row-aligned groups 4 values per lane and atomic (sm_90), the rest 2 at a time.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "dq_layout.cuh"

namespace flashattn::cuda {

// Adds a pair of adjacent accumulator values into global memory.
__device__ __forceinline__ void atomic_add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}
__device__ __forceinline__ void atomic_add_pair(double* dst, double x, double y) {
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
}

// Adds 4 adjacent fp32 values (16-byte aligned): one vector atomic on sm_90.
__device__ __forceinline__ void atomic_add_quad(float* dst, const float (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(c[0], c[1], c[2], c[3]));
#else
  atomic_add_pair(dst, c[0], c[1]);
  atomic_add_pair(dst + 2, c[2], c[3]);
#endif
}

// Adds a warp's dQ atoms dq[i][d] (rows tile_row + row0 + 16 i + g and + 8, columns
// col0 + 8 d + 2t and + 1, as mma.sync's accumulators hold them; row0 a multiple of 16, col0 of
// 8) into the accumulator: fp32 in the blocked layout, fp64 row-major (dq_layout.cuh). Rows at
// or past tile_row + rows_valid and columns at or past E are skipped.
template <int kRG, int kCA, class Acc>
__device__ __forceinline__ void add_dq_atoms(Acc* accum, int64_t tile_row, const Acc (&dq)[kRG][kCA][4], int row0,
                                             int col0, int rows_valid, int E, int lane) {
  const TensorCoreDqLayout<Acc> layout{E};
  // fp32, a 16-row-aligned tile whose rows and columns the warp's atoms cover in full (the
  // usual case; warp-uniform): each atom (i, d) is a block of the layout (rows row0 + 16 i,
  // columns col0 + 8 d), lane 4g + t's 4 values lying together at 4 lane in it.
  if constexpr (std::is_same_v<Acc, float>) {
    if ((tile_row & 15) == 0 && row0 + 16 * kRG <= rows_valid && col0 + 8 * kCA <= E) {
      float* dst = accum + (tile_row + row0) * layout.cols_padded + (col0 >> 3) * 128 + 4 * lane;
#pragma unroll
      for (int i = 0; i < kRG; ++i)
#pragma unroll
        for (int d = 0; d < kCA; ++d) atomic_add_quad(dst + i * 16 * layout.cols_padded + 128 * d, dq[i][d]);
      return;
    }
  }
  // Else pair by pair (2 adjacent columns lie together in both layouts).
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kRG; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 16 * i + g + 8 * r;
      if (row >= rows_valid) continue;
#pragma unroll
      for (int d = 0; d < kCA; ++d) {
        const int col = col0 + 8 * d + 2 * t;
        if (col < E) atomic_add_pair(accum + layout.offset(tile_row + row, col), dq[i][d][2 * r], dq[i][d][2 * r + 1]);
      }
    }
  }
}

}  // namespace flashattn::cuda
