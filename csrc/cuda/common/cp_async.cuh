// cp.async (sm_80+): global -> shared copies that bypass registers, so the next tile can load
// while the current one is being multiplied. On older archs the helpers compile to nothing and
// callers copy synchronously instead (cp_async_available() tells them which).
#pragma once

namespace flashattn::cuda {

__device__ constexpr bool cp_async_available() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return true;
#else
  return false;
#endif
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src));
#endif
}

// As cp_async_16, but reads only the first `bytes` (0..16) of the chunk and zero-fills the
// rest; `gmem_src` must still be a valid address when `bytes` is 0.
__device__ __forceinline__ void cp_async_16_part(void* smem_dst, const void* gmem_src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(bytes));
#endif
}

// As cp_async_16, but writes 16 zero bytes when `valid` is false, ignoring `gmem_src` (PTX's
// ignore-src operand): it may then point anywhere, so a caller need not clamp it to a valid row
// (tile_copy.cuh says where that pays).
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile(
      "{\n.reg .pred ignore;\nsetp.eq.u32 ignore, %2, 0;\n"
      "cp.async.cg.shared.global [%0], [%1], 16, ignore;\n}\n" ::"r"(dst),
      "l"(gmem_src), "r"(unsigned(valid)));
#endif
}

// One 4- or 8-byte element (a row's LSE or D), zero-filled with `gmem_src` ignored when `valid`
// is false (as cp_async_16_zfill). Sizes below 16 bytes go through L1 (.ca); .cg takes only 16.
template <class T>
__device__ __forceinline__ void cp_async_elem_zfill(T* smem_dst, const T* gmem_src, bool valid) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile(
      "{\n.reg .pred ignore;\nsetp.eq.u32 ignore, %3, 0;\n"
      "cp.async.ca.shared.global [%0], [%1], %2, ignore;\n}\n" ::"r"(dst),
      "l"(gmem_src), "n"(int(sizeof(T))), "r"(unsigned(valid)));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

}  // namespace flashattn::cuda
