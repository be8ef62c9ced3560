// Tensor-core dK/dV/dQ kernels, head dims 129..192 (fp16/bf16), output columns split in two.
#include "bwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool bwd_dkdv<__nv_bfloat16, 192>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                           const DkDvTail&, cudaStream_t);
template bool bwd_dkdv<__half, 192>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                    const DkDvTail&, cudaStream_t);
}  // namespace flashattn::cuda::sm80
