// Tensor-core forward kernels, head dims up to 32 (fp16/bf16): half the dim-64 products.
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<__nv_bfloat16, 32>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 32>(const FwdParams&, FwdKernel);
template bool fwd<__half, 32>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 32>(const FwdParams&, FwdKernel);
}  // namespace flashattn::cuda::sm80
