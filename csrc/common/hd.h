// FLASHATTN_HD marks the small functions of csrc/common/ that run on the host (CPU kernels)
// and in CUDA kernels alike, so that both backends compute every score the same way.
#pragma once

#ifdef __CUDACC__
#define FLASHATTN_HD __host__ __device__ __forceinline__
#else
#define FLASHATTN_HD inline
#endif
