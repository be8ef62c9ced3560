// Hopper forward (wgmma, warp-specialized), head dim 128 (float8 e4m3 too).
#include "fwd_sm90.cuh"

namespace flashattn::cuda::sm90 {
template bool fwd_ws_ready<__nv_bfloat16, 128, 2>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__nv_bfloat16, 128, 2>(const FwdParams&, const FwdMaps&, cudaStream_t);
template bool fwd_ws_ready<__half, 128, 2>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__half, 128, 2>(const FwdParams&, const FwdMaps&, cudaStream_t);
template bool fwd_ws_ready<__nv_fp8_e4m3, 128, 2>(const FwdParams&, FwdMaps&);
template bool fwd_wgmma<__nv_fp8_e4m3, 128, 2>(const FwdParams&, const FwdMaps&, cudaStream_t);
}  // namespace flashattn::cuda::sm90
