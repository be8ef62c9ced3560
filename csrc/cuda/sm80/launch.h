// Host launchers of the tensor-core kernels (sm_80+), instantiated per head-dim tier in
// fwd_sm80_hdim*.cu / bwd_sm80_hdim*.cu and picked by dispatch.cu. Each returns false,
// launching nothing, when the call is outside what the kernel serves (GPU older than sm_80, too
// little smem for the operand and bias tiles, head dims above kDim, operands not 16-byte
// aligned); dispatch then takes the SIMT kernels. Every optional feature is served.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"

namespace flashattn::cuda::sm80 {

// Forward for head_dim and head_dim_v both <= kDim (fp16/bf16: 32, 64, 96, 128, 192, 256; fp64:
// 64, 128).
template <class Elem, int kDim>
bool fwd(const FwdParams& p, cudaStream_t stream);

// dK and dV for head_dim and head_dim_v both <= kDim (the forward's tiers), and, when
// `dq_accum` is not null, dQ / scale added atomically into it (accumulator type; fp32 in
// common/dq_layout.cuh's blocked layout, fp64 row-major). `dsum` holds D = rowsum(dO * O) - dlse (accumulator type).
template <class Elem, int kDim>
bool bwd_dkdv(const BwdParams& p, const void* dsum, void* dq_accum, cudaStream_t stream);

// dQ written directly (deterministic path), for head dims up to 128 (tiers 32, 64, 96, 128; fp64 64, 128).
template <class Elem, int kDim>
bool bwd_dq(const BwdParams& p, const void* dsum, cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
