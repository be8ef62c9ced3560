// Small backward kernels around the main ones: D = rowsum(dO * O) before, and the conversion of
// the atomic dQ accumulator into dq after. Both walk the rows as stored (a variable-length
// batch is one run of total_q rows per head).
#include <cstdint>
#include <type_traits>

#include "../../common/sequence.h"
#include "../common/check.h"
#include "../common/numeric.cuh"
#include "launch.h"

namespace flashattn::cuda::simt {

namespace {

constexpr int kThreads = 256;

// One warp per (batch, head, row).
template <class T>
__global__ void __launch_bounds__(kThreads) dot_do_o_kernel(const BwdParams p, acc_t<T>* dsum) {
  using Acc = acc_t<T>;
  const int64_t len = tensor_rows(p);
  const int64_t rows = tensor_batches(p) * p.heads_q * len;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const int64_t m = row % len;
    const int64_t bh = row / len;
    const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride.batch +
                    h * p.dout_stride.head + m * p.dout_stride.row;
    const T* out = static_cast<const T*>(p.out) + b * p.out_stride.batch +
                   h * p.out_stride.head + m * p.out_stride.row;
    Acc sum = 0;
    for (int64_t d = lane; d < p.head_dim_v; d += 32) sum += to_acc(dout[d]) * to_acc(out[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    // A used lse output adds its gradient through D (d lse_i / d s_ij = P_ij).
    if (lane == 0) dsum[row] = p.dlse ? sum - static_cast<const Acc*>(p.dlse)[row] : sum;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    dq_convert_kernel(const BwdParams p, const acc_t<T>* dq_accum) {
  using Acc = acc_t<T>;
  const int64_t len = tensor_rows(p);
  const int64_t total = tensor_batches(p) * p.heads_q * len * p.head_dim;
  const Acc scale = Acc(p.scale);
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t d = i % p.head_dim;
    const int64_t row = i / p.head_dim;
    const int64_t m = row % len;
    const int64_t bh = row / len;
    const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
    T* dq = static_cast<T*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head +
            m * p.dq_stride.row;
    dq[d] = from_acc<T>(dq_accum[i] * scale);
  }
}

unsigned capped_blocks(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return unsigned(blocks < 65536 ? blocks : 65536);  // grid-stride loops cover the rest
}

}  // namespace

template <class T>
void bwd_dot_do_o(const BwdParams& p, void* dsum, cudaStream_t stream) {
  const int64_t rows = tensor_batches(p) * p.heads_q * tensor_rows(p);
  dot_do_o_kernel<T><<<capped_blocks(rows, kThreads / 32), kThreads, 0, stream>>>(
      p, static_cast<acc_t<T>*>(dsum));
  check_launch("dot_do_o_kernel");
}

template <class T>
void bwd_dq_convert(const BwdParams& p, const void* dq_accum, cudaStream_t stream) {
  const int64_t total = tensor_batches(p) * p.heads_q * tensor_rows(p) * p.head_dim;
  dq_convert_kernel<T><<<capped_blocks(total, kThreads), kThreads, 0, stream>>>(
      p, static_cast<const acc_t<T>*>(dq_accum));
  check_launch("dq_convert_kernel");
}

template void bwd_dot_do_o<double>(const BwdParams&, void*, cudaStream_t);
template void bwd_dot_do_o<float>(const BwdParams&, void*, cudaStream_t);
template void bwd_dot_do_o<__nv_bfloat16>(const BwdParams&, void*, cudaStream_t);
template void bwd_dot_do_o<__half>(const BwdParams&, void*, cudaStream_t);
template void bwd_dq_convert<double>(const BwdParams&, const void*, cudaStream_t);
template void bwd_dq_convert<float>(const BwdParams&, const void*, cudaStream_t);
template void bwd_dq_convert<__nv_bfloat16>(const BwdParams&, const void*, cudaStream_t);
template void bwd_dq_convert<__half>(const BwdParams&, const void*, cudaStream_t);

}  // namespace flashattn::cuda::simt
