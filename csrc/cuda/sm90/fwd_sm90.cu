// Hopper forward kernels (wgmma): fp16 and bf16 at head dims 64 (warp-specialized), 128 and 256; their
// dispatch, and the checks that sm90/ kernels share.
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "fwd_sm90.cuh"
#include "fwd_ws_sm90.cuh"
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

namespace {

// The keys a query row sees on average (causal: the mean of its band over the rows).
int64_t mean_visible_keys(const FwdParams& p) {
  if (!p.causal) return p.len_k;
  const int64_t mean = p.causal_offset + (p.len_q + 1) / 2;
  return mean < 0 ? 0 : mean > p.len_k ? p.len_k : mean;
}

// The kernel the forward takes at kDim on sm_90: the warp-specialized one at 64, the other at 128 / 256.
template <class Elem, int kDim>
using FwdShape = std::conditional_t<kDim == 64, FwdWsConfig<Elem, kDim>, FwdWgmmaConfig<Elem, kDim>>;
template <class Elem, int kDim>
constexpr auto kFwdKernel = [] {
  if constexpr (kDim == 64)
    return fwd_ws_kernel<Elem, kDim>;
  else
    return fwd_wgmma_kernel<Elem, kDim>;
}();

// Whether the block's register pool holds what the warp-specialized kernel's warpgroups take after
// their hand-over (setmaxnreg; an .inc beyond the pool would wait forever). ptxas gives a kernel that
// moves registers the whole per-thread share its launch bounds allow (168 at 384 threads); checked
// once, against the image loaded, in case a build does otherwise.
template <class Elem, int kDim>
bool register_pool_holds() {
  using Cfg = FwdWsConfig<Elem, kDim>;
  static const bool holds = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, fwd_ws_kernel<Elem, kDim>) != cudaSuccess) return false;
    return attr.numRegs * Cfg::kThreads >= 128 * Cfg::kProducerRegs + 128 * Cfg::kConsumers * Cfg::kConsumerRegs;
  }();
  return holds;
}

}  // namespace

// The call is plain (no optional feature) with head_dim == head_dim_v == kDim and rows that see on
// average at least the kernel's kMinVisibleKeys, on an sm_90 GPU whose block gets the kernel's smem,
// with at least a block per SM (smaller grids go to the sm80/ kernels, which split walks over keys
// where the GPU has room).
template <class Elem, int kDim>
bool fwd_wgmma_serves(const FwdParams& p) {
  using Cfg = FwdShape<Elem, kDim>;
  const WgmmaMode mode = wgmma_mode();
  if (!Cfg::kServed || p.has_features() || p.head_dim != kDim || p.head_dim_v != kDim || mode == WgmmaMode::kOff)
    return false;
  const DeviceLimits lim = device_limits();
  if (lim.major != 9 || Cfg::kSmemBytes > lim.smem_optin) return false;
  if constexpr (kDim == 64) {
    if (!register_pool_holds<Elem, kDim>()) return false;
  }
  const int64_t blocks = (p.len_q + Cfg::kBM - 1) / Cfg::kBM * p.heads_q * p.batch;
  return mode == WgmmaMode::kForced || (mean_visible_keys(p) >= Cfg::kMinVisibleKeys && blocks >= lim.sms);
}

// One block per query tile of kBM rows, the last tiles first (a causal grid's last heads tile
// slowest, sm80/causal_order.cuh).
template <class Elem, int kDim>
bool fwd_wgmma(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdShape<Elem, kDim>;
  if (!fwd_wgmma_serves<Elem, kDim>(p) || !wgmma_compiled(stream)) return false;
  const int64_t num_m_tiles = (p.len_q + Cfg::kBM - 1) / Cfg::kBM;
  const int64_t blocks = num_m_tiles * p.heads_q * p.batch;
  if (blocks > 0x7fffffff) throw std::runtime_error("flashattn_ext CUDA backend: forward grid too large");
  constexpr auto kernel = kFwdKernel<Elem, kDim>;
  const int per_sm = blocks_per_sm_cached<kernel>(Cfg::kThreads, Cfg::kSmemBytes, "sm90 forward");
  const sm80::HeavyLast order = p.causal ? sm80::plan_heavy_last(blocks, num_m_tiles, per_sm) : sm80::HeavyLast{};
  kernel<<<unsigned(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, int(num_m_tiles), order);
  check_launch("sm90 forward");
  return true;
}

template bool fwd_wgmma<__nv_bfloat16, 64>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__half, 64>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 128>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__half, 128>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 256>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma<__half, 256>(const FwdParams&, cudaStream_t);
template bool fwd_wgmma_serves<__nv_bfloat16, 64>(const FwdParams&);
template bool fwd_wgmma_serves<__half, 64>(const FwdParams&);
template bool fwd_wgmma_serves<__nv_bfloat16, 128>(const FwdParams&);
template bool fwd_wgmma_serves<__half, 128>(const FwdParams&);
template bool fwd_wgmma_serves<__nv_bfloat16, 256>(const FwdParams&);
template bool fwd_wgmma_serves<__half, 256>(const FwdParams&);

}  // namespace flashattn::cuda::sm90
