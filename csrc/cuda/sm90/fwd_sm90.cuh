// The Hopper forward's host side (wgmma, warp-specialized): its launcher as the kernel plan (../plan.cpp)
// chose, and the plan's question whether it can take a call (whose maps the launch passes); instantiated
// per head dim in fwd_sm90_hdim*.cu (scripts/generate_kernels.py): fp16 and bf16 at 64, 96, 128 and 256,
// plain or with a key-vector bias, with bias rows at 64, 128 and 256, float8 e4m3 at 128 (plain).
#pragma once
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
  if (!tma_coords_fit(p.batch, p.heads_q, p.len_q, p.len_k)) return false;
  if constexpr (Cfg::kFp8) {
    // V^T: (batch, heads_kv, head_dim lines, keys rounded up to 16), contiguous; a box of head_dim lines
    // of 64 keys (one 64-byte-swizzled panel).
    const int64_t keys = (p.len_k + 15) / 16 * 16;
    const Strides vt{p.heads_kv * p.head_dim * keys, p.head_dim * keys, keys};
    return encode_panel_map(&maps.q, p.q, p.q_stride, p.batch, p.heads_q, p.len_q, p.head_dim, Cfg::kBM, 1) &&
           encode_panel_map(&maps.k, p.k, p.k_stride, p.batch, p.heads_kv, p.len_k, p.head_dim, Cfg::kBN, 1) &&
           encode_panel_map(&maps.v, p.v, vt, p.batch, p.heads_kv, p.head_dim, keys, p.head_dim, 1,
                            Cfg::kVtPanelKeys);
  }
  return encode_panel_map(&maps.q, p.q, p.q_stride, p.batch, p.heads_q, p.len_q, p.head_dim, Cfg::kBM) &&
         encode_panel_map(&maps.k, p.k, p.k_stride, p.batch, p.heads_kv, p.len_k, p.head_dim, Cfg::kBN) &&
         encode_panel_map(&maps.v, p.v, p.v_stride, p.batch, p.heads_kv, p.len_k, p.head_dim_v, Cfg::kBN);
}

// The grid of a kernel with kBM-row query tiles: its work items (one per query tile, the last tiles
// first), the blocks that walk them, their order (schedule/causal_order.cuh) and the kernel's blocks per SM.
// Grids larger than the GPU are persistent: a block per SM slot walks several items. Non-causal items
// are alike; causal ones differ in length and walk in pairs of a heavy and a light tile where the kernel
// gains by it (plan_paired_walk), else a block per item, the last pairs' tiles slowest.
struct FwdGrid {
  int64_t items, blocks;
  int per_sm;
  FwdOrder order;
};

template <class Cfg, auto kKernel>
FwdGrid fwd_grid(const FwdParams& p) {
  FwdGrid g{};
  const int64_t num_m_tiles = (p.len_q + Cfg::kBM - 1) / Cfg::kBM;
  g.items = num_m_tiles * p.heads_q * p.batch;
  if (grid_too_large(g.items, "sm90 forward")) {
    g.items = g.blocks = 0;  // (an empty grid fails to launch: the failure above is the one reported)
    return g;
  }
  g.per_sm = blocks_per_sm_cached<kKernel>(Cfg::kThreads, Cfg::kSmemBytes, "sm90 forward");
  const int64_t slots = int64_t(device_limits().sms) * (g.per_sm > 0 ? g.per_sm : 1);
  const bool paired = p.causal && plan_paired_walk(g.items, num_m_tiles, slots, Cfg::kPairedMaxTiles);
  g.blocks = g.items > slots && (!p.causal || paired) ? slots : g.items;
  const HeavyLast heavy = p.causal && !paired ? plan_heavy_last(g.items, num_m_tiles, g.per_sm) : HeavyLast{};
  g.order = fwd_order(paired, heavy, num_m_tiles, p.heads_q, p.heads_kv, p.heads_q * p.batch, g.blocks);
  return g;
}

// The kernel's launch with configuration Cfg (the plain kernel or a bias variant; only the bias rows'
// takes the bias map).
template <class Elem, int kDim, class Cfg>
void launch_ws(const FwdParams& p, const FwdMaps& maps, cudaStream_t stream) {
  const FwdGrid g = fwd_grid<Cfg, fwd_ws_kernel<Elem, kDim, Cfg>>(p);
  const FwdKernelMaps<Cfg>& kernel_maps = maps;
  fwd_ws_kernel<Elem, kDim, Cfg><<<unsigned(g.blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
      p, kernel_maps, unsigned(g.items), g.order);
  check_launch("sm90 forward");
}

// Whether the kernel of configuration Cfg gets its registers, with the Q / K / V maps encoded for its tiles.
template <class Elem, int kDim, class Cfg>
bool ws_ready(const FwdParams& p, FwdMaps& maps) {
  return register_pool_holds<fwd_ws_kernel<Elem, kDim, Cfg>, Cfg>() && encode_ws_maps<Cfg>(p, maps);
}

}  // namespace
// (A call with a bias is an fp16 / bf16 one whose bias is a key vector, or bias rows the row variant
// copies (FwdParams::tma_row_bias, kFwdRowBiasTier): the plan sends no other bias here. Its kernel is the
// configuration's variant for that form, FwdWsConfig::kKeyBias / kRowBias, whose key tiles may differ from
// the plain kernel's; the bias rows' map is encoded here too, and where the driver refuses it the call goes
// to the sm80/ kernels.)
template <class Elem, int kDim, int kConsumers>
bool fwd_ws_ready(const FwdParams& p, FwdMaps& maps) {
  using Cfg = FwdWsConfig<Elem, kDim, kConsumers>;
  if constexpr (Cfg::kServed) {
    if constexpr (!Cfg::kFp8) {
      if (p.key_vector_bias())
        return ws_ready<Elem, kDim, FwdWsConfig<Elem, kDim, kConsumers, BiasForm::kKeyVector>>(p, maps);
      if (p.bias_kind != BiasKind::kNone) {
        if constexpr (kFwdRowBiasTier<Elem, kDim, kConsumers>) {
          using RowCfg = FwdWsConfig<Elem, kDim, kConsumers, BiasForm::kRows>;
          static_assert(RowCfg::kSmemBytes <= 232448, "the bias tiles within sm_90's 227 KB of opt-in smem");
          return ws_ready<Elem, kDim, RowCfg>(p, maps) && encode_row_bias_map(&maps.bias, p, RowCfg::kBN);
        }
        return false;
      }
    }
    return ws_ready<Elem, kDim, Cfg>(p, maps);
  }
  return false;
}

template <class Elem, int kDim, int kConsumers>
bool fwd_wgmma(const FwdParams& p, const FwdMaps& maps, cudaStream_t stream) {
  using Cfg = FwdWsConfig<Elem, kDim, kConsumers>;
  if constexpr (!Cfg::kFp8) {
    if (p.key_vector_bias()) {
      launch_ws<Elem, kDim, FwdWsConfig<Elem, kDim, kConsumers, BiasForm::kKeyVector>>(p, maps, stream);
      return true;
    }
    if (p.bias_kind != BiasKind::kNone) {
      if constexpr (kFwdRowBiasTier<Elem, kDim, kConsumers>) {
        launch_ws<Elem, kDim, FwdWsConfig<Elem, kDim, kConsumers, BiasForm::kRows>>(p, maps, stream);
        return true;
      }
      return false;
    }
  }
  launch_ws<Elem, kDim, Cfg>(p, maps, stream);
  return true;
}

}  // namespace flashattn::cuda::sm90
