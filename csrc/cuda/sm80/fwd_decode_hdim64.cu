// Decode kernels (few query rows per kv head), head-dim tier 64.
#include "fwd_decode.cuh"

namespace flashattn::cuda::sm80 {
template bool launch_decode<__nv_bfloat16, 64>(const FwdParams&, cudaStream_t);
template size_t decode_workspace_bytes<__nv_bfloat16, 64>(const FwdParams&);
template bool launch_decode<__half, 64>(const FwdParams&, cudaStream_t);
template size_t decode_workspace_bytes<__half, 64>(const FwdParams&);
}  // namespace flashattn::cuda::sm80
