// The float8 forward's V^T (launch.h: fwd_fp8_v_bytes, fwd_fp8_v_transposed): the copy the kernel's P V
// reads, keys along each line.
#include <cstdint>

#include "launch.h"

namespace flashattn::cuda::sm90 {

namespace {

// V^T of a float8 call for its kernel (FwdParams::v's layout there): a block per 128 keys of one
// (batch, kv head), through smem, keys past len_k as zeros; 16-byte copies both ways, each dim's 128 keys
// written as one whole 128-byte line (eight threads' 16-key groups side by side).
constexpr int kVtKeys = 128, kVtDim = 128;

__global__ void __launch_bounds__(256) fp8_v_transposed_kernel(const FwdParams p, uint8_t* vt, int64_t keys) {
  // Key r's 16-byte chunk c lies at chunk c ^ (r / 16 % 8) of its row: the eight threads that read one
  // column for eight 16-key groups then read eight different chunks (banks).
  __shared__ __align__(16) uint8_t tile[kVtKeys][kVtDim];
  const int64_t n0 = int64_t(blockIdx.x) * kVtKeys;
  const int hk = int(blockIdx.y), b = int(blockIdx.z);
  const uint8_t* v = static_cast<const uint8_t*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head;
  for (int i = threadIdx.x; i < kVtKeys * kVtDim / 16; i += blockDim.x) {
    const int key = i / (kVtDim / 16), chunk = i % (kVtDim / 16);
    uint4 x = make_uint4(0, 0, 0, 0);
    if (n0 + key < p.len_k) x = *reinterpret_cast<const uint4*>(v + (n0 + key) * p.v_stride.row + chunk * 16);
    *reinterpret_cast<uint4*>(&tile[key][(chunk ^ (key / 16 % 8)) * 16]) = x;
  }
  __syncthreads();
  // Output position 4 t + 2 h + c of a 16-key group holds its key 8 h + 2 t + c (fwd_rows.cuh: pack_p).
  uint8_t* out = vt + ((int64_t(b) * p.heads_kv + hk) * kVtDim) * keys;
  for (int i = threadIdx.x; i < kVtDim * kVtKeys / 16; i += blockDim.x) {
    const int group = i % (kVtKeys / 16), dim = i / (kVtKeys / 16);
    if (n0 + group * 16 >= keys) continue;
    const int col = ((dim / 16) ^ group) * 16 + dim % 16;  // (every key of the group has r / 16 % 8 == group)
    const uint8_t* keys_of_group = &tile[group * 16][col];
    uint32_t words[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) w |= uint32_t(keys_of_group[(8 * (j >> 1) + 2 * t + (j & 1)) * kVtDim]) << (8 * j);
      words[t] = w;
    }
    *reinterpret_cast<uint4*>(out + int64_t(dim) * keys + n0 + group * 16) = make_uint4(words[0], words[1], words[2],
                                                                                       words[3]);
  }
}

}  // namespace

size_t fwd_fp8_v_bytes(const FwdParams& p) {
  return size_t(p.batch) * size_t(p.heads_kv) * kVtDim * size_t((p.len_k + 15) / 16 * 16);
}

bool fwd_fp8_v_transposed(const FwdParams& p, void* vt, cudaStream_t stream) {
  if (p.head_dim_v != kVtDim) return false;
  const int64_t keys = (p.len_k + 15) / 16 * 16;
  const dim3 grid(unsigned((p.len_k + kVtKeys - 1) / kVtKeys), unsigned(p.heads_kv), unsigned(p.batch));
  fp8_v_transposed_kernel<<<grid, 256, 0, stream>>>(p, static_cast<uint8_t*>(vt), keys);
  return check_launch("float8 V transpose");
}

}  // namespace flashattn::cuda::sm90
