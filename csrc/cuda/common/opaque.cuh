// `x`, hidden from the compiler's loop-invariant code motion and common-subexpression
// elimination (an empty asm it cannot see through; ptxas sees the plain value): what is derived
// from it is formed where it is used instead of once ahead of a loop and held (in registers, or
// spilled) across it. The warp-specialized fp32 forward, which computes two query tiles per block,
// takes it for the addresses of its per-tile steps (+1 KB of spills with its two-tile loop
// without it); the sm80 forward for its staged output's addresses, formed after the key loop.
#pragma once
#include <cstdint>

namespace flashattn::cuda {

__device__ __forceinline__ int64_t opaque(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
template <class T>
__device__ __forceinline__ T* opaque(T* x) {
  asm volatile("" : "+l"(x));
  return x;
}

}  // namespace flashattn::cuda
