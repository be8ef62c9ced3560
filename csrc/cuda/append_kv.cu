// The in-place append of a KV-cache step (AppendParams, common/append.h), with the rotary embedding
// of its new keys and query rows (common/rotary.h), in one launch.
#include <cstdint>

#include "../common/append.h"
#include "api.h"
#include "common/check.h"
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

// A block per (sequence, row), its threads along the row's heads and features: new key row t
// (rotated with tables) and value row t into the caches, and query row t into q_rotated (rotated,
// or copied for a sequence that breaks a rule). A decode step moves a few KB, so this is one
// short launch. The block's threads check the sequence's pages together. With no rows, a block
// per sequence checks its rules and writes its seqused only.
template <class T>
__global__ void append_kernel(const AppendParams p, int64_t rows) {
  const int64_t b = blockIdx.x / rows, t = blockIdx.x % rows;
  const bool lengths_ok = append_lengths_allowed(p, b);
  bool bad_page = false;
  if (p.block_table && lengths_ok) {
    const PageSpan pages = append_pages(p, b);
    for (int64_t page = pages.first + threadIdx.x; page < pages.end; page += blockDim.x)
      bad_page = bad_page || !block_allowed(p, b, page);
  }
  const bool allowed = !__syncthreads_or(!lengths_ok || bad_page);
  if (t == 0 && threadIdx.x == 0) p.seqused[b] = allowed ? int32_t(p.seqlens[b] + p.len_new) : -1;
  const int64_t units = rotary_units(p);
  if (allowed && t < p.len_new) {
    const int64_t k_work = p.heads_kv * units, all_work = k_work + p.heads_kv * p.head_dim_v;
    for (int64_t i = threadIdx.x; i < all_work; i += blockDim.x) {
      if (i < k_work) {
        const int64_t h = i / units;
        const T* from = static_cast<const T*>(p.k) + b * p.k_stride.batch + t * p.k_stride.row + h * p.k_stride.head;
        T* to = static_cast<T*>(p.k_cache) + append_offset(p, p.k_cache_stride, b, t, h);
        rotate_unit(p, from, to, int64_t(p.seqlens[b]) + t, i % units);
      } else {
        const int64_t h = (i - k_work) / p.head_dim_v, c = (i - k_work) % p.head_dim_v;
        const T* from = static_cast<const T*>(p.v) + b * p.v_stride.batch + t * p.v_stride.row + h * p.v_stride.head;
        static_cast<T*>(p.v_cache)[append_offset(p, p.v_cache_stride, b, t, h) + c] = from[c];
      }
    }
  }
  if (p.q && t < p.len_q) {
    const int64_t q_units = allowed ? units : p.head_dim;
    for (int64_t i = threadIdx.x; i < p.heads_q * q_units; i += blockDim.x) {
      const int64_t h = i / q_units, u = i % q_units;
      const T* from = static_cast<const T*>(p.q) + b * p.q_stride.batch + t * p.q_stride.row + h * p.q_stride.head;
      T* to = static_cast<T*>(p.q_rotated) + b * p.q_rotated_stride.batch + t * p.q_rotated_stride.row +
              h * p.q_rotated_stride.head;
      if (allowed)
        rotate_unit(p, from, to, q_position(p, b, t), u);
      else
        to[u] = from[u];
    }
  }
}

template <class T>
void append(const AppendParams& p, cudaStream_t stream) {
  const int64_t q_rows = p.q ? p.len_q : 0;
  const int64_t rows = p.len_new > q_rows ? p.len_new : q_rows > 0 ? q_rows : 1;
  if (grid_too_large(p.batch * rows, "append_kernel")) return;
  append_kernel<T><<<unsigned(p.batch * rows), 128, 0, stream>>>(p, rows);
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
