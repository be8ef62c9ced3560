// Tensor-core forward kernels, head dims 65..96 (fp16/bf16): 3/4 of the dim-128 products.
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<__nv_bfloat16, 96>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 96>(const FwdParams&, FwdKernel);
template bool fwd<__half, 96>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 96>(const FwdParams&, FwdKernel);
}  // namespace flashattn::cuda::sm80
