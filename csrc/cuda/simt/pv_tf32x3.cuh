// O = alpha O + P V for the fp32 Q-resident forward (fwd_simt_qres.cuh) on the tensor cores
// (sm_80+), at fp32 accuracy: each operand x is split into x_hi = x rounded to TF32 and
// x_lo = x - x_hi (exact in fp32), and a tile's product is P_lo V_hi + P_hi V_lo + P_hi V_hi in
// m16n8k8 TF32 MMAs: about 22 of fp32's 24 bits per operand, the P_lo V_lo term below them.
// Each tile's product is summed from zero in registers and added to O with one rounded FFMA:
// the MMA truncates when it adds into its accumulator, and over a long row those one-sided
// errors would pile up in O (measured: 4.8x torch's fp32 error over 1000 keys; the scores stay
// on the SIMT product, where TF32 pairs lost too much for logits ~1e4).
//
// V is split in place once per tile by the threads that copied it (x_hi over x, x_lo in a second
// buffer), P per warp as its fragments are read. A tile where some V element is not finite, or
// rounds to inf, takes the exact fp32 product instead (block-wide, so that inf and NaN propagate
// as in torch: inf - inf would make x_lo NaN, and 0 * inf NaN).
#pragma once
#include <cstdint>

#include "../common/mma.cuh"
#include "tile_load_x4.cuh"

namespace flashattn::cuda::simt {

// False for inf, NaN and the x that round to inf (|x| >= the bits 0x7f7ff000): the x whose TF32
// split would not add up to x again.
__device__ __forceinline__ bool tf32_splittable(float x) { return fabsf(x) < 0x1.ffep+127f; }

// Splits the elements of a kRows x kCols tile that thread `tid` copied with load_tile_x4
// (TileX4Share): x_hi over x in `hi` (kKeepX: x stays there, and x_hi = x - x_lo), x_lo at the
// same place in `lo`. Returns whether one of them is not tf32_splittable (then x_hi = x and
// x_lo = 0, so that x_hi + x_lo = x always).
template <int kRows, int kCols, int kThreads, bool kKeepX = false>
__device__ __forceinline__ bool split_tile_tf32(float* hi, float* lo, int ld, int tid) {
  using Share = TileX4Share<kRows, kCols, kThreads>;
  const Share mine(tid);
  bool not_finite = false;
#pragma unroll
  for (int it = 0; it < Share::kSteps; ++it) {
    const int at = (mine.row0 + it * Share::kRowsPerStep) * ld + mine.col;
    float4 x = *reinterpret_cast<const float4*>(hi + at), h, l;
    float* xs = &x.x;
    float* hs = &h.x;
    float* ls = &l.x;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float r = round_tf32(xs[e]);
      const bool finite = tf32_splittable(xs[e]);
      not_finite |= !finite;
      hs[e] = finite ? r : xs[e];
      ls[e] = finite ? xs[e] - r : 0.f;
    }
    if constexpr (!kKeepX) *reinterpret_cast<float4*>(hi + at) = h;
    *reinterpret_cast<float4*>(lo + at) = l;
  }
  return not_finite;
}

// Whether an element of the part of a tile that thread `tid` copied (as split_tile_tf32 walks it)
// is not tf32_splittable.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ bool copied_part_not_splittable(const float* t, int ld, int tid) {
  using Share = TileX4Share<kRows, kCols, kThreads>;
  const Share mine(tid);
  bool bad = false;
#pragma unroll
  for (int it = 0; it < Share::kSteps; ++it) {
    const float4 x = *reinterpret_cast<const float4*>(t + (mine.row0 + it * Share::kRowsPerStep) * ld + mine.col);
    bad |= !tf32_splittable(x.x) | !tf32_splittable(x.y) | !tf32_splittable(x.z) | !tf32_splittable(x.w);
  }
  return bad;
}

// O = alpha O + P V over the tile's kBN keys for the warp's part of the block's 128 x kDim
// output: 8 warps as 4 x 2, a warp owning 32 rows (two 16-row groups, 32 (warp / 2) ..) x
// kDim / 2 columns (kDim / 2 (warp % 2) ..) as kDim / 16 accumulator atoms per row group (lane
// (g, t): rows g and g + 8, columns 8 n + 2t, + 1 of each). Two row groups per warp read each V
// fragment once for both (half the smem reads of one 16-row group per warp). P is [row][key]
// fp32 with row pitch kLdP, V split by split_tile_tf32 (pitch kLd), alpha per row in
// `row_alpha`. `exact`: the tile has a V element that is not finite (see above).
// The k order inside an MMA is permuted (lane t holds keys 2t and 2t + 1 of a step, as
// common/fragments.cuh does for fp64): A and B follow it, so the sum is the same, and a lane reads
// its two keys of a P row as one float2.
template <int kBN, int kDim, int kLd, int kLdP>
struct PvTf32x3 {
  static constexpr int kNA = kDim / 16;  // accumulator atoms per row group of a warp
  static __device__ __forceinline__ int row0(int warp) { return 32 * (warp >> 1); }
  static __device__ __forceinline__ int col0(int warp) { return (kDim / 2) * (warp & 1); }

  // out[row][d] = O[row][d] * row_inv(i, half, row) for the warp's rows below rows_left and columns
  // below cols (rows `row_stride` apart from `out`, the tile's first row); row_inv gives 1 / l of
  // row row0(warp) + 16 i + 8 half + g.
  template <class T, class RowInv>
  static __device__ __forceinline__ void store(const float (&o)[2][kNA][4], RowInv row_inv, T* out, int64_t row_stride,
                                               int64_t rows_left, int cols, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0(warp) + 16 * i + g + 8 * half;
        if (row >= rows_left) continue;
        const float inv = row_inv(i, half, row);
        T* orow = out + row * row_stride;
#pragma unroll
        for (int n = 0; n < kNA; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = col0(warp) + 8 * n + 2 * t + e;
            if (d < cols) orow[d] = from_acc<T>(o[i][n][2 * half + e] * inv);
          }
      }
  }

  // kRawV: V as copied (v_lo unused), split into TF32 halves here as its fragments are read (the
  // warp-specialized forward, fwd_simt_ws.cuh, whose P V warps have issue slots to spare).
  template <bool kRawV = false>
  static __device__ __forceinline__ void run(float (&o)[2][kNA][4], const float* sP, const float* v_hi,
                                             const float* v_lo, const float* row_alpha, bool exact, int warp,
                                             int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int row = row0(warp) + g, col = col0(warp);
    float tile[2][kNA][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int n = 0; n < kNA; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) tile[i][n][e] = 0.f;
    if (!exact) {
#pragma unroll
      for (int k0 = 0; k0 < kBN; k0 += 8) {
        uint32_t a_hi[2][4], a_lo[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float2 top = *reinterpret_cast<const float2*>(sP + (row + 16 * i) * kLdP + k0 + 2 * t);
          const float2 bot = *reinterpret_cast<const float2*>(sP + (row + 16 * i + 8) * kLdP + k0 + 2 * t);
          const float a[4] = {top.x, bot.x, top.y, bot.y};
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // P is in [0, 1], or NaN (then lo = x - r is NaN and reaches O)
            const float r = round_tf32(a[e]);
            a_hi[i][e] = __float_as_uint(r);
            a_lo[i][e] = __float_as_uint(a[e] - r);
          }
        }
        const float* vh = v_hi + (k0 + 2 * t) * kLd + col + g;
        const float* vl = v_lo + (k0 + 2 * t) * kLd + col + g;
#pragma unroll
        for (int n = 0; n < kNA; ++n) {
          uint32_t b_hi[2], b_lo[2];
          if constexpr (kRawV) {
            const float x[2] = {vh[8 * n], vh[kLd + 8 * n]};
#pragma unroll
            for (int e = 0; e < 2; ++e) {  // (finite: the caller took `exact` for tiles that are not)
              const float r = round_tf32(x[e]);
              b_hi[e] = __float_as_uint(r);
              b_lo[e] = __float_as_uint(x[e] - r);
            }
          } else {
            b_hi[0] = __float_as_uint(vh[8 * n]);
            b_hi[1] = __float_as_uint(vh[kLd + 8 * n]);
            b_lo[0] = __float_as_uint(vl[8 * n]);
            b_lo[1] = __float_as_uint(vl[kLd + 8 * n]);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma_tf32(tile[i][n], a_lo[i], b_hi);
            mma_tf32(tile[i][n], a_hi[i], b_lo);
            mma_tf32(tile[i][n], a_hi[i], b_hi);
          }
        }
      }
    } else {
      for (int k = 0; k < kBN; ++k) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float p_top = sP[(row + 16 * i) * kLdP + k], p_bot = sP[(row + 16 * i + 8) * kLdP + k];
#pragma unroll
          for (int n = 0; n < kNA; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int at = k * kLd + col + 8 * n + 2 * t + c;
              const float x = kRawV ? v_hi[at] : v_hi[at] + v_lo[at];
              tile[i][n][c] = fmaf(p_top, x, tile[i][n][c]);
              tile[i][n][2 + c] = fmaf(p_bot, x, tile[i][n][2 + c]);
            }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float alpha_top = row_alpha[row + 16 * i], alpha_bot = row_alpha[row + 16 * i + 8];
#pragma unroll
      for (int n = 0; n < kNA; ++n) {
        o[i][n][0] = fmaf(o[i][n][0], alpha_top, tile[i][n][0]);
        o[i][n][1] = fmaf(o[i][n][1], alpha_top, tile[i][n][1]);
        o[i][n][2] = fmaf(o[i][n][2], alpha_bot, tile[i][n][2]);
        o[i][n][3] = fmaf(o[i][n][3], alpha_bot, tile[i][n][3]);
      }
    }
  }
};

}  // namespace flashattn::cuda::simt
