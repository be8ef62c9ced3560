// Host-side CUDA error checks that throw with a message naming the failing step.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace flashattn::cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flashattn_ext CUDA backend: ") + what + " failed: " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Launch-time errors (bad configuration, too much shared memory, no kernel image for the arch).
inline void check_launch(const char* kernel) {
  check_cuda(cudaGetLastError(), (std::string("launching ") + kernel).c_str());
}

// The current device and what it offers a block: shared memory (opt-in maximum) and compute
// capability. Every launcher asks; the attributes are read once per device (and thread).
struct DeviceLimits {
  int device = 0;
  size_t smem_optin = 0;
  int major = 0;
  int sms = 0;  // streaming multiprocessors
};
inline DeviceLimits device_limits() {
  constexpr int kMaxDevices = 64;
  thread_local DeviceLimits cache[kMaxDevices];  // per thread: no locking, no races
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  DeviceLimits& d = cache[dev < kMaxDevices ? dev : 0];
  if (d.major == 0 || d.device != dev) {
    int smem = 0, major = 0, sms = 0;
    check_cuda(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
               "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
               "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute(MultiProcessorCount)");
    // FLASHATTN_CUDA_SMEM_LIMIT caps the shared memory per block the kernels may take, to test
    // on one GPU what runs on GPUs with less (99 KB = 101376 on sm_86/89/120, 163 KB = 166912
    // on sm_80/87).
    if (const char* cap = std::getenv("FLASHATTN_CUDA_SMEM_LIMIT")) {
      const long v = std::strtol(cap, nullptr, 10);
      if (v > 0 && v < smem) smem = int(v);
    }
    d = DeviceLimits{dev, size_t(smem), major, sms};
  }
  return d;
}

// Blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) resident per SM.
template <class Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

// Opt a kernel into more than 48 KB of dynamic shared memory, with a clear error when the
// device cannot provide it.
template <class Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* name) {
  if (bytes <= 48 * 1024) return;
  const DeviceLimits lim = device_limits();
  const int dev = lim.device;
  const size_t max_optin = lim.smem_optin;
  if (bytes > max_optin) {
    throw std::runtime_error(std::string("flashattn_ext CUDA backend: ") + name + " needs " +
                             std::to_string(bytes) + " bytes of shared memory per block, device " +
                             std::to_string(dev) + " allows " + std::to_string(max_optin));
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
}

// blocks_per_sm of kernel `kKernel`, its smem limit set first (set_smem), asked once per device and
// thread: the occupancy query costs host time on every call otherwise.
template <auto kKernel>
int blocks_per_sm_cached(int threads, size_t smem, const char* name) {
  constexpr int kMaxDevices = 64;
  thread_local int cache[kMaxDevices] = {};
  const int dev = device_limits().device;
  int& n = cache[dev < kMaxDevices ? dev : 0];
  if (n == 0 || dev >= kMaxDevices) {
    set_smem(kKernel, smem, name);
    n = blocks_per_sm(kKernel, threads, smem);
  }
  return n;
}

}  // namespace flashattn::cuda
