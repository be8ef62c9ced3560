// Host launchers of the Hopper kernels (sm90/, wgmma on sm_90a), instantiated in fwd_sm90.cu and
// bwd_sm90.cu. Each launches what the kernel plan (../plan.h) chose and returns true; false,
// launching nothing, would mean the plan chose a kernel that cannot take the call.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"
#include "../plan.h"
#include "../schedule/key_tile_rounds.h"
#include "tile_config.h"

namespace flashattn::cuda::sm90 {

// Forward (the plan's kSm90WgmmaWs) of plain fp16 / bf16 calls with head_dim == head_dim_v == kDim on
// sm_90.
template <class Elem, int kDim>
bool fwd_wgmma(const FwdParams& p, cudaStream_t stream);
// Whether the warp-specialized forward can take the call (the plan's DeviceInfo::sm90_ws_ready): the
// driver encodes its tensor maps, and its warpgroups' registers fit the loaded kernel's pool.
template <class Elem, int kDim>
bool fwd_ws_ready(const FwdParams& p);

// dK / dV and dQ (added into the accumulator) of plain fp16 / bf16 calls with head_dim == head_dim_v ==
// kDim (64, 128) on sm_90 (the plan's kSm90Wgmma).
template <class Elem, int kDim>
bool bwd_wgmma(const BwdParams& p, const void* dsum, const DqAccum& accum, cudaStream_t stream);
// Whether that kernel can take the call at head dim `dim` (the plan's DeviceInfo::sm90_ws_ready): the
// driver encodes its tensor maps, and its warpgroups' registers fit the loaded kernel's pool.
bool bwd_ws_ready(const BwdParams& p, int dim);

}  // namespace flashattn::cuda::sm90
