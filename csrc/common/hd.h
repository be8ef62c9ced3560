// FLASHATTN_HD marks the small functions of csrc/common/ that run on the host (CPU kernels)
// and in CUDA kernels alike, so that both backends compute every score the same way.
#pragma once

#ifdef __CUDACC__
#define FLASHATTN_HD __host__ __device__ __forceinline__
#else
#define FLASHATTN_HD inline
#endif

// FLASHATTN_HOST_DEVICE: the same, left to the compiler to inline (small host-visible helpers of
// the CUDA code that the kernel plan reads too).
#ifdef __CUDACC__
#define FLASHATTN_HOST_DEVICE __host__ __device__ inline
#else
#define FLASHATTN_HOST_DEVICE inline
#endif
