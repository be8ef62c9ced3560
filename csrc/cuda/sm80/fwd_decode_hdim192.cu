// Decode kernels (few query rows per kv head), head-dim tier 192.
#include "fwd_decode.cuh"

namespace flashattn::cuda::sm80 {
template bool launch_decode<__nv_bfloat16, 192>(const FwdParams&, cudaStream_t);
template size_t decode_workspace_bytes<__nv_bfloat16, 192>(const FwdParams&);
template bool launch_decode<__half, 192>(const FwdParams&, cudaStream_t);
template size_t decode_workspace_bytes<__half, 192>(const FwdParams&);
}  // namespace flashattn::cuda::sm80
