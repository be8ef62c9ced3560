#include "gather_pages.h"

#include <cstdint>

#include "../common/pages.h"
#include "common/check.h"

namespace flashattn::cuda {
namespace {

// Row by row (a block per row, its threads along the row), in elements of `Word`, the dtype's
// size: a fallback for the calls the decode kernel does not take, not a hot path.
template <class Word>
__global__ void gather_rows_kernel(const FwdParams p, const Word* src, Strides s, Word* dst, int64_t dim) {
  const int64_t rows = p.batch * p.heads_kv * p.len_k;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t j = row % p.len_k, h = row / p.len_k % p.heads_kv, b = row / p.len_k / p.heads_kv;
    const Word* from = src + paged_row(p, s, b, h, j);
    Word* to = dst + row * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) to[c] = from[c];
  }
}

template <class Word>
void gather(const FwdParams& p, const FwdParams& g, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_kv * p.len_k;
  const unsigned blocks = unsigned(rows < 65536 ? rows : 65536);
  gather_rows_kernel<Word><<<blocks, 128, 0, stream>>>(p, static_cast<const Word*>(p.k), p.k_stride,
                                                       static_cast<Word*>(const_cast<void*>(g.k)), p.head_dim);
  check_launch("gather_rows_kernel(k)");
  gather_rows_kernel<Word><<<blocks, 128, 0, stream>>>(p, static_cast<const Word*>(p.v), p.v_stride,
                                                       static_cast<Word*>(const_cast<void*>(g.v)), p.head_dim_v);
  check_launch("gather_rows_kernel(v)");
}

}  // namespace

void gather_pages(const FwdParams& p, cudaStream_t stream) {
  const FwdParams g = with_gathered_pages(p);
  switch (dtype_size(p.dtype)) {
    case 8: gather<uint64_t>(p, g, stream); break;
    case 4: gather<uint32_t>(p, g, stream); break;
    default: gather<uint16_t>(p, g, stream); break;
  }
}

}  // namespace flashattn::cuda
