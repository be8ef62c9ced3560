// Host launchers of the Hopper kernels (sm90/, wgmma on sm_90a), instantiated in fwd_sm90.cu.
// Each returns false, launching nothing, where it does not serve the call; dispatch.cu then takes
// the sm80/ kernels.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"
#include "../schedule/key_tile_rounds.h"

namespace flashattn::cuda::sm90 {

// The head-dim tiers the wgmma forwards have (fp16 / bf16 at 64 and 128 (warp-specialized), 128 and 256).
template <class Elem, int kDim>
constexpr bool kFwdWgmmaTier = sizeof(Elem) == 2 && (kDim == 64 || kDim == 128 || kDim == 256);

// Forward of plain fp16 / bf16 calls with head_dim == head_dim_v == kDim on sm_90.
template <class Elem, int kDim>
bool fwd_wgmma(const FwdParams& p, cudaStream_t stream);
// Whether fwd_wgmma takes the call where the image has the kernels (it needs no workspace).
template <class Elem, int kDim>
bool fwd_wgmma_serves(const FwdParams& p);

// dK / dV and the atomic dQ of plain fp16 / bf16 calls with head_dim == head_dim_v == kDim (64, 128) on
// sm_90; the caller has checked the operands' alignment and that no general per-score step is needed.
template <class Elem, int kDim>
bool bwd_wgmma(const BwdParams& p, const void* dsum, const DqAccum& accum, cudaStream_t stream);

}  // namespace flashattn::cuda::sm90
