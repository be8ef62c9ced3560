// Hopper dK/dV kernels (wgmma): fp16 and bf16 at head dims 64 and 128.
#include "bwd_sm90.cuh"
#include "launch.h"

namespace flashattn::cuda::sm90 {
template bool bwd_wgmma<__nv_bfloat16, 128>(const BwdParams&, const void*, const DqAccum&, cudaStream_t);
template bool bwd_wgmma<__half, 128>(const BwdParams&, const void*, const DqAccum&, cudaStream_t);
template bool bwd_wgmma<__nv_bfloat16, 64>(const BwdParams&, const void*, const DqAccum&, cudaStream_t);
template bool bwd_wgmma<__half, 64>(const BwdParams&, const void*, const DqAccum&, cudaStream_t);
}  // namespace flashattn::cuda::sm90
