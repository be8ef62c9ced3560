// Programmatic dependent launch (sm_90+): a kernel launched with launch_after_prior() may start while
// the kernel before it in the stream still runs (its launch and first instructions overlap that
// kernel's tail), and waits for that kernel's grid, memory included, in wait_for_prior_grids() before it
// reads anything. The kernel before it lets it start early with allow_dependent_launch(); without
// that call it starts as the earlier grid's blocks exit. Before sm_90 both are no-ops and the launch is
// a plain one. A decode step is two short launches (the append, then the attention), and the gap
// between them is a visible share of its time.
#pragma once
#include <cuda_runtime.h>

#include "check.h"

namespace flashattn::cuda {

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launches kernel<<<grid, threads, smem, stream>>>(args...) as a dependent launch where the device
// has it (sm_90+); the kernel must call wait_for_prior_grids() before its first global read. `cluster` > 1
// (sm_90+ only, a divisor of `grid`): in thread block clusters of that many blocks (common/cluster.cuh).
template <class... Params, class... Args>
void launch_after_prior(void (*kernel)(Params...), unsigned grid, unsigned cluster, unsigned threads, size_t smem,
                        cudaStream_t stream, const char* name, Args&&... args) {
  cudaLaunchAttribute attribute[2];
  unsigned count = 0;
  if (cluster > 1) {
    attribute[count].id = cudaLaunchAttributeClusterDimension;
    attribute[count].val.clusterDim.x = cluster;
    attribute[count].val.clusterDim.y = 1;
    attribute[count].val.clusterDim.z = 1;
    ++count;
  }
  attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // (last: the one a retry drops)
  attribute[count].val.programmaticStreamSerializationAllowed = 1;
  ++count;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  if (device_limits().major >= 9) {
    config.numAttrs = count;
    if (cudaLaunchKernelEx(&config, kernel, args...) == cudaSuccess) return;
    (void)cudaGetLastError();  // (a driver or capture that refuses the dependent launch: the plain one below)
    config.numAttrs = count - 1;
  }
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...),
             (std::string("launching ") + name).c_str());
}

}  // namespace flashattn::cuda
