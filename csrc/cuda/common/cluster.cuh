// Thread block clusters (sm_90+): the blocks of a cluster run at once on one GPC and reach each other's
// shared memory (distributed shared memory) between cluster barriers. The host launches a kernel in clusters
// only on sm_90+ (launch_after_prior's `cluster`); below it these functions are never reached and trap.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "check.h"

namespace flashattn::cuda {

// The cluster barrier in two halves: every thread of every block of the cluster arrives, then waits for the
// others. What a thread wrote to shared memory (its own block's or, through distributed shared memory, another
// block's) before it arrived is visible to every thread of the cluster after its wait; work between the two
// halves overlaps the barrier. A block may write another block's shared memory only after a wait that block
// arrived at (it has started, and is done with what it kept there).
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// The address in block `rank`'s shared memory of what `p` points to in this block's.
__device__ __forceinline__ uint32_t cluster_smem_address(const void* p, int rank) {
  uint32_t mapped = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(local), "r"(rank));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return mapped;
}

// Stores into another block's shared memory (an address from cluster_smem_address): no round trip, unlike a
// load from there.
__device__ __forceinline__ void store_cluster_f32(uint32_t address, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(address), "f"(x) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void store_cluster_f32x4(uint32_t address, float4 x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "f"(x.x), "f"(x.y), "f"(x.z),
               "f"(x.w)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// How many clusters of `cluster` blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory,
// already opted into) can be resident at once on this device (0: none; no clusters before sm_90, nor for a
// kernel whose code was compiled for an older architecture, e.g. JIT from compute_80 PTX, where the cluster
// functions above trap): asked once per kernel, device, size, smem and thread.
template <class Kernel>
int clusters_resident(Kernel kernel, int cluster, int threads, size_t smem) {
  const DeviceLimits lim = device_limits();
  if (lim.major < 9 || env_overrides().kernels == KernelsOverride::kSm80) return 0;  // (sm80: an sm_80's paths)
  // (per thread: no locking, no races)
  thread_local std::map<std::tuple<const void*, int, int, size_t>, int> known;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), lim.device, cluster, smem);
  const auto found = known.find(key);
  if (found != known.end()) return found->second;
  cudaFuncAttributes compiled = {};
  if (cudaFuncGetAttributes(&compiled, kernel) != cudaSuccess || compiled.ptxVersion < 90) {
    (void)cudaGetLastError();
    known[key] = 0;
    return 0;
  }
  // (above 8 blocks, the portable limit, a kernel must opt in; H100 / H200 take up to 16)
  if (cluster > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    known[key] = 0;
    return 0;
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(cluster));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = smem;
  config.attrs = attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) clusters = 0;
  (void)cudaGetLastError();  // (a refusal is an answer here, not an error of the call)
  known[key] = clusters;
  return clusters;
}

}  // namespace flashattn::cuda
