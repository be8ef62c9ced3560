// Forward SIMT kernels, output-column tier 128.
#include "fwd_simt.cuh"

namespace flashattn::cuda::simt {
template void fwd<double, 128>(const FwdParams&, int, cudaStream_t);
template void fwd<float, 128>(const FwdParams&, int, cudaStream_t);
template void fwd<__nv_bfloat16, 128>(const FwdParams&, int, cudaStream_t);
template void fwd<__half, 128>(const FwdParams&, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
