#include <cstring>

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
}  // namespace

void run_append(const AppendParams& p) {
  const int64_t elem = int64_t(dtype_size(p.dtype));
  for (int64_t b = 0; b < p.batch; ++b) {
    const bool ok = allowed(p, b);
    p.seqused[b] = ok ? int32_t(p.seqlens[b] + p.len_new) : -1;
    if (!ok) continue;
    for (int64_t t = 0; t < p.len_new; ++t)
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const int64_t k_from = b * p.k_stride.batch + t * p.k_stride.row + h * p.k_stride.head;
        const int64_t v_from = b * p.v_stride.batch + t * p.v_stride.row + h * p.v_stride.head;
        std::memcpy(static_cast<char*>(p.k_cache) + append_offset(p, p.k_cache_stride, b, t, h) * elem,
                    static_cast<const char*>(p.k) + k_from * elem, size_t(p.head_dim * elem));
        std::memcpy(static_cast<char*>(p.v_cache) + append_offset(p, p.v_cache_stride, b, t, h) * elem,
                    static_cast<const char*>(p.v) + v_from * elem, size_t(p.head_dim_v * elem));
      }
  }
}

}  // namespace flashattn::cpu
