#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstring>
#include <type_traits>

#include "../common/append.h"
#include "api.h"

namespace flashattn::cpu {

namespace {
bool allowed(const AppendParams& p, int64_t b) {
  if (!append_lengths_allowed(p, b)) return false;
  if (!p.block_table) return true;
  const PageSpan pages = append_pages(p, b);
  for (int64_t page = pages.first; page < pages.end; ++page)
    if (!block_allowed(p, b, page)) return false;
  return true;
}

// The rotary embedding of one head of head_dim elements of type T (common/rotary.h), computed in
// float32 (float64 for T = double) and rounded once.
template <class T>
struct RotaryHead {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const AppendParams& p;

  Acc table(const void* t, int64_t stride, int64_t position, int64_t m) const {
    const int64_t i = position * stride + m;
    return p.rotary_table_f32 ? Acc(static_cast<const float*>(t)[i]) : Acc(static_cast<const T*>(t)[i]);
  }
  // to = from rotated at `position` (to may be from).
  void operator()(const T* from, T* to, int64_t position) const {
    for (int64_t u = 0; u < rotary_units(p); ++u) {
      const FeatureUnit f = feature_unit(p, u);
      if (!f.rotated) {
        to[f.first] = from[f.first];
        continue;
      }
      const RotatedPair<Acc> r = rotate_pair(Acc(from[f.first]), Acc(from[f.second]),
                                             table(p.rotary_cos, p.rotary_cos_stride, position, u),
                                             table(p.rotary_sin, p.rotary_sin_stride, position, u));
      to[f.first] = T(r.first);
      to[f.second] = T(r.second);
    }
  }
};

// q's rows of sequence b into q_rotated: rotated at their positions, or copied where the
// sequence breaks a rule (its attention rows are NaN; nothing reads past the tables).
template <class T>
void rotate_query(const AppendParams& p, int64_t b, bool ok) {
  const RotaryHead<T> rotate{p};
  for (int64_t i = 0; i < p.len_q; ++i)
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const T* from = static_cast<const T*>(p.q) + b * p.q_stride.batch + i * p.q_stride.row + h * p.q_stride.head;
      T* to = static_cast<T*>(p.q_rotated) + b * p.q_rotated_stride.batch + i * p.q_rotated_stride.row +
              h * p.q_rotated_stride.head;
      if (ok)
        rotate(from, to, q_position(p, b, i));
      else
        std::memmove(to, from, size_t(p.head_dim) * sizeof(T));
    }
}

template <class T>
void append(const AppendParams& p) {
  const RotaryHead<T> rotate{p};
  for (int64_t b = 0; b < p.batch; ++b) {
    const bool ok = allowed(p, b);
    p.seqused[b] = ok ? int32_t(p.seqlens[b] + p.len_new) : -1;
    if (p.q) rotate_query<T>(p, b, ok);
    if (!ok) continue;
    for (int64_t t = 0; t < p.len_new; ++t)
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const T* k = static_cast<const T*>(p.k) + b * p.k_stride.batch + t * p.k_stride.row + h * p.k_stride.head;
        const T* v = static_cast<const T*>(p.v) + b * p.v_stride.batch + t * p.v_stride.row + h * p.v_stride.head;
        T* k_to = static_cast<T*>(p.k_cache) + append_offset(p, p.k_cache_stride, b, t, h);
        if (p.rotary_cos)
          rotate(k, k_to, p.seqlens[b] + t);
        else
          std::memcpy(k_to, k, size_t(p.head_dim) * sizeof(T));
        std::memcpy(static_cast<T*>(p.v_cache) + append_offset(p, p.v_cache_stride, b, t, h), v,
                    size_t(p.head_dim_v) * sizeof(T));
      }
  }
}
}  // namespace

void run_append(const AppendParams& p) {
  switch (p.dtype) {
    case DType::kFloat64: append<double>(p); break;
    case DType::kFloat32: append<float>(p); break;
    case DType::kBFloat16: append<torch::headeronly::BFloat16>(p); break;
    case DType::kFloat16: append<torch::headeronly::Half>(p); break;
  }
}

}  // namespace flashattn::cpu
