// The tensor memory accelerator (TMA, sm_90a): one thread copies a whole box of a tensor from global
// memory into smem, asynchronously, described by a tensor map (CUtensorMap: base, sizes, strides,
// box, swizzle) that the host encodes per call (sm90/tma_map.h). The copy's bytes count toward the
// transaction count of an mbarrier, whose phase completes once they have all landed; its waiters
// then see them (the copy writes through the async proxy, which wgmma also reads through). Rows of
// a box outside the tensor land as zeros. On other targets the bodies compile to nothing, and
// dispatch launches the kernels that use them only on sm_90.
#pragma once
#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "mma.cuh"     // smem_addr
#include "wgmma.cuh"   // FLASHATTN_WGMMA

namespace flashattn::cuda {

// Makes mbarrier_init's writes visible to the async proxy (the TMA unit that completes the copies'
// transactions on them); before the block's first barrier.
__device__ __forceinline__ void fence_mbar_init() {
#ifdef FLASHATTN_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Arrives on `bar` (one of its mbar_init count) and adds `bytes` to the transactions that its current
// phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef FLASHATTN_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// Fetches a tensor map (a __grid_constant__ kernel parameter) into the TMA unit's cache ahead of its
// first copy.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#ifdef FLASHATTN_WGMMA
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// Copies the box of a rank-4 tensor map whose first element is at coordinates (c0, c1, c2, c3)
// (c0 the innermost) into smem at `dst`; its bytes complete on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
#ifdef FLASHATTN_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}

}  // namespace flashattn::cuda

namespace flashattn::cuda {

// Adds `bytes` of fp32 values at smem `src` into global memory at `dst` (both 16-byte aligned, bytes a
// multiple of 16), element by element, as one asynchronous bulk operation of the TMA unit: the adds are
// atomic per element, as red.global.add would be, without a thread issuing them. Completion is tracked
// per thread in bulk groups (bulk_commit, bulk_wait_read, bulk_wait).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t bytes) {
#ifdef FLASHATTN_WGMMA
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef FLASHATTN_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's bulk groups but the last kPending have read their smem sources (it may
// then be written again) ...
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef FLASHATTN_WGMMA
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}
// ... or have completed.
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
#ifdef FLASHATTN_WGMMA
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace flashattn::cuda
