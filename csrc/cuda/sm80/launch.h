// Host launchers of the tensor-core kernels (sm_80+), instantiated per head-dim tier in
// fwd_sm80_hdim*.cu / bwd_sm80_hdim*.cu and picked by dispatch.cu. Each returns false,
// launching nothing, when the call is outside what the kernel serves (GPU older than sm_80, too
// little smem for the operand and bias tiles, head dims above kDim, operands not 16-byte
// aligned); dispatch then takes the SIMT kernels. Every optional feature is served.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "../../params.h"
#include "../schedule/key_tile_rounds.h"

namespace flashattn::cuda::sm80 {

// Forward for head_dim and head_dim_v both <= kDim (fp16/bf16: 32, 64, 96, 128, 192, 256; fp64:
// 64, 128).
template <class Elem, int kDim>
bool fwd(const FwdParams& p, cudaStream_t stream);
// The workspace that fwd<Elem, kDim> takes for the call (fp16 / bf16: the split of its grid's
// last wave, key_split.cuh, or the decode kernel's parts), 0 where none. A paged call
// (p.block_table) that no kernel of the tier reads in place: kPagesNotRead (dispatch then
// gathers its pages first).
constexpr size_t kPagesNotRead = ~size_t(0);
template <class Elem, int kDim>
size_t fwd_workspace_bytes(const FwdParams& p);
// Forward of calls of few query rows per kv head (decode steps; fp16 / bf16), plain calls only.
template <class Elem, int kDim>
bool fwd_decode(const FwdParams& p, cudaStream_t stream);
// Whether fwd_decode takes the call where its operands are aligned, and then the workspace it needs.
template <class Elem, int kDim>
bool fwd_decode_workspace_bytes(const FwdParams& p, size_t& bytes);

// dK and dV for head_dim and head_dim_v both <= kDim (the forward's tiers), and dQ into
// `accum`. `dsum` holds D = rowsum(dO * O) - dlse (accumulator type).
template <class Elem, int kDim>
bool bwd_dkdv(const BwdParams& p, const void* dsum, const DqAccum& accum, const DkDvTail& tail, cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
