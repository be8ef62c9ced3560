// Tensor-core forward kernels, head dims up to 256 (fp16/bf16; fp64 accumulators would not fit).
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<__nv_bfloat16, 256>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 256>(const FwdParams&, FwdKernel);
template bool fwd<__half, 256>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 256>(const FwdParams&, FwdKernel);
}  // namespace flashattn::cuda::sm80
