// Forward SIMT kernels, output-column tier 32.
#include "fwd_simt.cuh"

namespace flashattn::cuda::simt {
template void fwd<float, 32>(const FwdParams&, int, cudaStream_t);
template void fwd<__nv_bfloat16, 32>(const FwdParams&, int, cudaStream_t);
template void fwd<__half, 32>(const FwdParams&, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
