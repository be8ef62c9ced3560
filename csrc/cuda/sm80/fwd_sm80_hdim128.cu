// Tensor-core forward kernels, head dims up to 128.
#include "fwd_sm80.cuh"

namespace flashattn::cuda::sm80 {
template bool fwd<double, 128>(const FwdParams&, cudaStream_t);
template bool fwd<__nv_bfloat16, 128>(const FwdParams&, cudaStream_t);
template bool fwd<__half, 128>(const FwdParams&, cudaStream_t);
}  // namespace flashattn::cuda::sm80
