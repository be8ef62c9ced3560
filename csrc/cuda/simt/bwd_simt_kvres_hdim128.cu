// dK/dV SIMT kernel with the key tile resident in smem, head dims up to 128.
#include "bwd_simt_kvres.cuh"

namespace flashattn::cuda::simt {
template bool bwd_dkdv_kvres<float, 128>(const BwdParams&, const void*, void*, cudaStream_t);
template bool bwd_dkdv_kvres<__nv_bfloat16, 128>(const BwdParams&, const void*, void*, cudaStream_t);
template bool bwd_dkdv_kvres<__half, 128>(const BwdParams&, const void*, void*, cudaStream_t);
}  // namespace flashattn::cuda::simt
