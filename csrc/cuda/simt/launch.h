// Host launchers of the SIMT kernels, explicitly instantiated per head-dim tier in
// fwd_simt_hdim*.cu / bwd_simt_hdim*.cu and picked by dispatch.cu.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"
#include "../plan.h"

namespace flashattn::cuda::simt {

// Output columns are cut into `num_splits` slices of kTier columns, one block per slice.
template <class T, int kTier>
void fwd(const FwdParams& p, int num_splits, cudaStream_t stream);

// Forward with the query tile resident in smem (fp32 accumulation only): head_dim and
// head_dim_v both <= kDim (64 or 128), one block per query tile, no optional feature (only fwd
// has them): the plan's kSimtQres, or at dim 128 for fp32 kSimtWs. `tf32_keys` (fp32, kSimtQres
// at dim 64): P V on the tensor cores as three TF32 products (fp32 accuracy) over tiles of that
// many keys; 0: FMA products. Returns false, launching nothing, where the plan chose a form this
// call cannot take (smem).
template <class T, int kDim>
bool fwd_qres(const FwdParams& p, FwdKernel kernel, int tf32_keys, cudaStream_t stream);

// D = rowsum(dO * O) into `d` (accumulator type, contiguous (batch, heads_q, len_q)), and
// `zero_bytes` (a multiple of 16) at `zero` (16-byte aligned) set to 0 in the same launch.
template <class T>
void bwd_dot_do_o(const BwdParams& p, void* d, void* zero, size_t zero_bytes, cudaStream_t stream);

// dK, dV (and, when `dq_accum` is not null, atomically dQ / scale into it, accumulator type,
// contiguous (batch, heads_q, len_q, head_dim)).
template <class T, int kTier>
void bwd_dkdv(const BwdParams& p, const void* d, void* dq_accum, int num_splits,
              cudaStream_t stream);

// dK/dV (and dQ as bwd_dkdv does) with the key tile resident in smem (fp32 accumulation only):
// head_dim and head_dim_v both <= kDim (64 or 128). Returns false, launching nothing, on a
// device whose smem per block is too small, or when an optional feature is on (only
// bwd_dkdv has them).
template <class T, int kDim>
bool bwd_dkdv_kvres(const BwdParams& p, const void* d, void* dq_accum, cudaStream_t stream);

// dQ written directly, one block per query tile looping over key tiles (deterministic path).
template <class T, int kTier>
void bwd_dq(const BwdParams& p, const void* d, int num_splits, cudaStream_t stream);

// dq = scale * (the sum of `slices` accumulators `slice_elems` apart, first to last), in the
// output dtype and strides; the accumulators row-major or (`blocked`, fp16/bf16 only) blocked
// (common/dq_layout.cuh).
template <class T>
void bwd_dq_convert(const BwdParams& p, const void* dq_accum, bool blocked, int slices, int64_t slice_elems,
                    cudaStream_t stream);

}  // namespace flashattn::cuda::simt
