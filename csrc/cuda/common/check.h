// Host-side CUDA error checks. A failure is recorded, not thrown: a C++ exception crossing the
// stable-ABI library kills the process on torch 2.11 (docs/architecture.md). The first failure of
// a call is kept per thread; run_fwd / run_bwd hand it back to the ops, which raise it in Python.
// Launchers that meet a failure stop launching where they can; whatever ran after it is discarded
// with the call.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

#include "../plan.h"

namespace flashattn::cuda {

inline std::string& pending_error() {
  thread_local std::string error;
  return error;
}
// Records `message` unless an earlier failure of this call is recorded already.
inline void fail(std::string message) {
  if (pending_error().empty()) pending_error() = "flashattn_ext CUDA backend: " + std::move(message);
}
inline bool failed() { return !pending_error().empty(); }
// The recorded failure ("" when none), cleared.
inline std::string take_error() { return std::exchange(pending_error(), std::string()); }

// False (and the failure recorded) when err is not cudaSuccess.
inline bool check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  fail(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  return false;
}

// True (and the failure recorded) when a grid of `blocks` blocks is more than CUDA launches.
inline bool grid_too_large(int64_t blocks, const char* kernel) {
  if (blocks <= 0x7fffffff) return false;
  fail(std::string(kernel) + ": a grid of " + std::to_string(blocks) + " blocks, more than 2^31 - 1");
  return true;
}

// Launch-time errors (bad configuration, too much shared memory, no kernel image for the arch).
inline bool check_launch(const char* kernel) {
  return check_cuda(cudaGetLastError(), (std::string("launching ") + kernel).c_str());
}

// The current device and what it offers a block: shared memory (opt-in maximum) and compute
// capability. Every launcher asks; the attributes are read once per device (and thread).
struct DeviceLimits {
  int device = 0;
  size_t smem_optin = 0;
  int major = 0;
  int sms = 0;  // streaming multiprocessors
  int minor = 0;
};
inline DeviceLimits device_limits() {
  constexpr int kMaxDevices = 64;
  thread_local DeviceLimits cache[kMaxDevices];  // per thread: no locking, no races
  int dev = 0;
  // On a failure: limits that launch nothing big and divide by nothing (the call is failed anyway).
  if (!check_cuda(cudaGetDevice(&dev), "cudaGetDevice")) return DeviceLimits{0, 0, 0, 1};
  DeviceLimits& d = cache[dev < kMaxDevices ? dev : 0];
  if (d.major == 0 || d.device != dev) {
    int smem = 0, major = 0, minor = 0, sms = 0;
    const bool ok = check_cuda(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                               "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)") &&
                    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
                               "cudaDeviceGetAttribute(ComputeCapabilityMajor)") &&
                    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev),
                               "cudaDeviceGetAttribute(ComputeCapabilityMinor)") &&
                    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
                               "cudaDeviceGetAttribute(MultiProcessorCount)");
    if (!ok) return DeviceLimits{dev, 0, 0, 1};  // (not cached: asked again next call)
    // FLASHATTN_CUDA_SMEM_LIMIT caps the shared memory per block the kernels may take (../plan.h).
    const int64_t cap = env_overrides().smem_limit;
    if (cap > 0 && cap < smem) smem = int(cap);
    d = DeviceLimits{dev, size_t(smem), major, sms, minor};
  }
  return d;
}

// Compute capability 8.0 or newer and `smem` bytes of shared memory per block available.
inline bool tensor_cores_usable(size_t smem) {
  const DeviceLimits lim = device_limits();
  return lim.major >= 8 && smem <= lim.smem_optin;
}

// Blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) resident per SM.
template <class Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

// The dynamic shared memory this thread has opted `kernel` into on `device` (0: none yet).
inline size_t& smem_opted_in(const void* kernel, int device) {
  thread_local std::map<std::pair<const void*, int>, size_t> opted;  // per thread: no locking, no races
  return opted[{kernel, device}];
}

// Opt a kernel into more than 48 KB of dynamic shared memory; false (a clear failure recorded)
// when the device cannot provide it. The attribute stays with the kernel on the device, so it is
// set once per kernel, device and thread, and again only for more bytes: cudaFuncSetAttribute
// costs host time on every call otherwise.
template <class Kernel>
bool set_smem(Kernel kernel, size_t bytes, const char* name) {
  if (bytes <= 48 * 1024) return true;
  const DeviceLimits lim = device_limits();
  if (bytes > lim.smem_optin) {
    fail(std::string(name) + " needs " + std::to_string(bytes) + " bytes of shared memory per block, device " +
         std::to_string(lim.device) + " allows " + std::to_string(lim.smem_optin));
    return false;
  }
  size_t& opted = smem_opted_in(reinterpret_cast<const void*>(kernel), lim.device);
  if (bytes <= opted) return true;
  if (!check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                  (std::string("cudaFuncSetAttribute(") + name + ")").c_str()))
    return false;
  opted = bytes;
  return true;
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
    if (!set_smem(kKernel, smem, name)) return 0;
    n = blocks_per_sm(kKernel, threads, smem);
  }
  return n;
}

}  // namespace flashattn::cuda
