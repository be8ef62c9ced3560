// Block-level synchronisation beyond __syncthreads, for kernels whose warps take different roles:
// named barriers (a subset of the block's warps) and mbarriers in smem (sm_80+; on older archs
// their bodies compile to nothing, and dispatch never launches the kernels that use them there).
#pragma once
#include <cstdint>

#include "mma.cuh"  // smem_addr

namespace flashattn::cuda {

// Named barrier `id` (0 is __syncthreads) among `threads` threads. The form without .aligned, so
// that warps may come to it from code with lane-dependent branches.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at named barrier `id` without waiting (the threads that bar_sync on it wait for these).
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// bar_sync that also returns whether `pred` holds for any participating thread.
__device__ __forceinline__ bool bar_sync_or(int id, int threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// mbarriers complete a phase when their count of threads has arrived. Arrive releases the thread's
// earlier writes; a wait for a phase acquires them. (For a hand-over between warp roles: named
// barriers that both roles sync on measured 1-2% slower in fwd_simt_ws.cuh, and compute-sanitizer's
// racecheck reported the hand-over through them as a race.)
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_addr(bar))
               : "memory");
#endif
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed; a thread that
// waits for the phase then sees them. .noinc: the arrival counts against mbar_init's count (one
// per thread that has its copies tracked this way).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// Waits until the phase of parity `parity` (phase k has parity k % 2) has completed. The retry
// loop is in the PTX (labels are local to the braces): written as a C++ loop around one wait, it
// made ptxas spill 240 more bytes in fwd_simt_ws.cuh's P V warps.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // (try_wait suspends the warp for a while instead of spinning)
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n @!done bra WAIT;\n}\n" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n @!done bra WAIT;\n}\n" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

}  // namespace flashattn::cuda
