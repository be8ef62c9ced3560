#include "gather_pages.h"

#include <cstring>

#include "../common/pages.h"
#include "api.h"

namespace flashattn::cpu {

// The gathered copy of a paged k / v where the kernels do not read the pages; they take no other workspace.
size_t fwd_workspace_bytes(const FwdParams& p) { return p.is_paged() && !reads_pages(p) ? gathered_bytes(p) : 0; }

FwdParams gather_pages(const FwdParams& p) {
  const FwdParams g = with_gathered_pages(p);
  const int64_t elem = int64_t(dtype_size(p.dtype));
  const auto gather = [&](const void* src, const Strides& s, void* dst, int64_t dim) {
    const char* from = static_cast<const char*>(src);
    char* to = static_cast<char*>(dst);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads_kv; ++h)
        for (int64_t j = 0; j < p.len_k; ++j, to += dim * elem)
          std::memcpy(to, from + paged_row(p, s, b, h, j) * elem, size_t(dim * elem));
  };
  gather(p.k, p.k_stride, const_cast<void*>(g.k), p.head_dim);
  gather(p.v, p.v_stride, const_cast<void*>(g.v), p.head_dim_v);
  return g;
}

}  // namespace flashattn::cpu
