// Tensor-core dK/dV/dQ kernels, head dims up to 64.
#include "bwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool bwd_dkdv<double, 64>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                   const DkDvTail&, cudaStream_t);
template bool bwd_dkdv<__nv_bfloat16, 64>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                          const DkDvTail&, cudaStream_t);
template bool bwd_dkdv<__half, 64>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                   const DkDvTail&, cudaStream_t);
}  // namespace flashattn::cuda::sm80
