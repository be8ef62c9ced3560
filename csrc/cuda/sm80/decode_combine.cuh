// The second kernel of a decode step whose walks are split into parts (fwd_decode.cuh): adds each row's parts.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/dependent_launch.cuh"
#include "../common/fragments.cuh"
#include "../common/online_softmax.cuh"
#include "fwd_decode.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// Adds the parts of a walk's row (fwd_decode_kernel's slots: O, max and sum per part) in part order and stores
// the row's output and LSE (DecodeGrid::combine_rows rows a walk: a group of fewer rows than a chunk has only
// those); a lane takes columns 4 lane + 128 v. kWarpsARow: the warps that add one row.
// - kDecodeCombineWarps (many parts, up to 128): a block per (walk, row), walk-major; its warps take parts
//   w, w + kWarps, ..., and warp 0 adds the warps' sums in warp order (the same order every call), so that each
//   warp issues few rounds of loads.
// - 1 (at most kDecodeFewParts parts): a warp per (walk, row), kDecodeCombineWarps of them a block, each adding
//   its row's parts alone: no smem, no barrier, an eighth of the blocks (H200, bf16, dim 128, MQA B64 1k in 2
//   parts: 2048 blocks of 8 warps took 7 µs of a 17.9 µs step, 13.4 µs with a warp a row). At most 4 parts: one
//   round of loads (the loop unrolled by 4); MHA B1 8k's 8 parts of 32 rows took 38.9 µs a warp a row against
//   36.8 with eight (two runs of the decode grid).
constexpr int kDecodeCombineWarps = 8, kDecodeFewParts = 4;
template <class Elem, int kDim, int kWarpsARow>
__global__ void __launch_bounds__(32 * kDecodeCombineWarps) decode_combine_kernel(const FwdParams p, DecodeGrid grid) {
  using Cfg = DecodeConfig<Elem, kDim>;
  using M = Mma<Elem>;
  using Exp = ExpDomain<float>;
  constexpr int kRows = Cfg::kRows, kVecs = (kDim + 127) / 128, kWarps = kWarpsARow;
  constexpr int kRowsABlock = kDecodeCombineWarps / kWarpsARow;
  __shared__ float4 sAcc[kWarps > 1 ? kWarps - 1 : 1][kVecs * 32];
  __shared__ float sMax[kWarps > 1 ? kWarps - 1 : 1], sSum[kWarps > 1 ? kWarps - 1 : 1];
  const int lane = threadIdx.x & 31, warp = kWarps == 1 ? 0 : threadIdx.x >> 5;
  const unsigned flat = kWarps == 1 ? blockIdx.x * kRowsABlock + (threadIdx.x >> 5) : blockIdx.x;  // (walk, row)
  const int row = int(flat % unsigned(grid.combine_rows));
  const int64_t walk = flat / unsigned(grid.combine_rows), head = walk / grid.chunks;
  if (kWarps == 1 && head >= p.batch * p.heads_kv) return;  // (the last block's rows past the grid's)
  const int64_t b = head / p.heads_kv, hk = head - b * p.heads_kv, chunk = walk - head * grid.chunks;
  const int64_t group = p.heads_q / p.heads_kv, r = chunk * grid.chunk_rows + row;
  if (r >= group * p.len_q) return;  // (past the last chunk's rows; decode_call: every sequence has len_q rows)
  wait_for_prior_grids();
  const Seq sq = sequence(p, b);

  float mx = neg_inf<float>(), l = 0.f;
  float4 acc[kVecs];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float m_i, float l_i, auto load) { merge_softmax_state(mx, l, acc, m_i, l_i, load); };
  auto col = [&](int v) { return 4 * lane + 128 * v; };
#pragma unroll 4
  for (int j = warp; j < grid.parts; j += kWarps) {
    const DecodeSlot<kRows, kDim> src(grid, walk, j);
    add(__ldcg(src.max(row)), __ldcg(src.sum(row)), [&](int v) {
      const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
      return col(v) < kDim ? __ldcg(reinterpret_cast<const float4*>(src.o(row) + col(v))) : zero;
    });
  }
  if constexpr (kWarps > 1) {
    if (warp > 0) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) sAcc[warp - 1][32 * v + lane] = acc[v];
      if (lane == 0) {
        sMax[warp - 1] = mx;
        sSum[warp - 1] = l;
      }
    }
    __syncthreads();
    if (warp > 0) return;
    for (int w = 0; w < kWarps - 1; ++w) add(sMax[w], sSum[w], [&](int v) { return sAcc[w][32 * v + lane]; });
  }

  // O / l (0 and LSE -inf for a row that sees no key; a NaN sum, an invalid sequence's or part's, propagates)
  const int64_t h = hk * group + r / p.len_q, m = r % p.len_q;
  const bool empty = l == 0.f;
  const float inv = empty ? 0.f : 1.f / l;
  Elem* out = sq.q_rows<Elem>(p.out, p.out_stride, h, m);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    if (col(v) < p.head_dim_v)  // (a multiple of 8: a chunk of 4 is in or out whole)
      *reinterpret_cast<uint2*>(out + col(v)) =
          make_uint2(M::pack(acc[v].x * inv, acc[v].y * inv), M::pack(acc[v].z * inv, acc[v].w * inv));
  }
  if (lane == 0) static_cast<float*>(p.lse)[sq.row_index(p.heads_q, h, m)] = empty ? neg_inf<float>() : Exp::lse(mx, l);
}

}  // namespace flashattn::cuda::sm80
