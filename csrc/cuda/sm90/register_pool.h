// Host side of the warp-specialized kernels' register hand-over (setmaxnreg, common/wgmma.cuh).
#pragma once
#include <cuda_runtime.h>

namespace flashattn::cuda::sm90 {

// Whether the block's register pool holds what kernel kKernel's warpgroups take after their hand-over
// (one producer warpgroup at Cfg::kProducerRegs per thread, Cfg::kConsumers at kConsumerRegs; an .inc
// beyond the pool would wait forever). ptxas gives a kernel that moves registers the whole per-thread
// share its launch bounds allow (168 at 384 threads); checked once, against the image loaded, in case a
// build does otherwise.
template <auto kKernel, class Cfg>
bool register_pool_holds() {
  static const bool holds = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kKernel) != cudaSuccess) return false;
    return attr.numRegs * Cfg::kThreads >= 128 * Cfg::kProducerRegs + 128 * Cfg::kConsumers * Cfg::kConsumerRegs;
  }();
  return holds;
}

}  // namespace flashattn::cuda::sm90
