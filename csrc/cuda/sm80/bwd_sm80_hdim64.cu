// Tensor-core dK/dV(/dQ) kernels, head dims up to 64.
#include "bwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool bwd_dkdv<double, 64>(const BwdParams&, const void*, void*, cudaStream_t);
template bool bwd_dkdv<__nv_bfloat16, 64>(const BwdParams&, const void*, void*, cudaStream_t);
template bool bwd_dkdv<__half, 64>(const BwdParams&, const void*, void*, cudaStream_t);
}  // namespace flashattn::cuda::sm80

namespace flashattn::cuda::sm80 {
template bool bwd_dq<double, 64>(const BwdParams&, const void*, cudaStream_t);
template bool bwd_dq<__nv_bfloat16, 64>(const BwdParams&, const void*, cudaStream_t);
template bool bwd_dq<__half, 64>(const BwdParams&, const void*, cudaStream_t);
}  // namespace flashattn::cuda::sm80
