// Small backward kernels around the main ones: D = rowsum(dO * O) before (clearing the dQ
// accumulator in the same launch: no cudaMemsetAsync call on the host), and the conversion of
// the atomic dQ accumulator into dq after. Both walk the rows as stored (a variable-length
// batch is one run of total_q rows per head), each row taken by a group of adjacent lanes that
// move 16 bytes per load where the tensors allow it (the tensor-core kernels' blocked accumulator:
// 16 rows a warp, dq_convert_blocked): at 2048 features per token these kernels
// are memory-bound, and element-wise loads with index arithmetic per element made them take
// 10-15% of a backward call at L = 1024 (H200).
#include <cstdint>

#include "../../common/sequence.h"
#include "../common/check.h"
#include "../common/dq_layout.cuh"
#include "../common/fragments.cuh"
#include "../common/numeric.cuh"
#include "../common/quad_transpose.cuh"
#include "launch.h"

namespace flashattn::cuda::simt {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

// kVec values of T loaded or stored as one access (16 bytes at most).
template <class T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Lanes per row and their place: a row of `width` elements takes the smallest power of two of
// lanes that covers it kVec at a time (at most 32); a warp takes 32 >> shift rows at once. The
// whole warp runs every iteration of the walk (warp_row < rows), so D's shuffles see all lanes.
struct RowGroup {
  int sub;           // this lane's place among its row's lanes
  int in_warp;       // this lane's row among the warp's
  int64_t warp_row;  // the warp's first row this iteration
  int64_t step;      // rows per iteration of the grid
  __device__ int64_t row() const { return warp_row + in_warp; }
  __device__ explicit RowGroup(int shift) {
    const int lane = threadIdx.x & 31;
    sub = lane & ((1 << shift) - 1);
    in_warp = lane >> shift;
    warp_row = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) << (5 - shift);
    step = (int64_t(gridDim.x) * kWarps) << (5 - shift);
  }
};

// Offset of stored row `row` ((batch, head, m) order, `len` rows per head) in a tensor of strides s.
__device__ __forceinline__ int64_t row_offset(int64_t row, int64_t len, int64_t heads, const Strides& s) {
  const int64_t m = row % len, bh = row / len;
  return (bh / heads) * s.batch + (bh % heads) * s.head + m * s.row;
}

// D of the rows, kVec values per access.
template <class T, int kVec>
__device__ __forceinline__ void dot_do_o_rows(const BwdParams& p, acc_t<T>* dsum, int lane_shift) {
  using Acc = acc_t<T>;
  using V = Pack<T, kVec>;
  const int64_t len = tensor_rows(p);
  const int64_t rows = tensor_batches(p) * p.heads_q * len;
  const int step = kVec << lane_shift, Ev = int(p.head_dim_v);
  for (RowGroup grp(lane_shift); grp.warp_row < rows; grp.warp_row += grp.step) {
    const int64_t row = grp.row();
    Acc sum = 0;
    if (row < rows) {
      const T* dout = static_cast<const T*>(p.dout) + row_offset(row, len, p.heads_q, p.dout_stride);
      const T* out = static_cast<const T*>(p.out) + row_offset(row, len, p.heads_q, p.out_stride);
      for (int d = grp.sub * kVec; d < Ev; d += step) {
        const V a = *reinterpret_cast<const V*>(dout + d), b = *reinterpret_cast<const V*>(out + d);
#pragma unroll
        for (int i = 0; i < kVec; ++i) sum += to_acc(a.v[i]) * to_acc(b.v[i]);
      }
    }
    for (int off = (1 << lane_shift) >> 1; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    // A used lse output adds its gradient through D (d lse_i / d s_ij = P_ij).
    if (row < rows && grp.sub == 0) dsum[row] = p.dlse ? sum - static_cast<const Acc*>(p.dlse)[row] : sum;
  }
}

// `wide`: every row of dout and out takes accesses of kVec values (16 bytes), else one value each. One kernel
// for both (a branch per call, not per access).
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads)
    dot_do_o_kernel(const BwdParams p, acc_t<T>* dsum, uint4* zero, int64_t zero_vecs, int lane_shift, bool wide) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < zero_vecs; i += int64_t(gridDim.x) * kThreads)
    zero[i] = make_uint4(0, 0, 0, 0);
  if (wide) dot_do_o_rows<T, kVec>(p, dsum, lane_shift);
  else dot_do_o_rows<T, 1>(p, dsum, lane_shift);
}

// dq of the rows from a row-major accumulator (DqRowMajor), kVec values per access. The accumulator's values are
// read in runs of up to DqRowMajor::kRun adjacent columns starting at a multiple of it, which lie together.
template <class T, int kVec>
__device__ __forceinline__ void dq_convert_rows(const BwdParams& p, const acc_t<T>* dq_accum, int slices,
                                                int64_t slice_elems, int lane_shift) {
  using Acc = acc_t<T>;
  constexpr int kRun = kVec < DqRowMajor::kRun ? kVec : DqRowMajor::kRun;
  const DqRowMajor layout{p.head_dim};
  const int64_t len = tensor_rows(p);
  const int64_t rows = tensor_batches(p) * p.heads_q * len;
  const int step = kVec << lane_shift, E = int(p.head_dim);
  const Acc scale = Acc(p.scale);
  for (RowGroup grp(lane_shift); grp.warp_row < rows; grp.warp_row += grp.step) {
    const int64_t row = grp.row();
    if (row >= rows) continue;
    T* dst = static_cast<T*>(p.dq) + row_offset(row, len, p.heads_q, p.dq_stride);
    for (int d = grp.sub * kVec; d < E; d += step) {
      Pack<T, kVec> o;
#pragma unroll
      for (int i = 0; i < kVec; i += kRun) {
        const Acc* src = dq_accum + layout.offset(row, d + i);
        Pack<Acc, kRun> a = *reinterpret_cast<const Pack<Acc, kRun>*>(src);
        for (int sl = 1; sl < slices; ++sl) {  // the deterministic path's accumulators, in order
          const Pack<Acc, kRun> b = *reinterpret_cast<const Pack<Acc, kRun>*>(src + sl * slice_elems);
#pragma unroll
          for (int j = 0; j < kRun; ++j) a.v[j] += b.v[j];
        }
#pragma unroll
        for (int j = 0; j < kRun; ++j) o.v[i + j] = from_acc<T>(a.v[j] * scale);
      }
      *reinterpret_cast<Pack<T, kVec>*>(dst + d) = o;
    }
  }
}

// dq of the rows from the tensor-core kernels' accumulator (DqBlocked; fp16 / bf16, whose dq rows take 16-byte
// stores). A warp takes 16 rows x 32 columns, four 8-column atoms: each lane loads its 16-byte slot of each (rows
// g and g + 8, columns 2 t and 2 t + 1: one whole 512-byte atom a warp and load), and after a quad transpose per row
// (transpose_quad_words) holds 8 adjacent columns of row g and of row g + 8, one 16-byte store each: every load and
// store a whole 16-byte slot, none at the atoms' 512-byte strides.
template <class T>
__device__ __forceinline__ void dq_convert_blocked(const BwdParams& p, const float* dq_accum, int slices,
                                                   int64_t slice_elems) {
  const DqBlocked layout(p.head_dim);
  const int64_t len = tensor_rows(p);
  const int64_t rows = tensor_batches(p) * p.heads_q * len;
  const int atoms = int(layout.cols_padded / 8), quads = (atoms + 3) / 4;
  const int64_t units = (rows + 15) / 16 * quads;  // (16 rows, 4 atoms) a warp
  const int lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
  const float scale = p.scale;
  for (int64_t u = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; u < units; u += int64_t(gridDim.x) * kWarps) {
    const int64_t group = u / quads;
    const int a0 = int(u - group * quads) * 4;
    const float* src = dq_accum + group * 16 * layout.cols_padded + a0 * 128 + lane * 4;
    uint32_t lo[4], hi[4];  // rows g / g + 8: columns 8 (a0 + k) + 2 t, + 1; after the transposes 8 (a0 + t) + 2 k, + 1
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
      if (a0 + k < atoms) {  // (the same for the whole warp)
        a = *reinterpret_cast<const float4*>(src + k * 128);
        for (int sl = 1; sl < slices; ++sl) {  // the deterministic path's accumulators, in order
          const float4 b = *reinterpret_cast<const float4*>(src + k * 128 + sl * slice_elems);
          a = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
      }
      lo[k] = Mma<T>::pack(a.x * scale, a.y * scale);
      hi[k] = Mma<T>::pack(a.z * scale, a.w * scale);
    }
    transpose_quad_words(lo, lane);
    transpose_quad_words(hi, lane);
    if (a0 + t >= atoms) continue;
    const int col = (a0 + t) * 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = group * 16 + g + 8 * r;
      if (row >= rows) continue;
      T* dst = static_cast<T*>(p.dq) + row_offset(row, len, p.heads_q, p.dq_stride) + col;
      const uint32_t(&w)[4] = r == 0 ? lo : hi;
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// `blocked`: the tensor-core kernels' accumulator (dq_convert_blocked), else row-major; `wide`: dq's rows take
// stores of kVec values (16 bytes), else one value each.
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads)
    dq_convert_kernel(const BwdParams p, const acc_t<T>* dq_accum, int slices, int64_t slice_elems, bool blocked,
                      bool wide, int lane_shift) {
  if constexpr (sizeof(T) == 2) {
    if (blocked) return dq_convert_blocked<T>(p, dq_accum, slices, slice_elems);
  }
  if (wide) dq_convert_rows<T, kVec>(p, dq_accum, slices, slice_elems, lane_shift);
  else dq_convert_rows<T, 1>(p, dq_accum, slices, slice_elems, lane_shift);
}

unsigned capped_blocks(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return unsigned(blocks < 65536 ? blocks : 65536);  // grid-stride loops cover the rest
}

// Whether rows of `width` elements at `base` with strides s can be read kVec at a time.
template <class T, int kVec>
bool vec_ok(const void* base, const Strides& s, int64_t width) {
  return reinterpret_cast<uintptr_t>(base) % sizeof(Pack<T, kVec>) == 0 && s.batch % kVec == 0 &&
         s.head % kVec == 0 && s.row % kVec == 0 && width % kVec == 0;
}

// log2 of the lanes a row of `width` elements takes, vec at a time.
int lane_shift(int64_t width, int vec) {
  int shift = 0;
  while (shift < 5 && (int64_t(vec) << shift) < width) ++shift;
  return shift;
}

// The grid of a walk over `rows` rows of `width` elements, `vec` at a time: blocks and the lane shift.
struct RowGrid {
  int shift;
  unsigned blocks;
  RowGrid(int64_t rows, int64_t width, int vec)
      : shift(lane_shift(width, vec)), blocks(capped_blocks(rows, int64_t(kWarps) * (32 >> shift))) {}
};

}  // namespace

template <class T>
void bwd_dot_do_o(const BwdParams& p, void* dsum, void* zero, size_t zero_bytes, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t rows = tensor_batches(p) * p.heads_q * tensor_rows(p);
  const bool wide = vec_ok<T, kVec>(p.dout, p.dout_stride, p.head_dim_v) && vec_ok<T, kVec>(p.out, p.out_stride, 0);
  const RowGrid g(rows, p.head_dim_v, wide ? kVec : 1);
  dot_do_o_kernel<T, kVec><<<g.blocks, kThreads, 0, stream>>>(p, static_cast<acc_t<T>*>(dsum),
                                                              static_cast<uint4*>(zero), int64_t(zero_bytes / 16),
                                                              g.shift, wide);
  check_launch("dot_do_o_kernel");
}

template <class T>
void bwd_dq_convert(const BwdParams& p, const void* dq_accum, bool blocked, int slices, int64_t slice_elems,
                    cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t rows = tensor_batches(p) * p.heads_q * tensor_rows(p);
  // The accumulator is 256-byte aligned; its rows (row-major) or 2-column runs (blocked) too.
  const bool wide = vec_ok<T, kVec>(p.dq, p.dq_stride, p.head_dim);
  // The blocked layout (fp16 / bf16) is the tensor-core kernels', which the plan gives only a dq whose rows take
  // 16-byte stores (bwd_operands_aligned): converted kVec at a time, with no element-wise form.
  if (sizeof(T) == 2 && blocked && !wide)
    return fail("dq_convert_kernel: the tensor-core kernels' dQ accumulator for a dq whose rows do not take 16-byte "
                "stores (the plan's operand alignment was not checked)");
  RowGrid g(rows, p.head_dim, wide ? kVec : 1);
  if (sizeof(T) == 2 && blocked) g.blocks = capped_blocks((rows + 15) / 16 * ((p.head_dim + 31) / 32), kWarps);
  dq_convert_kernel<T, kVec><<<g.blocks, kThreads, 0, stream>>>(p, static_cast<const acc_t<T>*>(dq_accum), slices,
                                                                slice_elems, blocked, wide, g.shift);
  check_launch("dq_convert_kernel");
}

template void bwd_dot_do_o<double>(const BwdParams&, void*, void*, size_t, cudaStream_t);
template void bwd_dot_do_o<float>(const BwdParams&, void*, void*, size_t, cudaStream_t);
template void bwd_dot_do_o<__nv_bfloat16>(const BwdParams&, void*, void*, size_t, cudaStream_t);
template void bwd_dot_do_o<__half>(const BwdParams&, void*, void*, size_t, cudaStream_t);
template void bwd_dq_convert<double>(const BwdParams&, const void*, bool, int, int64_t, cudaStream_t);
template void bwd_dq_convert<float>(const BwdParams&, const void*, bool, int, int64_t, cudaStream_t);
template void bwd_dq_convert<__nv_bfloat16>(const BwdParams&, const void*, bool, int, int64_t, cudaStream_t);
template void bwd_dq_convert<__half>(const BwdParams&, const void*, bool, int, int64_t, cudaStream_t);

}  // namespace flashattn::cuda::simt
