// The in-place append of a KV-cache step (AppendParams, common/append.h), with the rotary embedding
// of its new keys and query rows (common/rotary.h), in one launch.
#include <cstdint>

#include "../common/append.h"
#include "api.h"
#include "common/check.h"
#include "common/dependent_launch.cuh"
#include "common/numeric.cuh"

namespace flashattn::cuda {
namespace {

// A table entry in the accumulator type (tables in T or in float32).
template <class T>
__device__ __forceinline__ acc_t<T> table_entry(const AppendParams& p, const void* table, int64_t stride,
                                                int64_t position, int64_t m) {
  const int64_t i = position * stride + m;
  return p.rotary_table_f32 ? acc_t<T>(static_cast<const float*>(table)[i]) : to_acc(static_cast<const T*>(table)[i]);
}

// Unit u of a head (common/rotary.h): its pair rotated at `position`, or its feature copied.
// Without tables (rotary_half = 0) every unit is a feature copied.
template <class T>
__device__ __forceinline__ void rotate_unit(const AppendParams& p, const T* from, T* to, int64_t position,
                                            int64_t u) {
  const FeatureUnit f = feature_unit(p, u);
  if (!f.rotated) {
    to[f.first] = from[f.first];
    return;
  }
  const RotatedPair<acc_t<T>> r =
      rotate_pair(to_acc(from[f.first]), to_acc(from[f.second]),
                  table_entry<T>(p, p.rotary_cos, p.rotary_cos_stride, position, u),
                  table_entry<T>(p, p.rotary_sin, p.rotary_sin_stride, position, u));
  to[f.first] = from_acc<T>(r.first);
  to[f.second] = from_acc<T>(r.second);
}

// Copies a row of n elements across the warp's lanes: 16 bytes a lane where both rows are 16-byte
// aligned and n fills whole 16-byte chunks, else an element a lane.
template <class T>
__device__ __forceinline__ void copy_row(const T* from, T* to, int64_t n, int lane) {
  constexpr int64_t kVec = 16 / sizeof(T);
  if (((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to)) & 15) == 0 && n % kVec == 0) {
    for (int64_t c = lane; c < n / kVec; c += 32)
      reinterpret_cast<uint4*>(to)[c] = reinterpret_cast<const uint4*>(from)[c];
    return;
  }
  for (int64_t c = lane; c < n; c += 32) to[c] = from[c];
}

// A row of a head rotated at `position` (units across the warp's lanes), or copied where there are no
// tables or the sequence breaks a rule.
template <class T>
__device__ __forceinline__ void rotate_row(const AppendParams& p, const T* from, T* to, int64_t position,
                                           bool rotate, int lane) {
  if (!rotate || p.rotary_half == 0) return copy_row(from, to, p.head_dim, lane);
  const int64_t units = rotary_units(p);
  for (int64_t u = lane; u < units; u += 32) rotate_unit(p, from, to, position, u);
}

// A warp per (sequence, row, head), kAppendWarps heads to a block: new key row t of kv head h (rotated
// with tables) and its value row into the caches, and query row t of query head h into q_rotated
// (rotated, or copied for a sequence that breaks a rule); heads = the larger of heads_kv and heads_q.
// (A block per (sequence, row) walking every head with its threads along the features took 40 us for
// one row of 32 heads on an H100: a decode step's append would cost as much as its attention.) Each
// block checks its sequence's rules and pages (its threads together: the same answer in every block of
// the sequence); block (b, 0, 0) writes seqused. With no rows, a block per sequence checks its rules and
// writes its seqused only. The blocks let the attention's launch start (sm_90: its blocks wait for this grid
// before they read anything).
constexpr int kAppendWarps = 4;

template <class T>
__global__ void __launch_bounds__(32 * kAppendWarps) append_kernel(const AppendParams p, int64_t rows,
                                                                   int64_t head_blocks) {
  allow_dependent_launch();
  // (in 32 bits: the grid's size is below 2^32, and two 64-bit divisions, calls of ~70 instructions, sat before
  // the first load of a step whose attention waits for this grid)
  const unsigned hb = blockIdx.x % unsigned(head_blocks), bt = blockIdx.x / unsigned(head_blocks);
  const int64_t b = bt / unsigned(rows), t = bt % unsigned(rows);
  const int lane = threadIdx.x & 31;
  const int64_t h = hb * kAppendWarps + (threadIdx.x >> 5);
  const bool lengths_ok = append_lengths_allowed(p, b);
  bool bad_page = false;
  if (p.block_table && lengths_ok) {
    const PageSpan pages = append_pages(p, b);
    for (int64_t page = pages.first + threadIdx.x; page < pages.end; page += blockDim.x)
      bad_page = bad_page || !block_allowed(p, b, page);
  }
  const bool allowed = !__syncthreads_or(!lengths_ok || bad_page);
  if (t == 0 && hb == 0 && threadIdx.x == 0) p.seqused[b] = allowed ? int32_t(p.seqlens[b] + p.len_new) : -1;
  if (allowed && t < p.len_new && h < p.heads_kv) {
    const T* k_from = static_cast<const T*>(p.k) + b * p.k_stride.batch + t * p.k_stride.row + h * p.k_stride.head;
    T* k_to = static_cast<T*>(p.k_cache) + append_offset(p, p.k_cache_stride, b, t, h);
    rotate_row(p, k_from, k_to, int64_t(p.seqlens[b]) + t, true, lane);
    const T* v_from = static_cast<const T*>(p.v) + b * p.v_stride.batch + t * p.v_stride.row + h * p.v_stride.head;
    T* v_to = static_cast<T*>(p.v_cache) + append_offset(p, p.v_cache_stride, b, t, h);
    copy_row(v_from, v_to, p.head_dim_v, lane);
  }
  if (p.q && t < p.len_q && h < p.heads_q) {
    const T* from = static_cast<const T*>(p.q) + b * p.q_stride.batch + t * p.q_stride.row + h * p.q_stride.head;
    T* to = static_cast<T*>(p.q_rotated) + b * p.q_rotated_stride.batch + t * p.q_rotated_stride.row +
            h * p.q_rotated_stride.head;
    rotate_row(p, from, to, allowed ? q_position(p, b, t) : 0, allowed, lane);
  }
}

template <class T>
void append(const AppendParams& p, cudaStream_t stream) {
  const int64_t q_rows = p.q ? p.len_q : 0;
  const int64_t rows = p.len_new > q_rows ? p.len_new : q_rows > 0 ? q_rows : 1;
  // Blocks over the heads that have rows to write (none: one block per sequence, for its rules).
  const int64_t heads_kv = p.len_new > 0 ? p.heads_kv : 0, heads_q = q_rows > 0 ? p.heads_q : 0;
  const int64_t heads = heads_kv > heads_q ? heads_kv : heads_q > 0 ? heads_q : 1;
  const int64_t head_blocks = (heads + kAppendWarps - 1) / kAppendWarps;
  if (grid_too_large(p.batch * rows * head_blocks, "append_kernel")) return;
  append_kernel<T><<<unsigned(p.batch * rows * head_blocks), 32 * kAppendWarps, 0, stream>>>(p, rows, head_blocks);
  check_launch("append_kernel");
}

}  // namespace

std::string run_append(const AppendParams& p, void* stream) {
  take_error();  // a new call: nothing recorded yet
  if (p.batch == 0) return {};
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat64: append<double>(p, s); break;
    case DType::kFloat32: append<float>(p, s); break;
    case DType::kBFloat16: append<__nv_bfloat16>(p, s); break;
    case DType::kFloat16: append<__half>(p, s); break;
  }
  return take_error();
}

}  // namespace flashattn::cuda
