// Forward SIMT kernels, output-column tier 256.
#include "fwd_simt.cuh"

namespace flashattn::cuda::simt {
template void fwd<float, 256>(const FwdParams&, int, cudaStream_t);
template void fwd<__nv_bfloat16, 256>(const FwdParams&, int, cudaStream_t);
template void fwd<__half, 256>(const FwdParams&, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
