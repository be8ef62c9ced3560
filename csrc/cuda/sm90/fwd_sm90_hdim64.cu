// Hopper forward (wgmma, warp-specialized), head dim 64: two or three consumers.
#include "fwd_sm90.cuh"

namespace flashattn::cuda::sm90 {
template bool fwd_ws_ready<__nv_bfloat16, 64, 2>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__nv_bfloat16, 64, 2>(const FwdParams&, const FwdMaps&, cudaStream_t);
template bool fwd_ws_ready<__nv_bfloat16, 64, 3>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__nv_bfloat16, 64, 3>(const FwdParams&, const FwdMaps&, cudaStream_t);
template bool fwd_ws_ready<__half, 64, 2>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__half, 64, 2>(const FwdParams&, const FwdMaps&, cudaStream_t);
template bool fwd_ws_ready<__half, 64, 3>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__half, 64, 3>(const FwdParams&, const FwdMaps&, cudaStream_t);
}  // namespace flashattn::cuda::sm90
