// Hopper forward kernels (wgmma): fp16 and bf16 at head dims 128 and 256.
#include <cstdlib>
#include <cstring>

#include "fwd_sm90.cuh"
#include "launch.h"

namespace flashattn::cuda::sm90 {

namespace {

__global__ void wgmma_probe_kernel(int* has_wgmma) {
#ifdef FLASHATTN_WGMMA
  *has_wgmma = 1;
#else
  *has_wgmma = 0;
#endif
}

}  // namespace

WgmmaMode wgmma_mode() {
  static const WgmmaMode mode = [] {
    const char* v = std::getenv("FLASHATTN_CUDA_KERNELS");
    if (v != nullptr && std::strcmp(v, "sm80") == 0) return WgmmaMode::kOff;
    if (v != nullptr && std::strcmp(v, "wgmma") == 0) return WgmmaMode::kForced;
    return WgmmaMode::kAuto;
  }();
  return mode;
}

bool wgmma_compiled(cudaStream_t stream) {
  constexpr int kMaxDevices = 64;
  thread_local int cache[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  const int dev = device_limits().device;
  int& known = cache[dev < kMaxDevices ? dev : 0];
  if (known != 0 && dev < kMaxDevices) return known == 1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) return false;
  int* flag = nullptr;
  int host = 0;
  check_cuda(cudaMalloc(&flag, sizeof(int)), "cudaMalloc(wgmma probe)");
  wgmma_probe_kernel<<<1, 1, 0, stream>>>(flag);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaFree(flag);
  check_cuda(err, "the wgmma probe kernel");
  known = host == 1 ? 1 : 2;
  return host == 1;
}

template bool fwd_wgmma<__nv_bfloat16, 128>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__half, 128>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 256>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__half, 256>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma_serves<__nv_bfloat16, 128>(const FwdParams&);
template bool fwd_wgmma_serves<__half, 128>(const FwdParams&);
template bool fwd_wgmma_serves<__nv_bfloat16, 256>(const FwdParams&);
template bool fwd_wgmma_serves<__half, 256>(const FwdParams&);

}  // namespace flashattn::cuda::sm90
