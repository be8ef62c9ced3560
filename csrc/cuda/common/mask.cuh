// Causal masking: query row m sees key column n iff n <= m + offset (offset may be any value).
#pragma once
#include <cstdint>

namespace flashattn::cuda {

struct CausalMask {
  bool enabled;
  int64_t offset;

  __device__ __forceinline__ bool visible(int64_t m, int64_t n) const {
    return !enabled || n <= m + offset;
  }
  // One past the last key any query row <= m_last can see (<= 0: none).
  __device__ __forceinline__ int64_t key_end(int64_t m_last, int64_t len_k) const {
    if (!enabled) return len_k;
    const int64_t end = m_last + offset + 1;
    return end < len_k ? end : len_k;
  }
  // How many of the `width` keys from n0 on query row m sees (they are a prefix: 0..width).
  __device__ __forceinline__ int visible_prefix(int64_t m, int64_t n0, int64_t len_k, int width) const {
    const int64_t count = key_end(m, len_k) - n0;
    return count <= 0 ? 0 : count >= width ? width : int(count);
  }
  // First query row that sees key n (rows before it see no key >= n).
  __device__ __forceinline__ int64_t first_query(int64_t n) const {
    if (!enabled) return 0;
    const int64_t m = n - offset;
    return m > 0 ? m : 0;
  }
};

}  // namespace flashattn::cuda
