// Host-side CUDA error checks that throw with a message naming the failing step.
#pragma once
#include <cuda_runtime.h>

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

// Opt a kernel into more than 48 KB of dynamic shared memory, with a clear error when the
// device cannot provide it.
template <class Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* name) {
  if (bytes <= 48 * 1024) return;
  int dev = 0, max_optin = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  if (bytes > size_t(max_optin)) {
    throw std::runtime_error(std::string("flashattn_ext CUDA backend: ") + name + " needs " +
                             std::to_string(bytes) + " bytes of shared memory per block, device " +
                             std::to_string(dev) + " allows " + std::to_string(max_optin));
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
}

}  // namespace flashattn::cuda
