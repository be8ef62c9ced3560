#include "gather_pages.h"

#include <torch/csrc/stable/ops.h>

#include <cstring>

#include "../common/pages.h"
#include "api.h"

namespace flashattn::cpu {

// The gathered copy of a paged k / v where the kernels do not read the pages; they take no other workspace.
size_t fwd_workspace_bytes(const FwdParams& p) { return p.is_paged() && !reads_pages(p) ? gathered_bytes(p) : 0; }

FwdParams gather_pages(const FwdParams& p) {
  const FwdParams g = with_gathered_pages(p);
  const int64_t elem = int64_t(dtype_size(p.dtype));
  // (b, h)'s rows on torch's threads, each into its place of the (batch, heads_kv, len_k, dim) copy
  const auto gather = [&](const void* src, const Strides& s, void* dst, int64_t dim) {
    const char* from = static_cast<const char*>(src);
    torch::stable::parallel_for(0, p.batch * p.heads_kv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        char* to = static_cast<char*>(dst) + bh * p.len_k * dim * elem;
        for (int64_t j = 0; j < p.len_k; ++j, to += dim * elem)
          std::memcpy(to, from + paged_row(p, s, bh / p.heads_kv, bh % p.heads_kv, j) * elem, size_t(dim * elem));
      }
    });
  };
  gather(p.k, p.k_stride, const_cast<void*>(g.k), p.head_dim);
  gather(p.v, p.v_stride, const_cast<void*>(g.v), p.head_dim_v);
  return g;
}

}  // namespace flashattn::cpu
