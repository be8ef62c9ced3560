// Tensor-core forward kernels, head dims 129..192 (fp16/bf16): 3/4 of the dim-256 products.
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<__nv_bfloat16, 192>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 192>(const FwdParams&, FwdKernel);
template bool fwd<__half, 192>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 192>(const FwdParams&, FwdKernel);
}  // namespace flashattn::cuda::sm80
