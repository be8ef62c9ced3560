// Tensor-core dK/dV/dQ kernels, head dims 65..96 (fp16/bf16).
#include "bwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool bwd_dkdv<__nv_bfloat16, 96>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                          const DkDvTail&, cudaStream_t);
template bool bwd_dkdv<__half, 96>(const BwdParams&, BwdKernel, const void*, const DqAccum&,
                                   const DkDvTail&, cudaStream_t);
}  // namespace flashattn::cuda::sm80
