// Tensor-core forward kernels, head dims up to 64.
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<double, 64>(const FwdParams&, FwdKernel, cudaStream_t);
template bool fwd<__nv_bfloat16, 64>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 64>(const FwdParams&, FwdKernel);
template bool fwd<__half, 64>(const FwdParams&, FwdKernel, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 64>(const FwdParams&, FwdKernel);
}  // namespace flashattn::cuda::sm80
