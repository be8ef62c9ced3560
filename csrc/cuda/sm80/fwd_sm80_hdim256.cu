// Tensor-core forward kernels, head dims up to 256 (fp16/bf16; fp64 accumulators would not fit).
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<__nv_bfloat16, 256>(const FwdParams&, cudaStream_t);
template size_t fwd_workspace_bytes<__nv_bfloat16, 256>(const FwdParams&);
template bool fwd_decode<__nv_bfloat16, 256>(const FwdParams&, cudaStream_t);
template bool fwd_decode_workspace_bytes<__nv_bfloat16, 256>(const FwdParams&, size_t&);
template bool fwd<__half, 256>(const FwdParams&, cudaStream_t);
template size_t fwd_workspace_bytes<__half, 256>(const FwdParams&);
template bool fwd_decode<__half, 256>(const FwdParams&, cudaStream_t);
template bool fwd_decode_workspace_bytes<__half, 256>(const FwdParams&, size_t&);
}  // namespace flashattn::cuda::sm80
