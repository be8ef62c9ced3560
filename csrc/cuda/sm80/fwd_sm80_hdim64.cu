// Tensor-core forward kernels, head dims up to 64.
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<double, 64>(const FwdParams&, cudaStream_t);
template bool fwd<__nv_bfloat16, 64>(const FwdParams&, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 64>(const FwdParams&);
template bool fwd_decode<__nv_bfloat16, 64>(const FwdParams&, cudaStream_t);
template bool fwd_decode_workspace_bytes<__nv_bfloat16, 64>(const FwdParams&, size_t&);
template bool fwd<__half, 64>(const FwdParams&, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 64>(const FwdParams&);
template bool fwd_decode<__half, 64>(const FwdParams&, cudaStream_t);
template bool fwd_decode_workspace_bytes<__half, 64>(const FwdParams&, size_t&);
}  // namespace flashattn::cuda::sm80
