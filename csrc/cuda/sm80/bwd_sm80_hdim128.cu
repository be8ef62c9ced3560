// Tensor-core dK/dV/dQ kernels, head dims up to 128.
#include "bwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool bwd_dkdv<double, 128>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                    const DkDvTail&, cudaStream_t);
template bool bwd_dkdv<__nv_bfloat16, 128>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                           const DkDvTail&, cudaStream_t);
template bool bwd_dkdv<__half, 128>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                    const DkDvTail&, cudaStream_t);
}  // namespace flashattn::cuda::sm80
