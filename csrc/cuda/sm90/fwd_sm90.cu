// The Hopper forward (wgmma, warp-specialized): fp16 and bf16 at head dims 64, 96, 128 and 256, its launcher
// as the kernel plan (../plan.cpp) chose, and the plan's question whether it can take a call (whose
// maps the launch passes).
#include "fwd_ws_sm90.cuh"
#include "launch.h"
#include "register_pool.h"
#include "tma_map.h"

namespace flashattn::cuda::sm90 {

namespace {

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

template <class Elem, int kDim, int kConsumers>
bool fwd_ws_ready(const FwdParams& p, FwdPanelMaps& maps) {
  using Cfg = FwdWsConfig<Elem, kDim, kConsumers>;
  if constexpr (Cfg::kServed) return register_pool_holds<fwd_ws_kernel<Elem, kDim, Cfg>, Cfg>() && encode_ws_maps<Cfg>(p, maps);
  return false;
}

template <class Elem, int kDim, int kConsumers>
bool fwd_wgmma(const FwdParams& p, const FwdPanelMaps& maps, cudaStream_t stream) {
  using Cfg = FwdWsConfig<Elem, kDim, kConsumers>;
  const FwdGrid g = fwd_grid<Cfg, fwd_ws_kernel<Elem, kDim, Cfg>>(p);
  // Non-causal grids larger than the GPU: persistent, a block per SM slot walking several items.
  const int64_t slots = int64_t(device_limits().sms) * (g.per_sm > 0 ? g.per_sm : 1);
  const int64_t grid = !p.causal && g.blocks > slots ? slots : g.blocks;
  fwd_ws_kernel<Elem, kDim, Cfg><<<unsigned(grid), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps, g.num_m_tiles,
                                                                                           unsigned(g.blocks), g.order);
  check_launch("sm90 forward");
  return true;
}

template bool fwd_wgmma<__nv_bfloat16, 64, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__half, 64, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 64, 3>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__half, 64, 3>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 96, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__half, 96, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 128, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__half, 128, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__nv_bfloat16, 256, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_wgmma<__half, 256, 2>(const FwdParams&, const FwdPanelMaps&, cudaStream_t);
template bool fwd_ws_ready<__nv_bfloat16, 64, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__half, 64, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__nv_bfloat16, 64, 3>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__half, 64, 3>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__nv_bfloat16, 96, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__half, 96, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__nv_bfloat16, 128, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__half, 128, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__nv_bfloat16, 256, 2>(const FwdParams&, FwdPanelMaps&);
template bool fwd_ws_ready<__half, 256, 2>(const FwdParams&, FwdPanelMaps&);

}  // namespace flashattn::cuda::sm90
