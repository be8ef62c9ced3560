// Hopper forward kernels (wgmma): fp16 and bf16, the warp-specialized one at head dims 64 and 128
// (non-causal at 128), the two-warpgroup one at 128 (causal) and 256; their dispatch, and the checks
// that sm90/ kernels share.
#include <cstdlib>
#include <cstring>

#include "fwd_sm90.cuh"
#include "fwd_ws_sm90.cuh"
#include "launch.h"
#include "tma_map.h"

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

enum class Sm90Forward { kNone, kWarpSpecialized, kTwoWarpGroups };

// The warp-specialized kernel's tensor maps of q, k and v; false where the driver refuses one (or a
// size exceeds the copies' 32-bit coordinates).
template <class Cfg>
bool encode_ws_maps(const FwdParams& p, FwdPanelMaps& maps) {
  constexpr int64_t kMaxCoord = 0x7fffffff;
  if (p.batch > kMaxCoord || p.heads_q > kMaxCoord || p.len_q > kMaxCoord || p.len_k > kMaxCoord) return false;
  return encode_panel_map(&maps.q, p.q, p.q_stride, p.batch, p.heads_q, p.len_q, p.head_dim, Cfg::kBM) &&
         encode_panel_map(&maps.k, p.k, p.k_stride, p.batch, p.heads_kv, p.len_k, p.head_dim, Cfg::kBN) &&
         encode_panel_map(&maps.v, p.v, p.v_stride, p.batch, p.heads_kv, p.len_k, p.head_dim_v, Cfg::kBN);
}

// The sm90/ kernel that takes the call, or none (the sm80/ kernels then do): plain calls (no optional
// feature) with head_dim == head_dim_v == kDim on an sm_90 GPU whose block gets the kernel's smem,
// rows that see the kernel's minimum of keys, on grids of at least a block per SM (smaller grids go to
// the sm80/ kernels, which split walks over keys where the GPU has room). FLASHATTN_CUDA_KERNELS=wgmma
// drops the last two conditions. The warp-specialized kernel's tensor maps are encoded into `maps`.
template <class Elem, int kDim>
Sm90Forward sm90_forward_for(const FwdParams& p, FwdPanelMaps& maps) {
  using Ws = FwdWsConfig<Elem, kDim>;
  using TwoWg = FwdWgmmaConfig<Elem, kDim>;
  const WgmmaMode mode = wgmma_mode();
  if (!kFwdWgmmaTier<Elem, kDim> || p.has_features() || p.head_dim != kDim || p.head_dim_v != kDim ||
      mode == WgmmaMode::kOff)
    return Sm90Forward::kNone;
  const DeviceLimits lim = device_limits();
  if (lim.major != 9) return Sm90Forward::kNone;
  const bool forced = mode == WgmmaMode::kForced;
  const int64_t keys = mean_visible_keys(p);
  auto fills_gpu = [&](int rows_per_block) {
    return (p.len_q + rows_per_block - 1) / rows_per_block * p.heads_q * p.batch >= lim.sms;
  };
  if constexpr (Ws::kServed) {
    const int64_t min_keys = p.causal ? Ws::kMinCausalKeys : Ws::kMinKeys;
    if (Ws::kSmemBytes <= lim.smem_optin && register_pool_holds<Elem, kDim>() &&
        (forced || (keys >= min_keys && fills_gpu(Ws::kBM))) && encode_ws_maps<Ws>(p, maps))
      return Sm90Forward::kWarpSpecialized;
  }
  if constexpr (TwoWg::kServed) {
    if (TwoWg::kSmemBytes <= lim.smem_optin && (forced || (keys >= TwoWg::kMinVisibleKeys && fills_gpu(TwoWg::kBM))))
      return Sm90Forward::kTwoWarpGroups;
  }
  return Sm90Forward::kNone;
}

// The grid of a kernel with kBM-row query tiles: its blocks, the last tiles first (a causal grid's
// last heads tile slowest, schedule/causal_order.cuh), and the kernel's blocks per SM.
struct FwdGrid {
  int64_t blocks;
  int num_m_tiles, per_sm;
  HeavyLast order;
};

template <class Cfg, auto kKernel>
FwdGrid fwd_grid(const FwdParams& p) {
  FwdGrid g{};
  const int64_t num_m_tiles = (p.len_q + Cfg::kBM - 1) / Cfg::kBM;
  g.blocks = num_m_tiles * p.heads_q * p.batch;
  if (grid_too_large(g.blocks, "sm90 forward")) {
    g.blocks = 0;  // (an empty grid fails to launch: the failure above is the one reported)
    return g;
  }
  g.num_m_tiles = int(num_m_tiles);
  g.per_sm = blocks_per_sm_cached<kKernel>(Cfg::kThreads, Cfg::kSmemBytes, "sm90 forward");
  if (p.causal) g.order = plan_heavy_last(g.blocks, num_m_tiles, g.per_sm);
  return g;
}

}  // namespace

template <class Elem, int kDim>
bool fwd_wgmma_serves(const FwdParams& p) {
  FwdPanelMaps maps;
  return sm90_forward_for<Elem, kDim>(p, maps) != Sm90Forward::kNone;
}

template <class Elem, int kDim>
bool fwd_wgmma(const FwdParams& p, cudaStream_t stream) {
  FwdPanelMaps maps;
  const Sm90Forward kernel = sm90_forward_for<Elem, kDim>(p, maps);
  if (kernel == Sm90Forward::kNone || !wgmma_compiled(stream)) return false;
  if constexpr (FwdWsConfig<Elem, kDim>::kServed) {
    if (kernel == Sm90Forward::kWarpSpecialized) {
      using Cfg = FwdWsConfig<Elem, kDim>;
      const FwdGrid g = fwd_grid<Cfg, fwd_ws_kernel<Elem, kDim>>(p);
      // Non-causal grids larger than the GPU: persistent, a block per SM slot walking several items.
      const int64_t slots = int64_t(device_limits().sms) * (g.per_sm > 0 ? g.per_sm : 1);
      const int64_t grid = !p.causal && g.blocks > slots ? slots : g.blocks;
      fwd_ws_kernel<Elem, kDim>
          <<<unsigned(grid), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps, g.num_m_tiles, unsigned(g.blocks),
                                                                      g.order);
      check_launch("sm90 forward");
      return true;
    }
  }
  if constexpr (FwdWgmmaConfig<Elem, kDim>::kServed) {
    using Cfg = FwdWgmmaConfig<Elem, kDim>;
    const FwdGrid g = fwd_grid<Cfg, fwd_wgmma_kernel<Elem, kDim>>(p);
    fwd_wgmma_kernel<Elem, kDim><<<unsigned(g.blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, g.num_m_tiles, g.order);
    check_launch("sm90 forward");
    return true;
  }
  return false;
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
