// Q-resident forward SIMT kernels, head dims up to 128.
#include "fwd_simt_qres.cuh"

namespace flashattn::cuda::simt {
template bool fwd_qres<float, 128>(const FwdParams&, FwdKernel, int, cudaStream_t);
template bool fwd_qres<__nv_bfloat16, 128>(const FwdParams&, FwdKernel, int, cudaStream_t);
template bool fwd_qres<__half, 128>(const FwdParams&, FwdKernel, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
