// Q-resident forward SIMT kernels (fp32), head dims up to 64.
#include "fwd_simt_qres.cuh"

namespace flashattn::cuda::simt {
template bool fwd_qres<float, 64>(const FwdParams&, FwdKernel, int, cudaStream_t);
}  // namespace flashattn::cuda::simt
