// Host launchers of the tensor-core kernels (sm_80+), instantiated per head-dim tier in
// fwd_sm80_hdim*.cu / bwd_sm80_hdim*.cu. Each launches the kernel the plan (../plan.h) chose and
// returns true; false, launching nothing, would mean the plan chose a kernel that cannot take the
// call (too little smem, operands not 16-byte aligned), which dispatch.cu reports as an error.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "../../params.h"
#include "../plan.h"
#include "../schedule/key_tile_rounds.h"

namespace flashattn::cuda::sm80 {

// Forward on `kernel` (the plan's kSm80Decode, kSm80Plain or kSm80Features) for head_dim and
// head_dim_v both <= kDim (fp16/bf16: 32, 64, 96, 128, 192, 256; fp64: 64, 128).
template <class Elem, int kDim>
bool fwd(const FwdParams& p, FwdKernel kernel, cudaStream_t stream);
// The workspace that fwd<Elem, kDim> takes for the call on `kernel` (fp16 / bf16: the decode kernel's
// parts, the split of the plain kernel's last wave, key_split.cuh), 0 where none.
template <class Elem, int kDim>
size_t fwd_workspace_bytes(const FwdParams& p, FwdKernel kernel);

// dK and dV on `kernel` (the plan's kSm80* backward kernels) for head_dim and head_dim_v both <= kDim
// (the forward's tiers), and dQ into `accum`. `dsum` holds D = rowsum(dO * O) - dlse (accumulator type).
template <class Elem, int kDim>
bool bwd_dkdv(const BwdParams& p, BwdKernel kernel, const void* dsum, const DqAccum& accum, const DkDvTail& tail,
              cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
