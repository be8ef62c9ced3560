// Backward SIMT kernels, output-column tier 32.
#include "bwd_simt.cuh"

namespace flashattn::cuda::simt {
template void bwd_dkdv<float, 32>(const BwdParams&, const void*, void*, int, cudaStream_t);
template void bwd_dq<float, 32>(const BwdParams&, const void*, int, cudaStream_t);
template void bwd_dkdv<__nv_bfloat16, 32>(const BwdParams&, const void*, void*, int, cudaStream_t);
template void bwd_dq<__nv_bfloat16, 32>(const BwdParams&, const void*, int, cudaStream_t);
template void bwd_dkdv<__half, 32>(const BwdParams&, const void*, void*, int, cudaStream_t);
template void bwd_dq<__half, 32>(const BwdParams&, const void*, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
