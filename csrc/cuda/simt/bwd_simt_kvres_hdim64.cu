// dK/dV SIMT kernel with the key tile resident in smem, head dims up to 64.
#include "bwd_simt_kvres.cuh"

namespace flashattn::cuda::simt {
template bool bwd_dkdv_kvres<float, 64>(const BwdParams&, const void*, void*, cudaStream_t);
template bool bwd_dkdv_kvres<__nv_bfloat16, 64>(const BwdParams&, const void*, void*, cudaStream_t);
template bool bwd_dkdv_kvres<__half, 64>(const BwdParams&, const void*, void*, cudaStream_t);
}  // namespace flashattn::cuda::simt
