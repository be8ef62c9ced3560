// The backward's dQ accumulation: a warp adds its accumulator atoms of a dQ tile into the fp32
// (fp64) accumulator in global memory with atomics, 2 or (sm_90) 4 adjacent values at a time,
// where dq_layout.cuh places them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/dq_layout.cuh"

namespace flashattn::cuda::sm80 {

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

// Whether a lane can add 4 adjacent fp32 values with one atomic (sm_90's vector reduction).
template <class Acc>
constexpr bool kQuadAtomics =
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    std::is_same_v<Acc, float>;
#else
    false;
#endif

// Adds a lane's values of two adjacent 8-column accumulator atoms (a: columns 2t, 2t + 1 of the
// first, b: of the second) with one 4-wide atomic per lane instead of two 2-wide ones: quad
// neighbours swap a pair, so an even-t lane holds columns 2t .. 2t + 3 of the first atom and an
// odd-t lane 2t - 2 .. 2t + 1 of the second; `dst` is where those 4 columns lie (16-byte
// aligned). Half the atomic instructions: their queue and the registers they hold were ~10% of
// the backward's stall samples. Every lane of the warp must call it (shuffles); `ok` masks the
// add. Called only where kQuadAtomics holds (sm_90+).
__device__ __forceinline__ void atomic_add_atom_pair(float* dst, float a0, float a1, float b0, float b1, bool ok,
                                                     int t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool odd = t & 1;
  const float r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
  const float4 v = odd ? make_float4(r0, r1, b0, b1) : make_float4(a0, a1, r0, r1);
  if (ok) atomicAdd(reinterpret_cast<float4*>(dst), v);
#endif
}

// Adds a warp's dQ atoms dq[0 .. kCA) (rows tile_row + row0 + g, + 8; columns col0 + 8d + 2t,
// + 1, as mma.sync's accumulators hold them; col0 a multiple of 16) into the accumulator: fp32
// in the blocked layout, fp64 row-major (dq_layout.cuh). Rows at or past tile_row + rows_valid
// and columns at or past E are skipped. Every lane of the warp must call it (the 4-wide path
// shuffles).
template <int kCA, class Acc>
__device__ __forceinline__ void add_dq_atoms(Acc* accum, int64_t tile_row, const Acc (&dq)[kCA][4], int row0,
                                             int col0, int rows_valid, int E, int lane) {
  const TensorCoreDqLayout<Acc> layout{E};
  const int g = lane >> 2, t = lane & 3;
  // The column test is skipped when the warp's columns all lie below E (the usual case: E a
  // multiple of 8 * kCA).
  const bool all_cols = col0 + 8 * kCA <= E;
  if constexpr (kQuadAtomics<Acc> && kCA % 2 == 0) {
    if (all_cols) {  // warp-uniform (shuffles inside)
      // The lane's 4 columns after the swap: 2t of the first atom, or 2t - 2 of the second.
      Acc* dst = accum + layout.offset(tile_row + row0 + g, col0 + 8 * (t & 1) + 4 * (t >> 1));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int d = 0; d < kCA; d += 2)  // atom pair d is 16-column block col0 / 16 + d / 2
          atomic_add_atom_pair(dst + r * layout.eight_rows() + 64 * d, dq[d][2 * r], dq[d][2 * r + 1],
                               dq[d + 1][2 * r], dq[d + 1][2 * r + 1], row0 + g + 8 * r < rows_valid, t);
      }
      return;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= rows_valid) continue;
#pragma unroll
    for (int d = 0; d < kCA; ++d) {
      const int col = col0 + 8 * d + 2 * t;
      if (all_cols || col < E) atomic_add_pair(accum + layout.offset(tile_row + row, col), dq[d][2 * r], dq[d][2 * r + 1]);
    }
  }
}

}  // namespace flashattn::cuda::sm80
