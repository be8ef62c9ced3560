// Forward SIMT kernels, output-column tier 64.
#include "fwd_simt.cuh"

namespace flashattn::cuda::simt {
template void fwd<float, 64>(const FwdParams&, int, cudaStream_t);
template void fwd<__nv_bfloat16, 64>(const FwdParams&, int, cudaStream_t);
template void fwd<__half, 64>(const FwdParams&, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
