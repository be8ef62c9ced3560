// Hopper dK/dV kernel (wgmma, warp-specialized): fp16 and bf16 at head dims 64, 96, 128 and 256, plain or
// with a key-vector bias (one kernel: the values are read at run time), with bias rows at 128 and 256 (a
// second), as the kernel plan (../plan.cpp) chose; bwd_ws_ready
// answers the plan's question whether it can take a call, and its maps are the ones the launch passes.
#include "bwd_sm90.cuh"
#include "launch.h"
#include "register_pool.h"
#include "tma_map.h"

namespace flashattn::cuda::sm90 {

namespace {

template <class Cfg>
bool encode_bwd_maps(const BwdParams& p, BwdPanelMaps& maps) {
  if (!tma_coords_fit(p.batch, p.heads_q, p.len_q, p.len_k)) return false;
  return encode_panel_map(&maps.q, p.q, p.q_stride, p.batch, p.heads_q, p.len_q, p.head_dim, Cfg::kBM) &&
         encode_panel_map(&maps.dout, p.dout, p.dout_stride, p.batch, p.heads_q, p.len_q, p.head_dim_v, Cfg::kBM) &&
         encode_panel_map(&maps.k, p.k, p.k_stride, p.batch, p.heads_kv, p.len_k, p.head_dim, Cfg::kBN) &&
         encode_panel_map(&maps.v, p.v, p.v_stride, p.batch, p.heads_kv, p.len_k, p.head_dim_v, Cfg::kBN);
}

// The kernel of element type Elem and dim kDim can take the call: its maps encode (the box sizes of its
// tiles) and its register pool holds the hand-over (of the call's variant: plain or with a key-vector bias, or
// with bias rows where kBwdRowBiasTier, the biases the plan sends here).
template <class Elem, int kDim>
bool ws_ready(const BwdParams& p, BwdPanelMaps& maps) {
  using Cfg = BwdWsConfig<Elem, kDim>;
  bool pool = false;
  if (p.bias_kind != BiasKind::kNone && !p.key_vector_bias()) {
    if constexpr (kBwdRowBiasTier<kDim>) pool = register_pool_holds<bwd_ws_kernel<Elem, kDim, BiasForm::kRows>, Cfg>();
  } else {
    pool = register_pool_holds<bwd_ws_kernel<Elem, kDim>, Cfg>();
  }
  return pool && encode_bwd_maps<Cfg>(p, maps);
}

// The launches of kernel variant kKernel (rounds of key tiles, schedule/key_tile_rounds.h).
template <class Elem, int kDim, auto kKernel>
void launch_ws(const BwdParams& p, const BwdPanelMaps& maps, const void* dsum, const DqAccum& accum,
               cudaStream_t stream) {
  using Cfg = BwdWsConfig<Elem, kDim>;
  if (!set_smem(kKernel, Cfg::kSmemBytes, "sm90::bwd_ws_kernel")) return;
  // Causal blocks heaviest last where a block's walk is the plain one's (a key-vector bias adds no walk).
  const int per_sm = !p.deterministic && p.causal ? 1 : 0;
  for_key_tile_rounds(p, Cfg::kBN, accum, [&](unsigned blocks, KeyTileRound round) {
    round.heavy = plan_heavy_last(blocks, round.groups, per_sm);
    kKernel<<<blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps, static_cast<const float*>(dsum), accum,
                                                                 round);
    check_launch("sm90::bwd_ws_kernel");
  });
}

}  // namespace

bool bwd_ws_ready(const BwdParams& p, int dim, BwdPanelMaps& maps) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (dim == 64) return bf16 ? ws_ready<__nv_bfloat16, 64>(p, maps) : ws_ready<__half, 64>(p, maps);
  if (dim == 256) return bf16 ? ws_ready<__nv_bfloat16, 256>(p, maps) : ws_ready<__half, 256>(p, maps);
  if (dim == 96) return bf16 ? ws_ready<__nv_bfloat16, 96>(p, maps) : ws_ready<__half, 96>(p, maps);
  return bf16 ? ws_ready<__nv_bfloat16, 128>(p, maps) : ws_ready<__half, 128>(p, maps);
}

template <class Elem, int kDim>
bool bwd_wgmma(const BwdParams& p, const BwdPanelMaps& maps, const void* dsum, const DqAccum& accum,
               cudaStream_t stream) {
  if (p.bias_kind != BiasKind::kNone && !p.key_vector_bias()) {
    if constexpr (!kBwdRowBiasTier<kDim>) return false;
    else launch_ws<Elem, kDim, bwd_ws_kernel<Elem, kDim, BiasForm::kRows>>(p, maps, dsum, accum, stream);
  } else {
    launch_ws<Elem, kDim, bwd_ws_kernel<Elem, kDim>>(p, maps, dsum, accum, stream);
  }
  return true;
}

template bool bwd_wgmma<__nv_bfloat16, 128>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                            cudaStream_t);
template bool bwd_wgmma<__half, 128>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                     cudaStream_t);
template bool bwd_wgmma<__nv_bfloat16, 64>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                           cudaStream_t);
template bool bwd_wgmma<__half, 64>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                    cudaStream_t);
template bool bwd_wgmma<__nv_bfloat16, 96>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                           cudaStream_t);
template bool bwd_wgmma<__half, 96>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                    cudaStream_t);
template bool bwd_wgmma<__nv_bfloat16, 256>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                            cudaStream_t);
template bool bwd_wgmma<__half, 256>(const BwdParams&, const BwdPanelMaps&, const void*, const DqAccum&,
                                     cudaStream_t);
}  // namespace flashattn::cuda::sm90
