// Decode kernels (few query rows per kv head), head-dim tier 96.
#include "fwd_decode.cuh"

namespace flashattn::cuda::sm80 {
template bool launch_decode<__nv_bfloat16, 96>(const FwdParams&, cudaStream_t);
template size_t decode_workspace_bytes<__nv_bfloat16, 96>(const FwdParams&);
template bool launch_decode<__half, 96>(const FwdParams&, cudaStream_t);
template size_t decode_workspace_bytes<__half, 96>(const FwdParams&);
}  // namespace flashattn::cuda::sm80
