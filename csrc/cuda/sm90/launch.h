// Host launchers of the Hopper kernels (sm90/, wgmma on sm_90a): the forward's instantiated per head dim in
// fwd_sm90_hdim*.cu, the backward's in bwd_sm90.cu, the float8 V^T copy in fp8_v_transpose.cu. Each launches what the kernel plan (../plan.h) chose and returns true; false,
// launching nothing, would mean the plan chose a kernel that cannot take the call.
//
// A call's tensor maps are encoded once: by the plan's question whether the kernel can take the call
// (*_ready), whose maps the launch then reads.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"
#include "../plan.h"
#include "../schedule/key_tile_rounds.h"
#include "tile_config.h"
#include "tma_map.h"

namespace flashattn::cuda::sm90 {

// Whether the warp-specialized forward with kConsumers consumer warpgroups can take the call (the plan's
// DeviceInfo::sm90_ws_ready): the driver encodes its tensor maps (into `maps`), and its warpgroups'
// registers fit the loaded kernel's pool (a bias rows' map too, into maps.bias).
template <class Elem, int kDim, int kConsumers = 2>
bool fwd_ws_ready(const FwdParams& p, FwdMaps& maps);
// Forward (the plan's kSm90WgmmaWs: two consumers; kSm90WgmmaWs3: three, at dim 64) of plain fp16 / bf16
// calls with head_dim == head_dim_v == kDim on sm_90, from the maps fwd_ws_ready encoded for p.
template <class Elem, int kDim, int kConsumers = 2>
bool fwd_wgmma(const FwdParams& p, const FwdMaps& maps, cudaStream_t stream);

// The float8 forward (FwdWsConfig<__nv_fp8_e4m3, 128>) reads V transposed: the bytes of that copy, and
// the copy of p.v (float8 (batch, heads_kv, len_k, 128), p.v_stride) into `vt` (FwdParams::v's layout for
// float8 calls). False where head_dim_v is not 128 or the launch failed.
size_t fwd_fp8_v_bytes(const FwdParams& p);
bool fwd_fp8_v_transposed(const FwdParams& p, void* vt, cudaStream_t stream);

// Whether the dK / dV kernel can take the call at head dim `dim` (the plan's DeviceInfo::sm90_ws_ready):
// the driver encodes its tensor maps (into `maps`), and its warpgroups' registers fit the loaded
// kernel's pool.
bool bwd_ws_ready(const BwdParams& p, int dim, BwdPanelMaps& maps);
// dK / dV and dQ (added into the accumulator) of plain fp16 / bf16 calls with head_dim == head_dim_v ==
// kDim (64, 128, 256) on sm_90 (the plan's kSm90Wgmma), from the maps bwd_ws_ready encoded for p.
template <class Elem, int kDim>
bool bwd_wgmma(const BwdParams& p, const BwdPanelMaps& maps, const void* dsum, const DqAccum& accum,
               cudaStream_t stream);

}  // namespace flashattn::cuda::sm90
